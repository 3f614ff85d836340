defmodule Moat.FallbackTest do
  # Ops without an MLX implementation run on Nx.BinaryBackend, visibly.
  use ExUnit.Case, async: false
  import ExUnit.CaptureLog
  import Moat.Case, only: [forward_events: 1]

  setup do
    Nx.default_backend(Moat.Backend)
    on_exit(fn -> Application.delete_env(:moat, :fallback) end)
    :persistent_term.erase({Moat.Backend, :warned, :reduce})
    :ok
  end

  defp sum_by_reduce(t), do: Nx.reduce(t, 0, fn x, acc -> Nx.add(x, acc) end)

  test "a fallback computes the right result, on Moat, and emits telemetry with op, shapes and types" do
    forward_events([[:moat, :fallback, :start], [:moat, :fallback, :stop]])

    result = sum_by_reduce(Nx.tensor([[1, 2], [3, 4]]))
    assert %Moat.Backend{} = result.data
    assert Nx.to_number(result) == 10

    assert_receive {:telemetry, [:moat, :fallback, :start], _, meta}
    assert meta.op == :reduce
    assert {2, 2} in meta.input_shapes
    assert {:s, 32} in meta.input_types
    assert_receive {:telemetry, [:moat, :fallback, :stop], %{duration: _}, %{op: :reduce}}
  end

  test ":warn logs once per op" do
    Application.put_env(:moat, :fallback, :warn)
    first = capture_log(fn -> sum_by_reduce(Nx.tensor([1, 2])) end)
    assert first =~ "reduce has no MLX implementation"
    assert capture_log(fn -> sum_by_reduce(Nx.tensor([1, 2])) end) == ""
  end

  test ":raise refuses to fall back" do
    Application.put_env(:moat, :fallback, :raise)

    assert_raise ArgumentError, ~r/reduce has no MLX implementation/, fn ->
      sum_by_reduce(Nx.tensor([1, 2]))
    end
  end
end

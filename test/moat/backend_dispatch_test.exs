defmodule Moat.BackendDispatchTest do
  # Moat.Backend's one-match path for an op whose inputs are Moat tensors of
  # one worker, of types MLX has (docs/latency.md, "Moat.Backend's front
  # end"), and everything it must hand to the general path: each case gives
  # the result or the error it gave before that path existed.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.Error

  setup_all do
    {:ok, one: start_worker(:dispatch_one), two: start_worker(:dispatch_two)}
  end

  defp on(worker, values, type \\ :f32), do: Nx.tensor(values, type: type, backend: {Moat.Backend, worker: worker})

  defp values(t), do: Nx.to_flat_list(t)

  test "unary, binary, comparison, shape and reduction callbacks on one worker", %{one: w} do
    a = on(w, [1.0, 2.0, 3.0, 4.0])
    b = on(w, [4.0, 3.0, 2.0, 1.0])
    assert values(Nx.add(a, b)) == [5.0, 5.0, 5.0, 5.0]
    assert values(Nx.negate(a)) == [-1.0, -2.0, -3.0, -4.0]
    assert values(Nx.greater(a, b)) == [0, 0, 1, 1]
    assert values(Nx.reshape(a, {2, 2}) |> Nx.transpose()) == [1.0, 3.0, 2.0, 4.0]
    assert Nx.to_number(Nx.sum(a)) == 10.0
    assert values(Nx.argmax(Nx.reshape(a, {2, 2}), axis: 1)) == [1, 1]
    assert values(Nx.as_type(a, :s32)) == [1, 2, 3, 4]
    # A chain: each result is the next op's input.
    assert values(Enum.reduce(1..100, a, fn _, acc -> Nx.add(acc, b) end)) == [401.0, 302.0, 203.0, 104.0]
  end

  test "a deallocated input raises a Moat.Error naming the op", %{one: w} do
    a = on(w, [1.0, 2.0])
    b = on(w, [3.0, 4.0])
    :ok = Nx.backend_deallocate(b)

    for {op, fun} <- [
          add: fn -> Nx.add(a, b) end,
          subtract: fn -> Nx.subtract(b, a) end,
          exp: fn -> Nx.exp(b) end,
          sum: fn -> Nx.sum(b) end,
          reshape: fn -> Nx.reshape(b, {2, 1}) end
        ] do
      error = assert_raise Error, ~r/was deallocated/, fun
      assert {error.reason, error.op} == {:deallocated, op}
    end

    assert values(a) == [1.0, 2.0]
  end

  test "inputs of two workers, or of another backend, are copied into the first one's", %{one: w1, two: w2} do
    a = on(w1, [1.0, 2.0])
    b = on(w2, [10.0, 20.0])
    c = Nx.tensor([100.0, 200.0], backend: Nx.BinaryBackend)
    sum = Nx.add(a, b)
    assert sum.data.ref.worker == w1
    assert values(sum) == [11.0, 22.0]
    assert values(Nx.add(a, c)) == [101.0, 202.0]
    assert values(Nx.multiply(a, 3)) == [3.0, 6.0]
  end

  # f8 is computed in f64 (Moat.Types), which a GPU worker refuses.
  @tag :f64
  test "types MLX does not have still go through Moat.Types", %{one: w} do
    f8 = on(w, [1.5, 2.0, -3.0], :f8)
    s4 = on(w, [7, -8, 3], :s4)
    bin = fn t -> Nx.backend_copy(t, Nx.BinaryBackend) end
    assert Nx.add(f8, f8) |> values() == Nx.add(bin.(f8), bin.(f8)) |> values()
    assert Nx.add(s4, s4) |> values() == Nx.add(bin.(s4), bin.(s4)) |> values()
    # An MLX-typed input beside an emulated output, and the reverse.
    assert Nx.add(on(w, [1, 2, 3], :u8), s4) |> values() == [8, -6, 6]
    assert Nx.as_type(f8, :f32) |> values() == [1.5, 2.0, -3.0]
    assert Nx.exp(s4).type == {:f, 32}
  end

  test "a stale handle raises :stale_generation" do
    w = start_worker(:dispatch_restart)
    a = on(w, [1.0, 2.0])
    generation = Moat.Client.conn(w).generation
    kill(os_pid(w))
    await_generation_after(w, generation)
    error = assert_raise Error, fn -> Nx.add(a, a) end
    assert {error.reason, error.op} == {:stale_generation, :add}
  end

  test "Moat.Compiler records the ops instead of sending them" do
    a = Nx.tensor([1.0, 2.0], backend: Moat.Backend)
    fun = Nx.Defn.jit(fn x, y -> x |> Nx.add(y) |> Nx.exp() |> Nx.sum() end, compiler: Moat.Compiler)
    assert_in_delta Nx.to_number(fun.(a, a)), :math.exp(2) + :math.exp(4), 1.0e-3
  end

  # Nx inlines a closure's Moat tensors onto Nx.BinaryBackend, so this
  # drives the Recorder as a lowering does: a Moat tensor the graph holds
  # (`Moat.Compiler`'s captures) is recorded as an input, never sent.
  test "while recording, one-input and two-input ops on a Moat tensor become steps", %{one: w} do
    alias Moat.Compiler.Recorder
    c = on(w, [1.0, 2.0])
    Recorder.start()

    try do
      Recorder.update(&%{&1 | scopes: [%{steps: [], memo: %{}, ids: MapSet.new()}]})
      e = Nx.exp(c)
      s = Nx.add(c, c)
      assert %Recorder.Slot{} = e.data.ref
      assert %Recorder.Slot{} = s.data.ref
      %{scopes: [%{steps: steps}], captures: captures} = Recorder.get()
      assert [{:add, [n, n], _, _}, {:exp, [n], _, _}] = steps
      assert captures == %{{:ref, c.data.ref} => n}
    after
      Recorder.stop()
    end

    # Out of the recording, the same op is sent.
    assert %Moat.Ref{} = Nx.exp(c).data.ref
    assert_in_delta Nx.to_number(Nx.sum(Nx.add(c, c))), 6.0, 1.0e-6
  end
end

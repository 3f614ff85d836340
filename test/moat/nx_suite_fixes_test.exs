defmodule Moat.NxSuiteFixesTest do
  # What Nx's own ExUnit suite (bin/nx-suite) found on Moat, each checked
  # against Nx.BinaryBackend on a real worker.
  use ExUnit.Case, async: true

  defp moat(t), do: Nx.backend_transfer(t, Moat.Backend)
  defp host(t), do: Nx.backend_transfer(t, Nx.BinaryBackend)

  test "boolean options are falsy when nil, as in Nx" do
    a = Nx.tensor([1.0, :nan])
    assert host(Nx.all_close(moat(a), moat(a), equal_nan: nil)) == Nx.tensor(0, type: :u8)
    assert host(Nx.all_close(moat(a), moat(a), equal_nan: true)) == Nx.tensor(1, type: :u8)

    t = Nx.iota({2, 3}, type: :f32)
    assert host(Nx.sum(moat(t), axes: [1], keep_axes: nil)) == Nx.sum(t, axes: [1])
    assert host(Nx.argmax(moat(t), axis: 1, keep_axis: nil)) == Nx.argmax(t, axis: 1)
    assert host(Nx.cumulative_sum(moat(t), axis: 1, reverse: nil)) == Nx.cumulative_sum(t, axis: 1)
  end
end

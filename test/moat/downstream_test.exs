defmodule Moat.DownstreamTest do
  # What the downstream suites (bin/downstream-suite, docs/downstream.md)
  # showed about Moat, pinned on a real worker.
  use ExUnit.Case, async: true

  defp moat(t), do: Nx.backend_transfer(t, Moat.Backend)
  defp bits(t), do: t |> Nx.backend_transfer(Nx.BinaryBackend) |> Nx.to_binary()

  test "bf16 results are rounded to nearest, where Nx.BinaryBackend truncates (Axon's bf16 activations)" do
    x = Nx.tensor([-1.0, -2.0, -3.0], type: :bf16)
    # exp(-2) = 0.135335: the bf16 neighbours are 0.134766 and 0.135742.
    assert Nx.to_flat_list(Nx.exp(moat(x))) == [0.3671875, 0.1357421875, 0.0498046875]
    assert Nx.to_flat_list(Nx.exp(x)) == [0.3671875, 0.134765625, 0.049560546875]
    # tanh(-1) = -0.761594: neighbours -0.757813 and -0.761719.
    assert Nx.to_flat_list(Nx.tanh(moat(x))) |> hd() == -0.76171875
    # Converting f32 to bf16 rounds the same way.
    f = Nx.tensor([0.1353352832366127], type: :f32)
    assert bits(Nx.as_type(moat(f), :bf16)) == bits(Nx.tensor([0.1357421875], type: :bf16))
  end
end

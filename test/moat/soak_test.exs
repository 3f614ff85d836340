defmodule Moat.SoakTest do
  # Temporaries are released without deallocate: a loop that creates,
  # computes and drops 4 MiB tensors next to a 48 MiB live set keeps the
  # worker's active memory under twice the live set plus the cache limit, and
  # ends back at the live set.
  use ExUnit.Case, async: false
  import Moat.Case

  @mib 1024 * 1024
  @cache_limit 16 * @mib

  defp soak(iterations) do
    w = start_worker(:soak_worker)
    backend = {Moat.Backend, worker: w}
    Moat.set_cache_limit(@cache_limit, w)

    live =
      for i <- 1..12 do
        :binary.copy(f32([i * 1.0]), @mib) |> Nx.from_binary(:f32, backend: backend)
      end

    Enum.each(live, &Moat.eval(&1.data.ref))
    %{active: live_bytes} = Moat.memory_info(w)
    assert live_bytes == 48 * @mib
    Moat.reset_peak_memory(w)

    for i <- 1..iterations do
      x = Enum.at(live, rem(i, 12))
      x |> Nx.multiply(x) |> Nx.add(x) |> Nx.sum() |> Nx.to_number()
    end

    # MLX's peak is the most active memory reached: the bound held throughout.
    # On a GPU, MLX frees what a finished kernel held on its completion
    # thread, a moment later, so one iteration's two temporaries may still be
    # counted when the next begins (the H200 showed 8.4 MB over the CPU's
    # bound once); the end state below is exact on both.
    %{peak: peak} = Moat.memory_info(w)
    in_flight = if Moat.Worker.info(w).device == :gpu, do: 2 * 4 * @mib, else: 0
    assert peak < 2 * live_bytes + @cache_limit + in_flight

    :erlang.garbage_collect()

    eventually(fn ->
      %{active: active, tensors: tensors} = Moat.memory_info(w)
      active == live_bytes and tensors == 12
    end)

    # The live set is intact.
    assert Nx.to_number(Nx.sum(Enum.at(live, 11))) == 12.0 * @mib
  end

  test "1,000 iterations stay within the bound" do
    soak(1_000)
  end

  @tag :soak
  @tag timeout: 600_000
  test "20,000 iterations stay within the bound" do
    soak(20_000)
  end
end

# :soak (long variants) runs with bin/soak; :hex_tarball (builds the worker
# from the Hex package, minutes) with `mix test --only hex_tarball`. :large
# (a 2 GiB round trip) needs about 8 GiB free; it is skipped where there is
# less.
large = if Moat.Reliability.mem_available() > 10 * 1024 ** 3, do: [], else: [:large]

# :gpu runs where the default worker computes on a GPU (MOAT_MLX=cuda13 on
# an NVIDIA machine: bin/gpu).
gpu =
  case Moat.Worker.info() do
    %{device: :gpu} ->
      []

    info ->
      IO.puts(
        "Skipping the :gpu tests: this worker's MLX #{info.mlx} has #{inspect(info.devices)} (bin/gpu runs them on a GPU)"
      )

      [:gpu]
  end

ExUnit.start(exclude: [:soak, :hex_tarball] ++ large ++ gpu)

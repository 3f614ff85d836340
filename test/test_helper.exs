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

# Where the default worker is on a GPU: :f64 tests need float64 throughout
# (Moat computes f8 in f64 and holds c128 as f64 pairs), which a GPU worker
# refuses with an ArgumentError; :cpu_only tests check what holds only for
# the CPU build (each says why).
on_gpu =
  if gpu == [] do
    IO.puts(
      "Skipping the :f64 tests (MLX's CUDA backend has no float64; test/moat/gpu_test.exs checks the " <>
        "ArgumentError) and the :cpu_only tests (each says why)"
    )

    [:f64, :cpu_only]
  else
    []
  end

# Moat.FailureSummary repeats the failed tests' names after the run, where
# a CI log's tail shows them.
ExUnit.start(
  exclude: [:soak, :hex_tarball] ++ large ++ gpu ++ on_gpu,
  formatters: [ExUnit.CLIFormatter, Moat.FailureSummary]
)

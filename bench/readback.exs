# The 64 MiB rows of bench/latency.exs alone, for large-readback work
# (docs/latency.md): a plain `:binary.copy` in the VM, a tensor's first
# readback, a repeated one, a repeated one with every byte read (copied),
# and an upload, all with shared memory on, beside a worker that reads back
# through sealed files (`shared_memory: :sealed_files`). Each row is settled
# before its timing (`Bench.Transfers.settle/1`): what earlier rows released
# is freed first, so it lands on no row. With MOAT_WORKER_B set, a second
# worker runs that executable beside the default one, rep by rep, so two
# worker builds compare within one run:
#
#   MOAT_WORKER_B=/path/to/other/moat_port mix run -r bench/support.exs bench/readback.exs

reps = String.to_integer(System.get_env("REPS", "11"))

workers =
  case System.get_env("MOAT_WORKER_B") do
    nil ->
      {:ok, _} = Moat.Worker.start_link(name: :readback_sealed, shared_memory: :sealed_files)
      [{"this worker", Moat.Worker}, {"`shared_memory: :sealed_files`", :readback_sealed}]

    path ->
      {:ok, _} = Moat.Worker.start_link(name: :readback_b, worker_path: path)
      [{"this worker", Moat.Worker}, {path, :readback_b}]
  end

big = Bench.Transfers.measure(workers, reps)

IO.puts("### 64 MiB (GB/s, medians of #{reps} reps)\n")
Bench.Transfers.table(workers, big)

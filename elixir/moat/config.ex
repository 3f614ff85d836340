defmodule Moat.Config do
  @moduledoc """
  Every `config :moat, ...` key, its default and when it is read: the one
  place defaults live. README's configuration table is `table/0` (a test
  checks it).

  Keys read when a worker starts apply to each new worker (a restart
  included), so `config/runtime.exs` sets them for a release at boot;
  `Moat.Worker`'s options of the same name override them per worker. Keys
  read on use can be changed at any time with `Application.put_env/3`.
  """

  @mib 1024 * 1024

  # {key, default, when read, what it is}
  @keys [
    {:start_worker, true, :boot, "start `Moat.Worker` under `Moat.Supervisor`"},
    {:max_restarts, 20, :boot, "restart intensity of `Moat.Supervisor`: at most this many restarts…"},
    {:max_seconds, 5, :boot, "…within this many seconds, then it gives up"},
    {:worker_path, nil, :worker,
     "the `moat_port` executable (`nil`: `$MOAT_WORKER`, else `priv/moat_port` of `:moat`)"},
    {:worker_log_level, :warning, :worker, "the worker's stderr log level (`Moat.Worker`'s `:log_level`)"},
    {:memory_limit, nil, :worker,
     "the worker's memory limit in bytes (`nil`: MLX's, about 80% of RAM; `Moat.set_memory_limit/2` changes it live)"},
    {:window, 1024, :worker, "fire-and-forget frames sent but not yet acknowledged before a sender waits"},
    {:batch_writes, false, :worker,
     "`true`: fire-and-forget frames of a local worker queue in one ordered outbox (in the finalizer NIF) and go out as batch packets (protocol.md §1, \"Batches\"), a call behind queued frames writing them with its own frame last; faster for casts while the other cores are busy, slower for calls on a quiet machine (docs/latency.md, \"Batched writes, landed\"); `false`: every frame is written by its caller (remote workers and VMs without the NIF always are)"},
    {:chunk_bytes, 64 * @mib, :worker, "chunk size of large tensors on the pipe"},
    {:max_frame_bytes, 320 * @mib, :worker, "the largest frame either side accepts"},
    {:shared_memory, true, :worker,
     "move large tensors through shared memory where the worker is on this host (`:sealed_files`: readbacks only through sealed files)"},
    {:shared_memory_threshold, @mib, :worker, "the smallest tensor (bytes) that goes through shared memory"},
    {:hello_timeout, 15_000, :worker,
     "milliseconds to wait for the worker's handshake (a remote worker's: to connect, retrying with backoff)"},
    {:gc_nudge, 1_000, :worker, "milliseconds between collections of idle tensor creators (`false`: off)"},
    {:debug, [], :worker, "`[detect_non_finite: true]` fails every op whose float results hold NaN or Inf"},
    {:device, nil, :worker,
     "the device a worker runs its ops on (`nil`: the best one it announces, the GPU on a CUDA build that sees one)"},
    {:tf32, false, :worker, "f32 matrix products on the GPU may use TF32 tensor cores (MLX's own default is `true`)"},
    {:watchdog, 30_000, :worker,
     "milliseconds without progress, while calls wait, after which a worker counts as hung and is killed (`false`: off)"},
    {:buffer_files, nil, :worker,
     "a CPU worker keeps MLX's buffers of 1 MiB or more in memory files, which a large readback maps without a copy (`false`: in MLX's own memory, read back by a copy; `nil`: `$MOAT_BUFFER_FILES`, on unless it is `0`)"},
    {:kernel_cache, nil, :worker,
     "where MLX keeps fused kernels of `Moat.Compiler`'s `fuse: true` (`nil`: `~/.cache/moat-kernels`)"},
    {:restart_wait, 5_000, :use,
     "milliseconds a call waits for a worker that is restarting or reconnecting before it fails with `:worker_unavailable`"},
    {:fallback, :silent, :use, "ops that run on `Nx.BinaryBackend`: `:silent`, `:warn` or `:raise`"},
    {:inspect_backend, true, :use, "`inspect/2` of a tensor shows `Moat.Backend(device)` on its first line"},
    {:max_programs, 256, :use, "programs `Moat.Compiler` keeps per worker, and jitted functions it keeps lowered"},
    {:call_spin_us, 50, :use,
     "µs a synchronous call to a worker on this host waits awake (a NIF polling the pipe the worker answers on, at most 200) before it blocks, so that the reply needs no sleeping CPU woken (docs/latency.md, \"The caller waits awake\"; `0`: off)"},
    {:mlx, :cpu, :compile,
     "the MLX build the worker links (`:cpu`, `:cuda13`; `$MOAT_MLX` overrides; `mix moat.setup` installs it)"}
  ]

  @defaults for {key, default, _, _} <- @keys, do: {key, default}
  @read %{
    boot: "application start",
    worker: "worker start",
    use: "on use (live)",
    compile: "compile time"
  }

  @doc "Every key with its default."
  @spec defaults() :: keyword()
  def defaults, do: @defaults

  @doc "The configured value of `key`, or its default."
  @spec get(atom()) :: term()
  def get(key) do
    case List.keyfind(@defaults, key, 0) do
      {^key, default} -> Application.get_env(:moat, key, default)
      nil -> raise ArgumentError, "Moat.Config: unknown key #{inspect(key)}"
    end
  end

  @doc "`key` from `opts` (a worker's options), else `get/1`."
  @spec get(keyword(), atom()) :: term()
  def get(opts, key), do: Keyword.get_lazy(opts, key, fn -> get(key) end)

  @doc "The configuration table of README (Markdown)."
  @spec table() :: String.t()
  def table do
    rows =
      for {key, default, read, what} <- @keys do
        "| `#{key}` | #{show(default)} | #{@read[read]} | #{what} |"
      end

    Enum.join(["| key | default | read | meaning |", "| --- | --- | --- | --- |" | rows], "\n") <> "\n"
  end

  defp show(bytes) when is_integer(bytes) and bytes >= @mib and rem(bytes, @mib) == 0,
    do: "`#{bytes}` (#{div(bytes, @mib)} MiB)"

  defp show(value), do: "`#{inspect(value)}`"
end

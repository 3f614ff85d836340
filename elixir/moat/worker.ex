defmodule Moat.Worker do
  @moduledoc """
  Owns one `moat_port` worker process and routes its replies.

  Started under `Moat.Supervisor` as `Moat.Worker` by the application, or
  under your own supervisor with `{Moat.Worker, name: MyWorker}`.

  When the worker's OS process exits for any reason, this process fails every
  call in flight (callers monitor it), logs how the worker died, emits
  `[:moat, :worker, :down]` and exits; its supervisor starts a new worker
  with the next generation number, which emits `[:moat, :worker, :up]`.
  Handles from the old generation then raise a `:stale_generation`
  `Moat.Error`.

  Both events carry `:worker`, `:generation`, `:os_pid` and `:node` (where
  the worker runs: this node, or a remote worker's C-node); `:down` adds
  `:reason`, how the worker ended (`"killed by signal 11 (SIGSEGV)"`, or the
  exit reason of a normal stop). Callers that reach a dead worker get a
  `Moat.Error` naming the same cause. The application's supervisor restarts a
  worker at most `config :moat, max_restarts: 20` times in `max_seconds: 5`;
  a crash loop beyond that stops it rather than spinning.

  ## The worker's environment

  The worker inherits this VM's environment, plus the variables the options
  below set. Two more are set only where the VM's environment does not set
  them: `GLIBC_TUNABLES` (a larger malloc cache for MLX's many small
  objects) and `OPENBLAS_THREAD_TIMEOUT=20`: OpenBLAS's idle threads then
  spin for 2^20 CPU cycles (about 0.4 ms) after a matrix product before they
  sleep, instead of its default 2^28 (about 0.1 s), which took a core from
  the worker's own kernels, other workers and this VM (docs/latency.md,
  "OpenBLAS's idle threads").

  ## Options

  Each option but `:name` and `:log_level` defaults to the `config :moat`
  key of the same name (`Moat.Config`), read when the worker starts.

    * `:name` - registered name, also the key of the connection (default `Moat.Worker`)
    * `:node` - the name of a worker that runs as an Erlang C-node, on this
      host or another (`moat_port --node NAME@HOST --cookie-file PATH`; see
      `Moat.Remote`): this process connects to it instead of starting one,
      and reconnects, with backoff for up to `:hello_timeout`, each time its
      node goes down; every connection is a new generation. Options that
      set the worker's process (`:worker_path`, `:gpu`, `:tf32`,
      `:cpu_kernels`, `:kernel_cache`, `:buffer_files`, `:log_level`, `:device`, frame
      limits, debug checks) are the C-node's own command line there; the
      watchdog and shared memory are off.
    * `:worker_path` - the `moat_port` executable (default: `$MOAT_WORKER`,
      else the one built into this application's `priv/`, beside the
      libraries it loads in `priv/lib`)
    * `:memory_limit` - the worker's memory limit in bytes, set before any
      request (default: MLX's, about 80% of RAM; see `Moat.set_memory_limit/2`)
    * `:log_level` - the worker's stderr log level (default from
      `config :moat, :worker_log_level`, `:warning`)
    * `:window` - frames sent but not yet acknowledged by the worker before a
      fire-and-forget sender waits (1024; calls count too, but never wait)
    * `:chunk_bytes`, `:max_frame_bytes` - frame limits (64 MiB, 320 MiB)
    * `:shared_memory` - move large tensors through shared memory instead of
      the port's pipe, where the worker offers it and this VM can read the
      worker's memory: the same host, the same user, a kernel that allows
      it (Linux; true by default). Uploads are written into a memory file
      the worker maps as the tensor. Readbacks are copied out of the
      worker's memory into memory of this VM (`process_vm_readv`, one copy
      at memory speed), or, where the kernel refuses that (a ptrace
      restriction) and on GPU workers (whose buffers are CUDA managed
      memory), mapped from a sealed file the worker copies the tensor
      into. Each is one copy where the pipe makes two or three, and faster
      from about 1 MiB up (bench/foundation.exs, bench/readback.exs).
      `:sealed_files` takes sealed files for readbacks even where the
      faster copy is allowed: the worker keeps a tensor's file as cache, so
      reading the same tensor again maps it without copying. `false`, or a
      worker that does not pass the check, uses the pipe for everything.
    * `:shared_memory_threshold` - the smallest tensor, in bytes, that goes
      through shared memory (1 MiB); smaller ones are cheaper through the
      pipe
    * `:device` - `:cpu` or `:gpu`: the device every op of this worker runs
      on (default from `config :moat, :device`, else the best one the worker
      announces: the GPU where its MLX is the CUDA build and sees one). A
      device the worker does not have fails the start with an error naming
      the ones it has. `Moat.Worker.info/1` lists them under `:device_info`.
    * `:gpu` - the index of the GPU to pin this worker to (sets
      `CUDA_VISIBLE_DEVICES` for its process), so that a supervision tree
      can run one worker per GPU: `{Moat.Worker, name: :gpu1, gpu: 1}`
    * `:tf32` - whether f32 matrix products on the GPU may use TF32 tensor
      cores: inputs rounded to a 10-bit mantissa, about 7× faster on an
      H200 (default `false`, from `config :moat, :tf32`: full f32, as on the
      CPU; MLX's own default is TF32). Sets `MLX_ENABLE_TF32` for the worker
    * `:watchdog` - milliseconds a worker may go without progress while
      calls wait on it before it counts as hung, is killed by its OS pid and
      restarted (30 000; `false` turns it off; default from
      `config :moat, :watchdog`). Progress is what the worker reports: replies,
      acknowledgements, and the CPU time it uses, which a long computation
      keeps growing and a hung MLX call does not. A worker with a thread
      waiting for a CPU (a machine too busy to run it) is starved, not
      hung, and is left alone. Callers of a hung one get a `Moat.Error`
      saying the worker hung.
    * `:cpu_kernels` - the worker's own CPU kernels of the f32/f16/bf16
      transcendentals: `:auto` (default: the widest the CPU has: AVX-512F,
      else AVX2 with FMA and F16C), `:scalar` (the portable fallback),
      `:avx2`, `:avx512`, or `:mlx` (MLX's own kernels, for comparison);
      sets `MOAT_CPU_FEATURES` for the worker, which otherwise inherits it
    * `:hello_timeout` - how long to wait for the worker's handshake (15 s)
    * `:buffer_files` - whether a CPU worker keeps MLX's buffers of 1 MiB
      or more in memory files (port/shim/alloc.cpp), so that a large
      readback maps the tensor's own buffer instead of copying it
      (protocol.md §6, "Zero-copy readback"). `false` leaves them in MLX's
      own memory: readbacks are then copied. `nil` (the default, from
      `config :moat, :buffer_files`) leaves it to the worker's
      environment: on unless `MOAT_BUFFER_FILES` is `0`. Sets
      `MOAT_BUFFER_FILES` for the worker; a GPU worker ignores it
    * `:kernel_cache` - where MLX keeps the fused kernels it compiles for
      `Moat.Compiler`'s `fuse: true` (default: `moat-kernels` in the user's
      cache folder, `~/.cache/moat-kernels` on Linux; default from
      `config :moat, :kernel_cache`)
    * `:debug` - debug checks, off by default (default from `config :moat, :debug`):
      * `detect_non_finite: true` - every op evaluates its float results and
        fails if they hold NaN or an infinity, so reading the result raises a
        `Moat.Error` naming the op that produced it. Evaluating every op
        forgoes MLX's lazy fusion: for debugging only.
    * `:gc_nudge` - every this many milliseconds, processes that created
      tensors and have been idle since the last tick are garbage-collected
      once, so that the tensors they dropped are released (1000; `false`
      turns it off). See `Moat`, "Memory".
  """

  # CPU time per progress report that counts as progress (µs): more than
  # the reporting itself takes.
  @min_cpu_us 2_000

  use GenServer
  require Logger
  import Bitwise, only: [<<<: 2]

  alias Moat.{Client, Config, Error, Finalizer, Protocol, Releaser, Remote, Shared, Writer}

  @u64 1 <<< 64

  # MLX writes and compiles the C++ of fused kernels (Moat.Compiler's
  # `fuse: true`) in its temporary folder, and keeps them there for the next
  # process: that folder is made the cache.
  defp kernel_cache_env(dir) do
    dir = dir || to_string(:filename.basedir(:user_cache, ~c"moat-kernels"))

    case File.mkdir_p(dir) do
      :ok -> [{~c"TMPDIR", String.to_charlist(dir)}]
      {:error, _} -> []
    end
  end

  @doc false
  def child_spec(opts) do
    %{
      id: Keyword.get(opts, :name, __MODULE__),
      start: {__MODULE__, :start_link, [opts]},
      restart: :permanent,
      shutdown: 5_000
    }
  end

  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts \\ []) do
    name = Keyword.get(opts, :name, __MODULE__)
    GenServer.start_link(__MODULE__, Keyword.put(opts, :name, name), name: name)
  end

  @doc "The OS pid, generation, MLX version and devices of the running worker."
  @spec info(atom()) :: map()
  def info(name \\ __MODULE__) do
    conn = Client.conn(name)
    Map.put(conn.info, :generation, conn.generation)
  end

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    name = Keyword.fetch!(opts, :name)
    generation = Client.last_generation(name) + 1
    setting = &Config.get(opts, &1)
    chunk = setting.(:chunk_bytes)

    args = [
      "--generation",
      "#{generation}",
      "--log-level",
      worker_log_level(Keyword.get_lazy(opts, :log_level, fn -> Config.get(:worker_log_level) end)),
      "--chunk-bytes",
      "#{chunk}",
      "--max-frame-bytes",
      "#{setting.(:max_frame_bytes)}",
      "--detect-non-finite",
      "#{Keyword.get(setting.(:debug), :detect_non_finite, false) == true}",
      "--shared-memory",
      "#{setting.(:shared_memory) != false}"
    ]

    device = setting.(:device)
    args = if device, do: args ++ ["--device", device_arg!(device)], else: args
    node = Keyword.get(opts, :node)
    watchdog = if node, do: nil, else: watchdog!(setting.(:watchdog))
    args = if watchdog, do: args ++ ["--progress-ms", "#{tick(watchdog)}"], else: args

    with {:ok, port, info} <- start_worker(node, opts, setting, generation, args),
         {:ok, info} <- check_device(port, device, info) do
      chunk = min(chunk, Map.get(info, :chunk_bytes, chunk))
      warn_without_finalizer()
      {:ok, releaser} = Releaser.start_link(gc_nudge: setting.(:gc_nudge))
      {writer, outbox} = start_writer(port, setting.(:batch_writes))

      conn = %Client{
        name: name,
        port: port,
        generation: generation,
        incarnation: Client.new_incarnation(),
        owner: self(),
        table: :ets.new(:moat_calls, [:set, :public, write_concurrency: true]),
        counters: Client.new_counters(),
        releaser: releaser,
        window: setting.(:window),
        chunk_bytes: chunk,
        info: info,
        shared: Shared.negotiate(info, setting.(:shared_memory_threshold), setting.(:shared_memory)),
        outbox: outbox,
        reply_fd: reply_fd(port, info)
      }

      Releaser.attach(releaser, &Client.cast(conn, :release, [], &1, nil))
      set_memory_limit(conn, setting.(:memory_limit))
      Client.publish(conn)

      :telemetry.execute([:moat, :worker, :up], %{system_time: System.system_time()}, %{
        worker: name,
        generation: generation,
        os_pid: info.os_pid,
        node: worker_node(info)
      })

      if watchdog, do: Process.send_after(self(), :watchdog, tick(watchdog))

      {:ok,
       %{
         conn: conn,
         writer: writer,
         waiters: [],
         hook_runs: %{},
         down: nil,
         hung: nil,
         watchdog: watchdog,
         progress: {0, now_ms()}
       }}
    end
  end

  # This VM's end of the pipe a local worker answers on (the worker's fd 4,
  # `:nouse_stdio`), found through /proc: a call waits awake for it to become
  # readable (Moat.Client, `:call_spin_us`). nil where that cannot be told,
  # or for a remote worker.
  defp reply_fd(port, %{os_pid: os_pid}) when is_port(port) and is_integer(os_pid) do
    with true <- Finalizer.loaded?(),
         {:ok, "pipe:" <> _ = pipe} <- File.read_link("/proc/#{os_pid}/fd/4"),
         {:ok, fds} <- File.ls("/proc/self/fd") do
      Enum.find_value(fds, fn fd ->
        if File.read_link("/proc/self/fd/" <> fd) == {:ok, pipe} and read_only?(fd), do: String.to_integer(fd)
      end)
    else
      _ -> nil
    end
  end

  defp reply_fd(_port, _info), do: nil

  # fdinfo's flags are octal; the access mode is their two low bits.
  defp read_only?(fd) do
    with {:ok, text} <- File.read("/proc/self/fdinfo/" <> fd),
         [_, flags] <- Regex.run(~r/^flags:\s+([0-7]+)$/m, text) do
      Bitwise.band(String.to_integer(flags, 8), 3) == 0
    else
      _ -> false
    end
  end

  # A local worker's writer and outbox (Moat.Writer), where the finalizer
  # NIF is loaded and `:batch_writes` is on; otherwise (and for a remote
  # worker, whose frames are messages already) callers write themselves.
  defp start_writer(port, true) when is_port(port) do
    if Finalizer.loaded?(), do: Writer.start_link(port), else: {nil, nil}
  end

  defp start_writer(_port, _batch), do: {nil, nil}

  # A local worker: its port, opened here. A remote one: its session's pid.
  defp start_worker(nil, opts, setting, _generation, args) do
    path = executable(opts)

    port =
      Port.open({:spawn_executable, path}, [
        :binary,
        {:packet, 4},
        :exit_status,
        :nouse_stdio,
        {:args, args},
        {:env,
         kernel_cache_env(setting.(:kernel_cache)) ++
           gpu_env(Keyword.get(opts, :gpu)) ++
           tf32_env(setting.(:tf32)) ++
           buffer_files_env(setting.(:buffer_files)) ++
           kernel_env(Keyword.get(opts, :cpu_kernels)) ++ default_env()}
      ])

    with {:ok, info} <- await_hello(port, setting.(:hello_timeout)), do: {:ok, port, info}
  end

  defp start_worker(node, _opts, setting, generation, _args) do
    case Remote.open(node, generation, setting.(:hello_timeout)) do
      {:ok, pid, info} -> {:ok, pid, info}
      {:error, why} -> {:stop, why}
    end
  end

  defp worker_node(info), do: Map.get(info, :node, node())

  defp close(port) when is_port(port), do: Port.close(port)
  defp close(pid), do: Remote.close(pid)

  # Before the connection is published, so no request can precede it.
  defp set_memory_limit(_conn, nil), do: :ok

  defp set_memory_limit(conn, bytes) when is_integer(bytes) and bytes >= 0 do
    case Client.owner_call(conn, :set_memory_limit, bytes) do
      {:ok, _previous} -> :ok
      {:error, error} -> raise error
    end
  end

  defp warn_without_finalizer do
    key = {__MODULE__, :warned_finalizer}

    if not Finalizer.loaded?() and not :persistent_term.get(key, false) do
      :persistent_term.put(key, true)

      Logger.warning(
        "Moat: the finalizer NIF is not loaded (#{inspect(Finalizer.load_error())}); tensors are " <>
          "released only by Nx.backend_deallocate/1, Moat.scope/1 or a worker restart"
      )
    end
  end

  @doc """
  The `moat_port` executable a local worker started with `opts` runs (see
  `:worker_path`); the same binary runs as a remote worker's C-node.
  """
  @spec executable(keyword()) :: Path.t()
  def executable(opts \\ []) do
    Config.get(opts, :worker_path) || System.get_env("MOAT_WORKER") || Application.app_dir(:moat, "priv/moat_port")
  end

  defp device_arg!(device) when device in [:cpu, :gpu], do: Atom.to_string(device)

  defp device_arg!(other),
    do: raise(ArgumentError, "Moat.Worker: unknown device #{inspect(other)}, expected :cpu or :gpu")

  defp watchdog!(off) when off in [false, nil], do: nil
  defp watchdog!(ms) when is_integer(ms) and ms > 0, do: ms

  defp watchdog!(other),
    do: raise(ArgumentError, "Moat.Worker: :watchdog must be milliseconds > 0 or false, got #{inspect(other)}")

  # Progress reports and checks come four times per watchdog period.
  defp tick(limit), do: max(div(limit, 4), 10)
  defp now_ms, do: System.monotonic_time(:millisecond)

  defp tf32_env(on) when is_boolean(on), do: [{~c"MLX_ENABLE_TF32", if(on, do: ~c"1", else: ~c"0")}]
  defp tf32_env(other), do: raise(ArgumentError, "Moat.Worker: :tf32 must be a boolean, got #{inspect(other)}")

  # Read by port/shim/alloc.cpp when MLX first allocates: an environment
  # variable, not an argument, so it is set before any of the worker's code runs.
  defp buffer_files_env(nil), do: []
  defp buffer_files_env(on) when is_boolean(on), do: [{~c"MOAT_BUFFER_FILES", if(on, do: ~c"1", else: ~c"0")}]

  defp buffer_files_env(other),
    do: raise(ArgumentError, "Moat.Worker: :buffer_files must be true, false or nil, got #{inspect(other)}")

  defp gpu_env(nil), do: []
  defp gpu_env(index) when is_integer(index) and index >= 0, do: [{~c"CUDA_VISIBLE_DEVICES", ~c"#{index}"}]
  defp gpu_env(other), do: raise(ArgumentError, "Moat.Worker: :gpu must be a GPU index >= 0, got #{inspect(other)}")

  # A worker names in its hello the device it runs ops on, or nil when the
  # one asked for is not there.
  defp check_device(port, wanted, %{device: nil} = info) do
    close(port)

    {:stop,
     {:no_device,
      "Moat.Worker: device #{inspect(wanted)} is not available: this worker's MLX #{info.mlx} has " <>
        "#{inspect(info.devices)}#{install_hint(wanted)}"}}
  end

  defp check_device(_port, _wanted, info), do: {:ok, info}

  defp install_hint(:gpu), do: " (MOAT_MLX=cuda13 bin/setup builds the worker on MLX's CUDA backend)"
  defp install_hint(_), do: ""

  # Variables the worker gets only where the VM's environment does not set
  # them (it then inherits the VM's value unchanged).
  #
  # GLIBC_TUNABLES: MLX builds and frees a handful of small C++ objects per
  # node, more of one size per evaluation than glibc's per-thread cache keeps
  # (7): the rest took malloc's slow paths, about a fifth of the worker's CPU
  # time in a chain of tiny ops. 512 a size (at most ~17 MB held a thread)
  # made a 102-op jitted chain with its readback 6% faster (467 -> 438 µs,
  # 2026-12-04).
  #
  # OPENBLAS_THREAD_TIMEOUT: after each call OpenBLAS's pthread pool spins
  # (sched_yield) for 2^timeout cycles before it sleeps: by default 2^28,
  # about 0.1 s, in which the spinning thread takes a core from whatever
  # runs next. 2^20 (about 0.4 ms) still covers the gap between the matrix
  # products of one evaluation; 2^4 sleeps at once and made small products
  # slower (a wake-up each). On 2 vCPUs (docs/latency.md) the decoder block
  # at sequence 128 used 26.5 ms of the worker's CPU a call instead of 38.2,
  # a decode-sized block 2.8 instead of 8.1, wall times within a few per
  # cent.
  @default_env [
    {"GLIBC_TUNABLES", "glibc.malloc.tcache_count=512"},
    {"OPENBLAS_THREAD_TIMEOUT", "20"}
  ]

  defp default_env do
    for {name, value} <- @default_env, !System.get_env(name), do: {String.to_charlist(name), String.to_charlist(value)}
  end

  defp kernel_env(nil), do: []

  defp kernel_env(set) when set in [:auto, :scalar, :avx2, :avx512, :mlx],
    do: [{~c"MOAT_CPU_FEATURES", Atom.to_charlist(set)}]

  defp kernel_env(other),
    do: raise(ArgumentError, ":cpu_kernels must be :auto, :scalar, :avx2, :avx512 or :mlx, got: #{inspect(other)}")

  defp worker_log_level(:warning), do: "warn"
  defp worker_log_level(level), do: to_string(level)

  defp await_hello(port, timeout) do
    receive do
      {^port, {:data, frame}} ->
        case Protocol.decode(frame) do
          {:ok, {:hello, version, info}, _} when version == 1 ->
            {:ok, info}

          {:ok, {:hello, version, _}, _} ->
            Port.close(port)

            {:stop,
             {:protocol_mismatch, "the worker speaks protocol version #{version}, this client #{Protocol.version()}"}}

          other ->
            Port.close(port)
            {:stop, {:bad_handshake, other}}
        end

      {^port, {:exit_status, status}} ->
        {:stop, {:worker_died, Error.describe_exit(status)}}
    after
      timeout ->
        Port.close(port)
        {:stop, {:handshake_timeout, timeout}}
    end
  end

  @impl true
  def handle_info({port, {:data, frame}}, %{conn: %{port: port}} = state) do
    case Protocol.decode(frame) do
      {:ok, {:progress, cpu}, _} when is_integer(cpu) ->
        {last, _at} = state.progress
        {:noreply, if(cpu >= last + @min_cpu_us, do: %{state | progress: {cpu, now_ms()}}, else: state)}

      {:ok, header, payload} ->
        {last, _at} = state.progress
        {:noreply, route(header, payload, %{state | progress: {last, now_ms()}})}

      {:error, why} ->
        Logger.error("Moat worker sent a bad frame: #{why}")
        {:noreply, fail_undecodable(frame, why, state)}
    end
  end

  def handle_info(:watchdog, %{watchdog: limit, conn: conn} = state) when is_integer(limit) do
    Process.send_after(self(), :watchdog, tick(limit))
    {cpu, at} = state.progress
    waiting = :ets.info(conn.table, :size)

    cond do
      # Idle workers make no progress and need none: the clock starts with work.
      waiting == 0 ->
        {:noreply, %{state | progress: {cpu, now_ms()}}}

      # A machine too busy to run the worker stops its progress too; a
      # runnable thread is starved, not hung (a hung call sleeps).
      state.hung == nil and now_ms() - at > limit and runnable?(conn.info.os_pid) ->
        {:noreply, %{state | progress: {cpu, now_ms()}}}

      state.hung == nil and now_ms() - at > limit ->
        hung = "hung: no progress for #{now_ms() - at} ms with #{waiting} call(s) waiting; killed by the watchdog"
        Logger.error("Moat worker #{inspect(conn.name)} (generation #{conn.generation}) #{hung}")
        System.cmd("kill", ["-KILL", "#{conn.info.os_pid}"])
        {:noreply, %{state | hung: hung}}

      true ->
        {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{conn: %{port: port}} = state) do
    how = state.hung || Error.describe_exit(status)
    Logger.error("Moat worker #{inspect(state.conn.name)} (generation #{state.conn.generation}) died: #{how}")
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info({:nodedown, node}, %{conn: %{port: pid}} = state) when is_pid(pid) and node(pid) == node do
    how = "its node #{node} went down (the connection is lost; a new one is a new generation)"
    Logger.error("Moat worker #{inspect(state.conn.name)} (generation #{state.conn.generation}): #{how}")
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info({:EXIT, port, reason}, %{conn: %{port: port}} = state) do
    how = "its port closed (#{inspect(reason)})"
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info({:EXIT, pid, reason}, %{writer: pid} = state) when is_pid(pid) do
    how = "its writer exited (#{inspect(reason)})"
    Logger.error("Moat worker #{inspect(state.conn.name)}: #{how}; restarting")
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info({:EXIT, pid, reason}, %{conn: %{releaser: pid}} = state) do
    how = "its releaser exited (#{inspect(reason)})"
    Logger.error("Moat worker #{inspect(state.conn.name)}: #{how}; restarting")
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  # A run with hooks (Moat.Client.request_with_hooks/7): its caller is
  # watched until the run's reply, so that a caller that exits first
  # cancels the run, which would otherwise wait for its acknowledgements.
  def handle_info({:hook_run, seq, pid}, state) do
    if :ets.member(state.conn.table, seq) do
      {:noreply, %{state | hook_runs: Map.put(state.hook_runs, seq, Process.monitor(pid))}}
    else
      {:noreply, state}
    end
  end

  def handle_info({:DOWN, mref, :process, _, _}, %{hook_runs: runs} = state) when map_size(runs) > 0 do
    case Enum.find(runs, fn {_seq, ref} -> ref == mref end) do
      {seq, _} ->
        Client.cancel_hooks(state.conn, seq)
        {:noreply, %{state | hook_runs: Map.delete(runs, seq)}}

      nil ->
        {:noreply, state}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  # Whether any thread of the OS process is running or waiting for a CPU
  # (state R in /proc). Where /proc is not there, nothing counts as runnable.
  @doc false
  @spec runnable?(non_neg_integer()) :: boolean()
  def runnable?(os_pid) do
    case File.ls("/proc/#{os_pid}/task") do
      {:ok, tids} -> Enum.any?(tids, &(thread_state("/proc/#{os_pid}/task/#{&1}/stat") == "R"))
      {:error, _} -> false
    end
  end

  # The state follows the command, which is in parentheses and may itself
  # hold spaces or parentheses: it is the byte after the last ") ".
  defp thread_state(path) do
    with {:ok, stat} <- File.read(path),
         [_ | _] = found <- :binary.matches(stat, ") "),
         {at, 2} = List.last(found),
         true <- byte_size(stat) > at + 2 do
      binary_part(stat, at + 2, 1)
    else
      _ -> nil
    end
  end

  @impl true
  def handle_call({:await_ack, target}, from, state) do
    if Client.acked(state.conn) >= target do
      {:reply, :ok, state}
    else
      {:noreply, %{state | waiters: [{target, from} | state.waiters]}}
    end
  end

  @impl true
  def terminate(reason, %{conn: conn} = state) do
    if state.down do
      Client.record_down(conn, state.down)
      # New calls wait for the next generation (Client.conn/1) instead of
      # reaching this one.
      Client.unpublish(conn)
    else
      # A normal stop (application shutdown): closing the port gives the
      # worker end of input, and it exits.
      Client.unpublish(conn)

      try do
        close(conn.port)
      rescue
        ArgumentError -> :ok
      end
    end

    :telemetry.execute([:moat, :worker, :down], %{system_time: System.system_time()}, %{
      worker: conn.name,
      generation: conn.generation,
      os_pid: conn.info.os_pid,
      node: worker_node(conn.info),
      reason: state.down || reason
    })
  end

  # A worker whose memory MLX corrupted could write anything: frames the
  # clauses below cannot handle safely fall through to the last one, which logs.
  defp route({:ack, n}, _payload, state) when is_integer(n) and n >= 0 and n < @u64 do
    Client.record_ack(state.conn, n)
    {ready, waiting} = Enum.split_with(state.waiters, fn {target, _} -> target <= n end)
    Enum.each(ready, fn {_, from} -> GenServer.reply(from, :ok) end)
    %{state | waiters: waiting}
  end

  defp route({:memory_pressure, active}, _payload, state) do
    # Collections free tensors only through the finalizer's tokens.
    if Finalizer.loaded?() do
      Client.record_pressure(state.conn)
      send(state.conn.releaser, {:memory_pressure, active})
    end

    :telemetry.execute([:moat, :memory, :pressure], %{active: active}, %{worker: state.conn.name})
    state
  end

  defp route({:ok, seq, result}, payload, state), do: reply(state, seq, {:ok, result, payload})

  defp route({:more, seq}, payload, state) do
    case :ets.lookup(state.conn.table, seq) do
      [{^seq, alias}] -> send(alias, {alias, {:more, payload}})
      [] -> :ok
    end

    state
  end

  defp route({:error, 0, op, %{message: message}}, _payload, state) when is_atom(op) and is_binary(message) do
    Logger.error("Moat worker refused a frame (#{op}): #{message}")
    state
  end

  defp route({:error, seq, op, failure}, _payload, state), do: reply(state, seq, {:error, op, failure})

  # A value of a hook firing, sent before its run's reply.
  defp route({:hook, seq, info}, payload, state) do
    case :ets.lookup(state.conn.table, seq) do
      [{^seq, alias}] -> send(alias, {alias, {:hook, info, payload}})
      [] -> :ok
    end

    state
  end

  defp route(other, _payload, state) do
    Logger.error("Moat worker sent an unexpected frame: #{inspect(other, limit: 20)}")
    state
  end

  # A reply that cannot be decoded must still end its call, or the caller
  # would wait forever.
  defp fail_undecodable(frame, why, state) do
    case Protocol.peek_seq(frame) do
      {:ok, seq} when seq > 0 ->
        failure = %{kind: :protocol, message: "the worker's reply could not be decoded: #{why}"}
        reply(state, seq, {:error, :protocol, failure})

      _ ->
        state
    end
  end

  defp reply(state, seq, msg) do
    case :ets.take(state.conn.table, seq) do
      [{^seq, alias}] -> send(alias, {alias, msg})
      [] -> :ok
    end

    unwatch(state, seq)
  end

  defp unwatch(%{hook_runs: runs} = state, seq) when is_map_key(runs, seq) do
    {mref, runs} = Map.pop(runs, seq)
    Process.demonitor(mref, [:flush])
    %{state | hook_runs: runs}
  end

  defp unwatch(state, _seq), do: state
end

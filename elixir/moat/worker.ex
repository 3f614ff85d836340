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

  Both events carry `:worker`, `:generation` and `:os_pid`; `:down` adds
  `:reason`, how the worker ended (`"killed by signal 11 (SIGSEGV)"`, or the
  exit reason of a normal stop). Callers that reach a dead worker get a
  `Moat.Error` naming the same cause. The application's supervisor restarts a
  worker at most `config :moat, max_restarts: 20` times in `max_seconds: 5`;
  a crash loop beyond that stops it rather than spinning.

  ## Options

    * `:name` - registered name, also the key of the connection (default `Moat.Worker`)
    * `:worker_path` - the `moat_port` executable (default: the one built into
      this application's `priv/`, or `$MOAT_WORKER`)
    * `:log_level` - the worker's stderr log level (default from
      `config :moat, :worker_log_level`, `:warning`)
    * `:window` - frames sent but not yet acknowledged by the worker before a
      fire-and-forget sender waits (1024; calls count too, but never wait)
    * `:chunk_bytes`, `:max_frame_bytes` - frame limits (64 MiB, 320 MiB)
    * `:shared_memory` - move large tensors through shared memory instead of
      the port's pipe, where the worker offers it and this VM can read the
      worker's memory: the same host, the same user, a kernel that allows
      it (Linux; true by default). Uploads are written into a memory file
      the worker maps as the tensor; readbacks are read from the worker's
      memory. Each is one copy where the pipe makes two or three, and
      faster from about 1 MiB up (bench/foundation.exs). `false`, or a
      worker that does not pass the check, uses the pipe for everything.
    * `:shared_memory_threshold` - the smallest tensor, in bytes, that goes
      through shared memory (1 MiB); smaller ones are cheaper through the
      pipe
    * `:cpu_kernels` - the worker's own CPU kernels of the f32/f16/bf16
      transcendentals: `:auto` (default: the widest the CPU has: AVX-512F,
      else AVX2 with FMA and F16C), `:scalar` (the portable fallback),
      `:avx2`, `:avx512`, or `:mlx` (MLX's own kernels, for comparison);
      sets `MOAT_CPU_FEATURES` for the worker, which otherwise inherits it
    * `:hello_timeout` - how long to wait for the worker's handshake (15 s)
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

  # Below this, the pipe's single frame is faster than shared memory's extra
  # file operations (bench/foundation.exs).
  @shared_threshold 1024 * 1024

  use GenServer
  require Logger
  import Bitwise, only: [<<<: 2]

  alias Moat.{Client, Finalizer, Protocol, Releaser, Shared}

  @u64 1 <<< 64

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
    env = Application.get_all_env(:moat)
    setting = &Keyword.get(opts, &1, Keyword.get(env, &1, &2))
    chunk = setting.(:chunk_bytes, 64 * 1024 * 1024)

    args = [
      "--generation",
      "#{generation}",
      "--log-level",
      worker_log_level(Keyword.get(opts, :log_level, env[:worker_log_level] || :warning)),
      "--chunk-bytes",
      "#{chunk}",
      "--max-frame-bytes",
      "#{setting.(:max_frame_bytes, 320 * 1024 * 1024)}",
      "--detect-non-finite",
      "#{Keyword.get(setting.(:debug, []), :detect_non_finite, false) == true}",
      "--shared-memory",
      "#{setting.(:shared_memory, true) != false}"
    ]

    path = Keyword.get(opts, :worker_path) || worker_path()

    port =
      Port.open({:spawn_executable, path}, [
        :binary,
        {:packet, 4},
        :exit_status,
        :nouse_stdio,
        {:args, args}
        | kernel_env(Keyword.get(opts, :cpu_kernels))
      ])

    with {:ok, info} <- await_hello(port, Keyword.get(opts, :hello_timeout, 15_000)) do
      warn_without_finalizer()
      {:ok, releaser} = Releaser.start_link(gc_nudge: setting.(:gc_nudge, 1_000))

      conn = %Client{
        name: name,
        port: port,
        generation: generation,
        owner: self(),
        table: :ets.new(:moat_calls, [:set, :public, write_concurrency: true]),
        counters: Client.new_counters(),
        releaser: releaser,
        window: setting.(:window, 1024),
        chunk_bytes: chunk,
        info: info,
        shared: Shared.negotiate(info, setting.(:shared_memory_threshold, @shared_threshold))
      }

      Releaser.attach(releaser, conn)
      Client.publish(conn)

      :telemetry.execute([:moat, :worker, :up], %{system_time: System.system_time()}, %{
        worker: name,
        generation: generation,
        os_pid: info.os_pid
      })

      {:ok, %{conn: conn, waiters: [], down: nil}}
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

  defp worker_path do
    System.get_env("MOAT_WORKER") || Application.app_dir(:moat, "priv/moat_port")
  end

  defp kernel_env(nil), do: []

  defp kernel_env(set) when set in [:auto, :scalar, :avx2, :avx512, :mlx],
    do: [{:env, [{~c"MOAT_CPU_FEATURES", Atom.to_charlist(set)}]}]

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
        {:stop, {:worker_died, describe_exit(status)}}
    after
      timeout ->
        Port.close(port)
        {:stop, {:handshake_timeout, timeout}}
    end
  end

  @impl true
  def handle_info({port, {:data, frame}}, %{conn: %{port: port}} = state) do
    case Protocol.decode(frame) do
      {:ok, header, payload} ->
        {:noreply, route(header, payload, state)}

      {:error, why} ->
        Logger.error("Moat worker sent a bad frame: #{why}")
        {:noreply, fail_undecodable(frame, why, state)}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{conn: %{port: port}} = state) do
    how = describe_exit(status)
    Logger.error("Moat worker #{inspect(state.conn.name)} (generation #{state.conn.generation}) died: #{how}")
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info({:EXIT, port, reason}, %{conn: %{port: port}} = state) do
    how = "its port closed (#{inspect(reason)})"
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info({:EXIT, pid, reason}, %{conn: %{releaser: pid}} = state) do
    how = "its releaser exited (#{inspect(reason)})"
    Logger.error("Moat worker #{inspect(state.conn.name)}: #{how}; restarting")
    {:stop, {:shutdown, {:worker_died, how}}, %{state | down: how}}
  end

  def handle_info(_other, state), do: {:noreply, state}

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
    else
      # A normal stop (application shutdown): closing the port gives the
      # worker end of input, and it exits.
      Client.unpublish(conn)

      try do
        Port.close(conn.port)
      rescue
        ArgumentError -> :ok
      end
    end

    :telemetry.execute([:moat, :worker, :down], %{system_time: System.system_time()}, %{
      worker: conn.name,
      generation: conn.generation,
      os_pid: conn.info.os_pid,
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

  defp route({:error, 0, op, message}, _payload, state) when is_atom(op) and is_binary(message) do
    Logger.error("Moat worker refused a frame (#{op}): #{message}")
    state
  end

  defp route({:error, seq, op, message}, _payload, state), do: reply(state, seq, {:error, op, message})

  defp route(other, _payload, state) do
    Logger.error("Moat worker sent an unexpected frame: #{inspect(other, limit: 20)}")
    state
  end

  # A reply that cannot be decoded must still end its call, or the caller
  # would wait forever.
  defp fail_undecodable(frame, why, state) do
    case Protocol.peek_seq(frame) do
      {:ok, seq} when seq > 0 ->
        reply(state, seq, {:error, :protocol, "the worker's reply could not be decoded: #{why}"})

      _ ->
        state
    end
  end

  defp reply(state, seq, msg) do
    case :ets.take(state.conn.table, seq) do
      [{^seq, alias}] -> send(alias, {alias, msg})
      [] -> :ok
    end

    state
  end

  @doc false
  def describe_exit(status) when status > 128, do: "killed by signal #{status - 128}#{signal_name(status - 128)}"
  def describe_exit(101), do: "exited with status 101 (a panic; the worker's log has its message)"
  def describe_exit(status), do: "exited with status #{status}"

  defp signal_name(n) do
    names = %{6 => "SIGABRT", 8 => "SIGFPE", 9 => "SIGKILL", 11 => "SIGSEGV", 15 => "SIGTERM"}
    if name = names[n], do: " (#{name})", else: ""
  end
end

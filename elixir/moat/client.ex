defmodule Moat.Client do
  @moduledoc """
  The connection to a worker, and the calls that go over it.

  Callers write to the port themselves (any process may), so ops do not queue
  behind a GenServer. Fire-and-forget frames (`cast/6`) are admitted through
  a window of unacknowledged frames (the worker acknowledges cumulatively),
  which bounds what a fast producer can pile up; payload bytes are bounded by
  the port's busy limit, which suspends a sender while the pipe is full.
  Calls (`call/5`, `request/6`) register an alias under a sequence number in
  the worker's ETS table; the `Moat.Worker` process routes the reply to that
  alias. A caller also monitors the `Moat.Worker` process, so when the worker
  dies every call in flight gets an error at once, naming how it died.

  The connection (`t:t/0`) lives in `:persistent_term` and is replaced on every
  worker restart (`conn/1`, `publish/1`).

  The modules above this one:

    * `Moat.Handles`: handles (`Moat.Ref`), their release, and the checks
      of every handle a frame reads (ids, generations, other nodes);
    * `Moat.Transfer`: tensor bytes in and out (uploads and readbacks, by
      the pipe or shared memory).
  """

  alias Moat.{Config, Error, Finalizer, Protocol, Remote, Shared, Writer}

  @enforce_keys [:name, :port, :generation, :incarnation, :owner, :table, :counters, :releaser]
  defstruct [
    :name,
    :port,
    :generation,
    :incarnation,
    :owner,
    :table,
    :counters,
    :releaser,
    :window,
    :chunk_bytes,
    :info,
    :shared,
    :outbox,
    :reply_fd
  ]

  @type t :: %__MODULE__{
          name: atom(),
          port: port() | pid(),
          generation: pos_integer(),
          incarnation: non_neg_integer(),
          owner: pid(),
          table: :ets.tid(),
          counters: :atomics.atomics_ref(),
          releaser: pid(),
          window: pos_integer(),
          chunk_bytes: pos_integer(),
          info: map(),
          shared: Shared.t() | nil,
          outbox: reference() | nil,
          reply_fd: non_neg_integer() | nil
        }

  # Handles whose ids the next frame of this process reads (see pin/1).
  @pinned :moat_pinned
  # The longest a caller waits awake for a reply (Finalizer.wait_readable/2's
  # own bound).
  @max_spin_us 200

  # :atomics slots of a connection
  @seq 1
  @sent 2
  @acked 3
  # Memory-pressure reports received from the worker.
  @pressure 4

  @doc false
  def new_counters, do: :atomics.new(4, signed: false)

  @doc false
  def record_pressure(%__MODULE__{counters: c}), do: :atomics.add(c, @pressure, 1)

  @doc false
  # Acks are cumulative and may overtake each other (protocol.md §4); only
  # the owner writes this slot, so a plain maximum is enough.
  def record_ack(%__MODULE__{counters: c}, n) do
    if n > :atomics.get(c, @acked), do: :atomics.put(c, @acked, n)
    :ok
  end

  @doc false
  def acked(%__MODULE__{counters: c}), do: :atomics.get(c, @acked)

  @doc false
  # How many memory-pressure reports the worker has sent (Moat.Handles).
  def pressure_reports(%__MODULE__{counters: c}), do: :atomics.get(c, @pressure)

  @doc """
  The current connection of the worker registered as `name`. While that
  worker is restarting or reconnecting, waits for it up to
  `config :moat, :restart_wait` ms; raises `:worker_unavailable` when none
  is running by then.
  """
  @spec conn(atom()) :: t()
  def conn(name) do
    :persistent_term.get({__MODULE__, name}, nil) || await_conn(name)
  end

  @doc """
  The running connection of the worker registered as `name`, or nil (never
  waits).
  """
  @spec current(atom()) :: t() | nil
  def current(name), do: :persistent_term.get({__MODULE__, name}, nil)

  @doc false
  # The worker name an incarnation of this VM belonged to, or nil for one
  # this VM never ran.
  def incarnation_worker(inc), do: :persistent_term.get({__MODULE__, :incarnation, inc}, nil)

  defp await_conn(name) do
    wait = Config.get(:restart_wait)
    await_conn(name, System.monotonic_time(:millisecond) + wait, wait)
  end

  defp await_conn(name, deadline, wait) do
    case :persistent_term.get({__MODULE__, name}, nil) do
      %__MODULE__{} = conn ->
        conn

      nil ->
        if restarting?(name) and System.monotonic_time(:millisecond) < deadline do
          Process.sleep(10)
          await_conn(name, deadline, wait)
        else
          raise Error.new(
                  :worker_unavailable,
                  nil,
                  "no Moat worker named #{inspect(name)} is running#{last_words(name, deadline, wait)}"
                )
        end
    end
  end

  defp last_words(name, deadline, wait) do
    waited = if System.monotonic_time(:millisecond) >= deadline, do: " (waited #{wait} ms for it to restart)", else: ""

    case :persistent_term.get({__MODULE__, name, :down}, nil) do
      {generation, how} -> "#{waited}: generation #{generation} died (#{how})"
      nil -> waited
    end
  end

  # Its process is starting (connecting, for a remote worker), or its last
  # generation died and the supervisor that restarts it is still there; a
  # worker stopped on purpose, or given up on, is not restarting.
  defp restarting?(name) do
    case Process.whereis(name) do
      pid when is_pid(pid) ->
        pid != self()

      nil ->
        g = last_generation(name)
        g > 0 and match?({^g, _}, :persistent_term.get({__MODULE__, name, :down}, nil)) and restarter_alive?(name)
    end
  end

  defp restarter_alive?(name) do
    case :persistent_term.get({__MODULE__, name, :restarter}, nil) do
      pid when is_pid(pid) -> Process.alive?(pid)
      registered when is_atom(registered) and registered != nil -> Process.whereis(registered) != nil
      _ -> false
    end
  end

  @doc false
  def publish(%__MODULE__{name: name, generation: g, incarnation: inc} = conn) do
    # The generation outlives the connection, so that handles of a worker
    # stopped and started again stay stale; so does the record of each
    # incarnation this VM started (a few words per start), which tells a
    # stale handle from one of another VM.
    :persistent_term.put({__MODULE__, name, :generation}, g)
    :persistent_term.put({__MODULE__, :incarnation, inc}, name)
    :persistent_term.put({__MODULE__, name}, conn)
  end

  @doc false
  # A fresh worker incarnation: random, so that no other VM (on this host
  # or elsewhere, before or after this one) draws the same; 59 bits keep it
  # an immediate integer, which `Moat.Handles.ids!/3` matches in one comparison.
  def new_incarnation do
    <<n::59, _::5>> = :crypto.strong_rand_bytes(8)
    n
  end

  @doc false
  # A stopped worker has no connection: `conn/1` raises from then on.
  def unpublish(%__MODULE__{name: name}), do: :persistent_term.erase({__MODULE__, name})

  @doc false
  def last_generation(name), do: :persistent_term.get({__MODULE__, name, :generation}, 0)

  @doc "Fresh tensor ids, unique across all workers and restarts."
  @spec new_ids(pos_integer()) :: [pos_integer()]
  def new_ids(n), do: for(_ <- 1..n//1, do: new_id())

  @doc "One fresh tensor id."
  @spec new_id() :: pos_integer()
  # A VM-wide counter that needs no setup, so concurrent first callers can
  # never draw the same id.
  def new_id, do: :erlang.unique_integer([:positive, :monotonic])

  @doc "Sends a fire-and-forget op (no reply; failures poison `outs`)."
  @spec cast(t(), atom(), [pos_integer()], [pos_integer()], term(), iodata()) :: :ok
  def cast(conn, op, outs, ins, attrs, payload \\ [])

  def cast(conn, op, outs, ins, attrs, []) do
    admit(conn)
    command(conn, op, Protocol.request(0, conn.generation, op, outs, ins, attrs))
  end

  def cast(conn, op, outs, ins, attrs, payload) do
    admit(conn)
    frame = Protocol.request(0, conn.generation, op, outs, ins, attrs, payload)

    if conn.outbox != nil and payload_size(payload, op) >= Writer.large_payload(),
      do: command_large(conn, op, frame),
      else: command(conn, op, frame)
  end

  @doc """
  A blocking call: sends `op` with a sequence number and waits for the reply.

  Returns `{:ok, result, payload}` (payload chunks reassembled into one
  binary) or `{:error, %Moat.Error{}}`.
  """
  @spec call(t(), atom(), [pos_integer()], term(), timeout()) ::
          {:ok, term(), binary()} | {:error, Error.t()}
  def call(conn, op, ins, attrs, timeout \\ :infinity), do: request(conn, op, [], ins, attrs, timeout)

  @doc """
  A call by the connection's owner before it publishes the connection (its
  own routing of replies cannot run while it waits): reads the reply off the
  port itself.
  """
  @spec owner_call(t(), atom(), term(), timeout()) :: {:ok, term()} | {:error, Error.t()}
  def owner_call(%__MODULE__{port: port} = conn, op, attrs, timeout \\ 15_000) do
    seq = :atomics.add_get(conn.counters, @seq, 1)
    direct(conn, op, Protocol.request(seq, conn.generation, op, [], [], attrs))
    owner_await(conn, port, op, seq, timeout)
  end

  defp owner_await(conn, port, op, seq, timeout) do
    receive do
      {^port, {:data, frame}} ->
        case Protocol.decode(frame) do
          {:ok, {:ok, ^seq, result}, _} ->
            {:ok, result}

          {:ok, {:error, ^seq, failed_op, failure}, _} ->
            {:error, Error.from_worker(failed_op, failure)}

          {:ok, {:ack, n}, _} ->
            record_ack(conn, n)
            owner_await(conn, port, op, seq, timeout)

          _ ->
            owner_await(conn, port, op, seq, timeout)
        end

      {^port, {:exit_status, status}} ->
        {:error, Error.new(:worker_died, op, Error.describe_exit(status))}
    after
      timeout -> {:error, Error.new(:timeout, op, "no reply from the worker within #{timeout} ms")}
    end
  end

  @doc """
  A blocking call that may also define tensors (`outs`, whose handles were
  made first): as `call/5`.
  """
  @spec request(t(), atom(), [pos_integer()], [pos_integer()], term(), timeout()) ::
          {:ok, term(), binary()} | {:error, Error.t()}
  def request(conn, op, outs, ins, attrs, timeout) do
    seq = :atomics.add_get(conn.counters, @seq, 1)
    mref = :erlang.monitor(:process, conn.owner, alias: :demonitor)

    if register(conn, seq, mref) do
      send_request(conn, op, seq, mref, Protocol.request(seq, conn.generation, op, outs, ins, attrs), timeout)
    else
      # The owner died, and its table with it, since `conn` was read; the
      # monitor says how.
      receive do
        {:DOWN, ^mref, :process, _, reason} -> {:error, Error.new(:worker_died, op, died(reason, conn))}
      end
    end
  end

  @doc """
  A call whose worker sends hook values before its reply (`run_program` of
  a program with hook steps, protocol.md §6 "Hooks"): each value arrives as
  `{:hook, seq, info}` with its bytes, and `on_value.(info, bytes, acc)`
  runs in the caller, in order, as they arrive, while the program goes on.
  The caller acknowledges firings with `hook_ack` as the protocol bounds
  them, before `on_value` runs for the firing's last value. When
  `on_value` raises (or throws, or exits), the run is cancelled and the
  exception goes on. Returns the call's `{:ok, result, payload}` or
  `{:error, error}` and the final `acc`. A worker's death answers it as any
  call, and the worker cancels a run whose caller exits.
  """
  @spec request_with_hooks(t(), atom(), [pos_integer()], [pos_integer()], term(), fun(), term()) ::
          {{:ok, term(), binary()} | {:error, Error.t()}, term()}
  def request_with_hooks(conn, op, outs, ins, attrs, on_value, acc) do
    seq = :atomics.add_get(conn.counters, @seq, 1)
    mref = :erlang.monitor(:process, conn.owner, alias: :demonitor)

    if register(conn, seq, mref) do
      # The owner cancels the run if this process exits before its reply.
      send(conn.owner, {:hook_run, seq, self()})
      hooks = %{on_value: on_value, acc: acc, firings: 0, acked: 0, bytes: 0}

      try do
        command_call(conn, op, Protocol.request(seq, conn.generation, op, outs, ins, attrs))
        await_hooks(conn, op, seq, mref, [], hooks)
      rescue
        e in Error ->
          forget(conn, seq, mref)
          {{:error, e}, acc}
      catch
        :throw, {:moat_hook_raised, kind, reason, stacktrace} ->
          cancel_hooks(conn, seq)
          forget(conn, seq, mref)
          :erlang.raise(kind, reason, stacktrace)
      end
    else
      receive do
        {:DOWN, ^mref, :process, _, reason} -> {{:error, Error.new(:worker_died, op, died(reason, conn))}, acc}
      end
    end
  end

  # The protocol's bounds (protocol.md §6, "Hooks"): the worker sends at
  # most 32 firings, or past 64 MiB one more, beyond the last acknowledged;
  # the client acknowledges every 16 firings and every 32 MiB.
  @ack_firings 16
  @ack_bytes 32 * 1024 * 1024

  defp await_hooks(conn, op, seq, mref, chunks, hooks) do
    receive do
      {^mref, {:more, chunk}} ->
        await_hooks(conn, op, seq, mref, [chunks | chunk], hooks)

      {^mref, {:hook, info, last}} ->
        bytes = join(chunks, last)
        hooks = hook_received(conn, seq, info, byte_size(bytes), hooks)

        acc =
          try do
            hooks.on_value.(info, bytes, hooks.acc)
          catch
            kind, reason -> throw({:moat_hook_raised, kind, reason, __STACKTRACE__})
          end

        await_hooks(conn, op, seq, mref, [], %{hooks | acc: acc})

      {^mref, {:ok, result, last}} ->
        Process.demonitor(mref, [:flush])
        {{:ok, result, join(chunks, last)}, hooks.acc}

      {^mref, {:error, failed_op, failure}} ->
        Process.demonitor(mref, [:flush])
        {{:error, Error.from_worker(failed_op, failure)}, hooks.acc}

      {:DOWN, ^mref, :process, _, reason} ->
        {{:error, Error.new(:worker_died, op, died(reason, conn))}, hooks.acc}
    end
  end

  defp hook_received(conn, seq, %{value: v, of: n}, size, hooks) when v == n - 1 do
    hooks = %{hooks | firings: hooks.firings + 1, bytes: hooks.bytes + size}

    if hooks.firings - hooks.acked >= @ack_firings or hooks.bytes >= @ack_bytes do
      hook_ack(conn, %{run: seq, received: hooks.firings})
      %{hooks | acked: hooks.firings, bytes: 0}
    else
      hooks
    end
  end

  defp hook_received(_conn, _seq, _info, size, hooks), do: %{hooks | bytes: hooks.bytes + size}

  @doc false
  # Stops run `seq` at its next hook (its caller raised or exited).
  def cancel_hooks(conn, seq), do: hook_ack(conn, %{run: seq, cancel: true})

  # Not admitted through the window: the worker reads acknowledgements while
  # a run waits for them, before it acknowledges the frames ahead of them.
  defp hook_ack(conn, attrs) do
    command(conn, :hook_ack, Protocol.request(0, conn.generation, :hook_ack, [], [], attrs))
  rescue
    Error -> :ok
  end

  defp register(conn, seq, mref) do
    :ets.insert(conn.table, {seq, mref})
  rescue
    ArgumentError -> false
  end

  defp send_request(conn, op, seq, mref, frame, timeout) do
    try do
      command_call(conn, op, frame)
      spin(conn)
      await(conn, op, seq, mref, [], timeout)
    rescue
      e in Error ->
        forget(conn, seq, mref)
        {:error, e}
    end
  end

  # A caller blocked in `receive` lets its scheduler go to sleep (in
  # epoll_wait), and when the worker's reply comes after that, the write
  # that carries it must wake the scheduler's halted CPU: about 25 µs on a
  # 2-vCPU VM, where a whole `:sync` takes 6 (docs/latency.md, "A small
  # readback, on the scheduler timeline", "The caller waits awake"). So the
  # caller first waits up to `:call_spin_us` for the pipe the worker
  # answers on to become readable, without sleeping (a NIF polling it): the
  # scheduler then reads the reply at once. Only when no other call of the
  # connection waits: one spinning caller per connection is enough to keep
  # the pipe read, and a queue of them would only burn CPU.
  defp spin(%__MODULE__{reply_fd: fd, table: table}) when is_integer(fd) do
    case Config.get(:call_spin_us) do
      us when is_integer(us) and us > 0 ->
        if :ets.info(table, :size) <= 1, do: Finalizer.wait_readable(fd, min(us, @max_spin_us))

      _ ->
        false
    end
  end

  defp spin(_conn), do: false

  defp await(conn, op, seq, mref, chunks, timeout) do
    receive do
      {^mref, {:more, chunk}} ->
        await(conn, op, seq, mref, [chunks | chunk], timeout)

      {^mref, {:ok, result, last}} ->
        Process.demonitor(mref, [:flush])
        {:ok, result, join(chunks, last)}

      {^mref, {:error, failed_op, failure}} ->
        Process.demonitor(mref, [:flush])
        {:error, Error.from_worker(failed_op, failure)}

      {:DOWN, ^mref, :process, _, reason} ->
        {:error, Error.new(:worker_died, op, died(reason, conn))}
    after
      timeout ->
        forget(conn, seq, mref)
        {:error, Error.new(:timeout, op, "no reply within #{timeout} ms")}
    end
  end

  defp join([], last), do: last
  defp join(chunks, last), do: IO.iodata_to_binary([chunks | last])

  defp forget(conn, seq, mref) do
    Process.demonitor(mref, [:flush])
    drain(mref)
    :ets.delete(conn.table, seq)
  catch
    # The table died with the worker process.
    :error, :badarg -> true
  end

  # Chunks, or a reply that raced the timeout, must not stay in the mailbox.
  defp drain(mref) do
    receive do
      {^mref, _} -> drain(mref)
    after
      0 -> :ok
    end
  end

  @doc false
  def died({:shutdown, {:worker_died, how}}, _conn), do: "the Moat worker died (#{how})"

  def died(:noproc, conn) do
    # The owner is already gone; it recorded how its worker died.
    case :persistent_term.get({__MODULE__, conn.name, :down}, nil) do
      {generation, how} when generation == conn.generation -> "the Moat worker died (#{how})"
      _ -> "the Moat worker is not running (it is restarting or stopped)"
    end
  end

  def died(reason, _conn), do: "the Moat worker's owner process exited: #{inspect(reason)}"

  @doc false
  # Called by the owner as it exits after its worker died, for callers that
  # only find out later (see `died/2`), with the owner's supervisor, which
  # is about to restart it (see `restarting?/1`).
  def record_down(%__MODULE__{name: name, generation: generation}, how) do
    :persistent_term.put({__MODULE__, name, :restarter}, List.first(Process.get(:"$ancestors", [])))
    :persistent_term.put({__MODULE__, name, :down}, {generation, how})
  end

  # The port is gone, so the owner is exiting (or has exited) and its exit
  # reason says how the worker died.
  defp cause(conn) do
    mref = Process.monitor(conn.owner)

    receive do
      {:DOWN, ^mref, :process, _, reason} -> died(reason, conn)
    after
      5_000 ->
        Process.demonitor(mref, [:flush])
        "the Moat worker's port is closed"
    end
  end

  @doc """
  Keeps `term` (the handles whose ids the next frame of this process reads)
  reachable until that frame is written, so that a garbage collection while
  the sender waits for the window cannot release them before the frame
  that reads them.
  """
  @spec pin(term()) :: :ok
  def pin(term) do
    Process.put(@pinned, term)
    :ok
  end

  # A frame is counted once it is written or pushed into the outbox (see
  # `command/3`): a sender that dies before that, waiting here or suspended on a busy port, must not
  # take a slot of the window with it, as the worker will never acknowledge
  # a frame it never got. Concurrent senders may overshoot the window by one
  # frame each.
  defp admit(%__MODULE__{counters: c, window: window} = conn) do
    target = :atomics.get(c, @sent) + 1 - window

    if target > :atomics.get(c, @acked) do
      try do
        GenServer.call(conn.owner, {:await_ack, target}, :infinity)
      catch
        :exit, reason -> raise Error.new(:worker_died, nil, died(exit_reason(reason), conn))
      end
    end

    :ok
  end

  defp exit_reason({reason, {GenServer, :call, _}}), do: reason
  defp exit_reason(reason), do: reason

  # How a frame reaches the worker (docs/latency.md, "Batched writes"):
  # where the connection has an outbox (a local worker, with the finalizer
  # NIF), a cast pushes its frame there and returns, and the connection's
  # writer (Moat.Writer) or the next call writes what piled up as one batch
  # packet. The push is synchronous and every write of queued frames
  # happens under the outbox's lock, so the order of pushes is the order of
  # frames, whatever process pushed them: anything another process does
  # with a handle comes after its creator's push. A frame counts against
  # the window once it is pushed (it is written unless the worker dies).
  defp command(%__MODULE__{outbox: nil} = conn, op, iodata), do: direct(conn, op, iodata)

  defp command(conn, op, iodata) do
    case push(conn, op, iodata) do
      :ok -> sent(conn)
      :closed -> raise Error.new(:worker_unavailable, op, cause(conn))
    end
  end

  # A call (its caller waits for the reply) writes itself when nothing is
  # queued: every frame it may depend on is then on the port already.
  # Behind queued frames, it writes them with its own frame last, in one
  # batch (so a call never waits for the writer). That batch is a port task
  # (`enif_port_command/4` never writes inline), run when this scheduler
  # next schedules: so the caller yields before it waits awake (`spin/1`),
  # which would otherwise hold the scheduler for the whole spin with its
  # frame unwritten, then sleep before the reply (docs/latency.md, "Batched
  # writes, a cast then a call").
  defp command_call(%__MODULE__{outbox: nil} = conn, op, iodata), do: direct(conn, op, iodata)

  defp command_call(conn, op, iodata) do
    case push_call(conn, op, iodata) do
      :direct ->
        direct(conn, op, iodata)

      :ok ->
        sent(conn)
        # The scheduler runs a queued port task before it picks the next
        # process: the batch is written before this process spins.
        :erlang.yield()
        :ok

      :closed ->
        raise Error.new(:worker_unavailable, op, cause(conn))
    end
  end

  # The NIF takes any iodata (nested deeper than its own walk goes, it
  # flattens the frame); what is not iodata is refused by name.
  defp push(conn, op, iodata) do
    Finalizer.outbox_push(conn.outbox, iodata)
  rescue
    ArgumentError -> not_iodata!(op, __STACKTRACE__)
  end

  defp push_call(conn, op, iodata) do
    Finalizer.outbox_call(conn.outbox, iodata)
  rescue
    ArgumentError -> not_iodata!(op, __STACKTRACE__)
  end

  defp payload_size(payload, op) do
    IO.iodata_length(payload)
  rescue
    ArgumentError -> not_iodata!(op, __STACKTRACE__)
  end

  defp not_iodata!(op, stacktrace) do
    reraise ArgumentError,
            "#{op}: the frame is not iodata (a payload must be a binary or a list of bytes and binaries)",
            stacktrace
  end

  # A frame with a large payload (an upload chunk): written by its sender
  # after everything queued before it, with `Port.command/2`, so that the
  # port's busy limit still bounds the payload bytes in flight.
  defp command_large(conn, op, iodata) do
    case Finalizer.outbox_flush(conn.outbox) do
      :ok -> direct(conn, op, iodata)
      :closed -> raise Error.new(:worker_unavailable, op, cause(conn))
    end
  end

  defp sent(conn) do
    :atomics.add(conn.counters, @sent, 1)
    Process.delete(@pinned)
    :ok
  end

  defp direct(conn, op, iodata) do
    transmit(conn.port, iodata)
    sent(conn)
  rescue
    e in ArgumentError ->
      cond do
        not is_port(conn.port) -> reraise(e, __STACKTRACE__)
        # An open port refuses only what is not iodata.
        Port.info(conn.port) -> not_iodata!(op, __STACKTRACE__)
        true -> raise Error.new(:worker_unavailable, op, cause(conn))
      end
  end

  # A local worker's port, or a remote worker's session (Moat.Remote).
  defp transmit(port, iodata) when is_port(port), do: Port.command(port, iodata)
  defp transmit(session, iodata), do: Remote.command(session, iodata)
end

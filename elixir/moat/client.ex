defmodule Moat.Client do
  @moduledoc """
  The protocol client: sends frames to a worker and waits for replies.

  Callers write to the port themselves (any process may), so ops do not queue
  behind a GenServer. Fire-and-forget frames are admitted through a window of
  unacknowledged frames (the worker acknowledges cumulatively), which bounds
  what a fast producer can pile up; payload bytes are bounded by the port's
  busy limit, which suspends a sender while the pipe is full. Calls register
  an alias under a sequence number in the worker's ETS table; the
  `Moat.Worker` process routes the reply to that alias. A caller also monitors
  the `Moat.Worker` process, so when the worker dies every call in flight gets
  an error at once.

  The connection (`t:t/0`) lives in `:persistent_term` and is replaced on every
  worker restart.

  Handles are made here (`ref/2`) so that each carries the token that frees
  its tensor once the VM has garbage-collected the handle (see `Moat`,
  "Memory").

  Large tensors skip the pipe where the worker runs on this host and offers
  shared memory (`upload/5`, `to_binary/2`; see `Moat.Worker`'s
  `:shared_memory` option).
  """

  require Logger

  alias Moat.{Error, Finalizer, Protocol, Ref, Releaser, Shared}

  @enforce_keys [:name, :port, :generation, :owner, :table, :counters, :releaser]
  defstruct [:name, :port, :generation, :owner, :table, :counters, :releaser, :window, :chunk_bytes, :info, :shared]

  @type t :: %__MODULE__{
          name: atom(),
          port: port(),
          generation: pos_integer(),
          owner: pid(),
          table: :ets.tid(),
          counters: :atomics.atomics_ref(),
          releaser: pid(),
          window: pos_integer(),
          chunk_bytes: pos_integer(),
          info: map(),
          shared: Shared.t() | nil
        }

  # Handles whose ids the next frame of this process reads (see ids!/3).
  @pinned :moat_pinned

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

  @doc "The current connection of a worker; raises when none is running."
  @spec conn(atom()) :: t()
  def conn(name \\ Moat.Worker) do
    :persistent_term.get({__MODULE__, name}, nil) ||
      raise Error.new(:worker_unavailable, nil, "no Moat worker named #{inspect(name)} is running")
  end

  @doc false
  def publish(%__MODULE__{name: name, generation: g} = conn) do
    # The generation outlives the connection, so that handles of a worker
    # stopped and started again stay stale.
    :persistent_term.put({__MODULE__, name, :generation}, g)
    :persistent_term.put({__MODULE__, name}, conn)
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

  @doc """
  A handle for `id` in this connection's generation. From now on, the tensor
  is released when the handle is garbage (or by `release/1`, or at the end of
  a `Moat.scope/1`). Make it before sending the frames that define `id`, so
  that the worker drops what it received should this process die before it
  sends them all (releasing an id the worker does not know is harmless).
  """
  @spec ref(t(), pos_integer()) :: Ref.t()
  def ref(%__MODULE__{name: name, generation: g, releaser: releaser} = conn, id) do
    announce_creator(name, releaser)
    collect_under_pressure(conn)
    Moat.Scope.record(name, g, id)
    %Ref{worker: name, generation: g, id: id, token: Finalizer.new(releaser, id)}
  end

  # After the worker reports memory pressure, the next handle a process makes
  # first collects that process's garbage and sends the releases it caused,
  # so a busy loop frees its dropped temporaries before it makes more.
  defp collect_under_pressure(%__MODULE__{name: name, counters: c, releaser: releaser}) do
    key = {:moat_pressure, name}
    reports = :atomics.get(c, @pressure)

    if Process.get(key, 0) != reports do
      Process.put(key, reports)
      :erlang.garbage_collect()
      Releaser.flush(releaser)
    end
  end

  # The releaser nudges idle creators into a garbage collection.
  defp announce_creator(name, releaser) do
    key = {Moat.Releaser, name}

    if Process.get(key) != releaser do
      Process.put(key, releaser)
      send(releaser, {:moat_creator, self()})
    end
  end

  @doc """
  Releases a handle's tensor now: `:ok`, or `:already_deallocated` when it
  was released before (or its worker restarted since). The id travels with
  others in the worker's next `:release` frame.
  """
  @spec release(Ref.t()) :: :ok | :already_deallocated
  def release(%Ref{worker: name, generation: g, id: id, token: token}) do
    case :persistent_term.get({__MODULE__, name}, nil) do
      %__MODULE__{generation: ^g, releaser: releaser} ->
        if take(token) do
          send(releaser, {:moat_release, id})
          :ok
        else
          :already_deallocated
        end

      _ ->
        take(token)
        :already_deallocated
    end
  end

  defp released?(token) do
    Finalizer.released?(token)
  rescue
    ArgumentError -> false
  end

  # A handle without a live token (made without one, or rebuilt by
  # :erlang.binary_to_term/1, which keeps only a plain reference) cannot
  # tell; it is released every time.
  defp take(nil), do: true

  defp take(token) do
    Finalizer.release(token)
  rescue
    ArgumentError -> true
  end

  @doc false
  # Releases ids of (worker, generation) without their handles (Moat.scope/1),
  # and returns once their frame is written: the caller's next frame comes
  # after it, so a released tensor is gone for whatever the caller does next.
  def release_ids(name, g, ids) do
    case :persistent_term.get({__MODULE__, name}, nil) do
      %__MODULE__{generation: ^g, releaser: releaser} ->
        send(releaser, {:moat_release_ids, ids})
        Releaser.flush(releaser)

      _ ->
        :ok
    end

    :ok
  end

  @doc """
  The ids of handles, after checking they belong to this connection's
  worker (else `ArgumentError`) and generation (else `Moat.Error`, reason
  `:stale_generation`), before anything is sent.

  The handles stay reachable until this process's next frame is written, so
  a garbage collection while `cast/6` waits for the window cannot release
  them before the frame that reads them.
  """
  @spec ids!(t(), [Ref.t()], atom()) :: [pos_integer()]
  def ids!(%__MODULE__{name: name, generation: g} = conn, refs, op) do
    Process.put(@pinned, refs)

    Enum.map(refs, fn
      %Ref{worker: ^name, generation: ^g, id: id, token: token} ->
        if token != nil and released?(token) do
          raise Error.new(:deallocated, op, "tensor #{id} was deallocated (Nx.backend_deallocate/1 or Moat.scope/1)")
        end

        id

      %Ref{worker: other, id: id} when other != name ->
        raise ArgumentError,
              "#{op}: tensor #{id} belongs to worker #{inspect(other)}, but this call runs on " <>
                "#{inspect(name)}; every tensor of a call must be on its worker (copy it over " <>
                "with Nx.backend_copy/2, or Moat.to_binary/1 and Moat.from_binary/4)"

      %Ref{generation: old} ->
        raise Error.new(
                :stale_generation,
                op,
                "tensor belongs to worker generation #{old}, but #{inspect(conn.name)} " <>
                  "restarted and is now generation #{g}; its data is gone"
              )
    end)
  end

  @doc "Sends a fire-and-forget op (no reply; failures poison `outs`)."
  @spec cast(t(), atom(), [pos_integer()], [pos_integer()], term(), iodata()) :: :ok
  def cast(conn, op, outs, ins, attrs, payload \\ []) do
    admit(conn)
    command(conn, op, Protocol.request(0, conn.generation, op, outs, ins, attrs, payload))
  end

  @doc """
  Uploads a binary as tensor `id` (whose handle `ref/2` made first): through a
  shared memory file when the connection has shared memory and the binary
  has at least its threshold of bytes, otherwise in frames of at most
  `chunk_bytes`. A refusal (the memory limit, say) poisons `id`: the next
  blocking call on it raises it.
  """
  @spec upload(t(), pos_integer(), binary(), [non_neg_integer()], Nx.Type.t()) :: :ok
  def upload(conn, id, binary, shape, type) do
    attrs = %{bytes: byte_size(binary), dtype: type, shape: shape}

    if shared?(conn, byte_size(binary)) and upload_shared(conn, id, binary, attrs) == :ok do
      :ok
    else
      upload_piped(conn, id, binary, attrs)
    end
  rescue
    # Errors name :from_binary, whichever way and in whichever frame the
    # bytes travel.
    e in Error ->
      detail = String.replace_prefix(e.message, "#{e.op}: ", "")
      reraise Error.new(e.reason, :from_binary, detail), __STACKTRACE__
  end

  defp shared?(%__MODULE__{shared: %{threshold: threshold}}, bytes), do: bytes > 0 and bytes >= threshold
  defp shared?(_conn, _bytes), do: false

  defp upload_shared(conn, id, binary, attrs) do
    case request(conn, :upload_file, [id], [], attrs, :infinity) do
      {:ok, location, _} ->
        case Shared.write(location, binary) do
          :ok ->
            cast(conn, :from_file, [id], [], nil)

          {:error, why} ->
            # The file is gone (:enoent) when the worker just died, and the
            # pipe will say so; anything else is not expected once the
            # hello's probe passed. Either way the bytes go through the pipe
            # once the worker has dropped its file.
            if why != :enoent do
              Logger.warning("Moat: cannot write the worker's shared file (#{inspect(why)}); using the pipe")
            end

            cast(conn, :release, [], [id], nil)
            :pipe
        end

      {:error, %Error{reason: :op_failed}} ->
        :ok

      {:error, e} ->
        raise e
    end
  end

  defp upload_piped(conn, id, binary, attrs) do
    size = attrs.bytes
    first = min(size, conn.chunk_bytes)
    cast(conn, :from_binary, [id], [], attrs, binary_part(binary, 0, first))
    upload_rest(conn, id, binary, first, size)
  end

  defp upload_rest(_conn, _id, _binary, offset, size) when offset >= size, do: :ok

  defp upload_rest(conn, id, binary, offset, size) do
    n = min(size - offset, conn.chunk_bytes)
    cast(conn, :upload, [id], [], offset, binary_part(binary, offset, n))
    upload_rest(conn, id, binary, offset + n, size)
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
  Evaluates a tensor and returns its bytes as `call/5` does, with the
  reply's metadata. Where the connection has shared memory, a tensor of at
  least its threshold of bytes is read straight from the worker's memory
  (the metadata says `transfer: :shared_memory`), and the worker holds it
  (as a pin, an id of its own) only until then.
  """
  @spec to_binary(Ref.t()) :: {:ok, map(), binary()} | {:error, Error.t()}
  def to_binary(%Ref{worker: name} = ref) do
    conn = conn(name)
    [id] = ids!(conn, [ref], :to_binary)

    case conn.shared do
      nil -> call(conn, :to_binary, [id], nil)
      shared -> to_binary_shared(conn, shared, ref, id)
    end
  end

  defp to_binary_shared(%__MODULE__{releaser: releaser} = conn, shared, ref, id) do
    pin = new_id()
    # The pin goes like a tensor: released below, or by this process's
    # garbage should it die before.
    token = Finalizer.new(releaser, pin)

    case request(conn, :to_binary, [pin], [id], %{pin: shared.threshold}, :infinity) do
      {:ok, %{address: address, bytes: bytes} = meta, _} ->
        read = Shared.read(shared, address, bytes)
        if Finalizer.release(token), do: send(releaser, {:moat_release, pin})

        case read do
          {:ok, data} ->
            {:ok, meta |> Map.delete(:address) |> Map.put(:transfer, :shared_memory), data}

          {:error, why} ->
            Logger.warning("Moat: cannot read the worker's memory (#{inspect(why)}); using the pipe")
            # The handle, used again here, stays alive until this call is sent.
            call(conn, :to_binary, ids!(conn, [ref], :to_binary), nil)
        end

      reply ->
        Finalizer.release(token)
        reply
    end
  end

  @doc """
  A call by the connection's owner before it publishes the connection (its
  own routing of replies cannot run while it waits): reads the reply off the
  port itself.
  """
  @spec owner_call(t(), atom(), term(), timeout()) :: {:ok, term()} | {:error, Error.t()}
  def owner_call(%__MODULE__{port: port} = conn, op, attrs, timeout \\ 15_000) do
    seq = :atomics.add_get(conn.counters, @seq, 1)
    command(conn, op, Protocol.request(seq, conn.generation, op, [], [], attrs))
    owner_await(conn, port, op, seq, timeout)
  end

  defp owner_await(conn, port, op, seq, timeout) do
    receive do
      {^port, {:data, frame}} ->
        case Protocol.decode(frame) do
          {:ok, {:ok, ^seq, result}, _} ->
            {:ok, result}

          {:ok, {:error, ^seq, failed_op, message}, _} ->
            {:error, failure(failed_op, message)}

          {:ok, {:ack, n}, _} ->
            record_ack(conn, n)
            owner_await(conn, port, op, seq, timeout)

          _ ->
            owner_await(conn, port, op, seq, timeout)
        end

      {^port, {:exit_status, status}} ->
        {:error, Error.new(:worker_died, op, Moat.Worker.describe_exit(status))}
    after
      timeout -> {:error, Error.new(:timeout, op, "no reply from the worker within #{timeout} ms")}
    end
  end

  defp request(conn, op, outs, ins, attrs, timeout) do
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

  defp register(conn, seq, mref) do
    :ets.insert(conn.table, {seq, mref})
  rescue
    ArgumentError -> false
  end

  defp send_request(conn, op, seq, mref, frame, timeout) do
    try do
      command(conn, op, frame)
      await(conn, op, seq, mref, [], timeout)
    rescue
      e in Error ->
        forget(conn, seq, mref)
        {:error, e}
    end
  end

  defp await(conn, op, seq, mref, chunks, timeout) do
    receive do
      {^mref, {:more, chunk}} ->
        await(conn, op, seq, mref, [chunks | chunk], timeout)

      {^mref, {:ok, result, last}} ->
        Process.demonitor(mref, [:flush])
        {:ok, result, join(chunks, last)}

      {^mref, {:error, failed_op, message}} ->
        Process.demonitor(mref, [:flush])
        {:error, failure(failed_op, message)}

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

  defp failure(:stale_generation, message), do: Error.new(:stale_generation, nil, message)
  defp failure(op, message), do: Error.new(:op_failed, op, message)

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
  # only find out later (see `died/2`).
  def record_down(%__MODULE__{name: name, generation: generation}, how),
    do: :persistent_term.put({__MODULE__, name, :down}, {generation, how})

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

  # A frame is counted once it is written (see `command/3`): a sender that
  # dies before that, waiting here or suspended on a busy port, must not
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

  defp command(conn, op, iodata) do
    Port.command(conn.port, iodata)
    :atomics.add(conn.counters, @sent, 1)
    Process.delete(@pinned)
    :ok
  rescue
    e in ArgumentError ->
      # Only a closed port is the worker's doing.
      if Port.info(conn.port), do: reraise(e, __STACKTRACE__)
      raise Error.new(:worker_unavailable, op, cause(conn))
  end
end

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
  "Memory"), and the connection's incarnation: a random number drawn when
  the worker started, which every use checks (`ids!/3`), so that a handle
  from another node, another VM or an earlier worker never names this
  worker's tensors. A handle whose worker runs on another connected node is
  copied into this one at the boundary (see `Moat.Ref`).

  Large tensors skip the pipe where the worker runs on this host and offers
  shared memory (`upload/5`, `to_binary/2`; see `Moat.Worker`'s
  `:shared_memory` option).
  """

  require Logger

  alias Moat.{Config, Error, Finalizer, Protocol, Ref, Releaser, Remote, Shared}

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
    :shared
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
  # an immediate integer, which `ids!/3` matches in one comparison.
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

  @doc """
  A handle for `id` in this connection's generation. From now on, the tensor
  is released when the handle is garbage (or by `release/1`, or at the end of
  a `Moat.scope/1`). Make it before sending the frames that define `id`, so
  that the worker drops what it received should this process die before it
  sends them all (releasing an id the worker does not know is harmless).
  """
  @spec ref(t(), pos_integer()) :: Ref.t()
  def ref(%__MODULE__{name: name, generation: g, incarnation: inc, owner: owner, releaser: releaser} = conn, id) do
    announce_creator(name, releaser)
    collect_under_pressure(conn)
    Moat.Scope.record(name, inc, id)
    %Ref{worker: name, generation: g, incarnation: inc, owner: owner, id: id, token: Finalizer.new(releaser, id)}
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
  others in the worker's next `:release` frame. A handle whose worker runs
  on another node is released there; `:already_deallocated` when that node
  cannot be reached.
  """
  @spec release(Ref.t()) :: :ok | :already_deallocated
  def release(%Ref{worker: name, incarnation: inc, id: id, token: token} = ref) do
    case :persistent_term.get({__MODULE__, name}, nil) do
      %__MODULE__{incarnation: ^inc, releaser: releaser} ->
        if take(token) do
          send(releaser, {:moat_release, id})
          :ok
        else
          :already_deallocated
        end

      _ ->
        release_elsewhere(ref, remote_node(ref))
    end
  end

  defp release_elsewhere(%Ref{token: token}, nil) do
    take(token)
    :already_deallocated
  end

  defp release_elsewhere(ref, node) do
    case on_owner(node, :release, [ref]) do
      {:ok, result} when result in [:ok, :already_deallocated] -> result
      _ -> :already_deallocated
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
  # Releases ids of (worker, incarnation) without their handles
  # (Moat.scope/1), and returns once their frame is written: the caller's
  # next frame comes after it, so a released tensor is gone for whatever the
  # caller does next.
  def release_ids(name, inc, ids) do
    case :persistent_term.get({__MODULE__, name}, nil) do
      %__MODULE__{incarnation: ^inc, releaser: releaser} ->
        send(releaser, {:moat_release_ids, ids})
        Releaser.flush(releaser)

      _ ->
        :ok
    end

    :ok
  end

  @doc """
  The ids of handles in this connection's worker, checked before anything
  is sent. A handle of this worker incarnation gives its id (or raises
  `Moat.Error`, reason `:deallocated`). Any other handle:

    * of a worker running on another node: its tensor is fetched from there
      and uploaded here, and the copy's id is given (`Moat.Error`,
      `:worker_unreachable` or `:foreign_tensor`, when that fails);
    * of another worker of this VM: `ArgumentError`;
    * of an earlier incarnation of this worker: `Moat.Error`,
      `:stale_generation`;
    * of an incarnation this VM never ran (a handle from another VM, read
      back with `:erlang.binary_to_term/1`): `Moat.Error`, `:foreign_tensor`.

  The handles (and copies) stay reachable until this process's next frame
  is written, so a garbage collection while `cast/6` waits for the window
  cannot release them before the frame that reads them.
  """
  @spec ids!(t(), [Ref.t()], atom()) :: [pos_integer()]
  def ids!(%__MODULE__{incarnation: inc} = conn, refs, op) do
    Process.put(@pinned, refs)
    local_ids(refs, inc, op) || copied_ids!(conn, refs, op)
  end

  # The common case, every handle of this incarnation: their ids, or nil.
  defp local_ids([%Ref{incarnation: inc, id: id, token: token} | rest], inc, op) do
    deallocated?(token, id, op)

    case local_ids(rest, inc, op) do
      nil -> nil
      ids -> [id | ids]
    end
  end

  defp local_ids([], _inc, _op), do: []
  defp local_ids(_refs, _inc, _op), do: nil

  # Uploading a copy writes frames, which unpins: the handles are pinned
  # again, with the copies, once every copy is made.
  defp copied_ids!(%__MODULE__{incarnation: inc} = conn, refs, op) do
    {ids, copies} =
      Enum.map_reduce(refs, [], fn
        %Ref{incarnation: ^inc, id: id, token: token}, copies ->
          deallocated?(token, id, op)
          {id, copies}

        ref, copies ->
          copy = not_here!(conn, ref, op)
          {copy.id, [copy | copies]}
      end)

    Process.put(@pinned, [copies | refs])
    ids
  end

  defp deallocated?(nil, _id, _op), do: false

  defp deallocated?(token, id, op) do
    if released?(token) do
      raise Error.new(:deallocated, op, "tensor #{id} was deallocated (Nx.backend_deallocate/1 or Moat.scope/1)")
    end

    false
  end

  defp not_here!(conn, %Ref{worker: worker, generation: old, id: id} = ref, op) do
    case locate(ref) do
      {:remote, node} ->
        import!(conn, ref, node, op)

      :unknown ->
        raise Error.new(
                :foreign_tensor,
                op,
                "tensor #{id} belongs to a worker incarnation this VM never ran (a handle from another " <>
                  "VM, such as one read back with :erlang.binary_to_term/1); its data is not here"
              )

      _local when worker != conn.name ->
        raise ArgumentError,
              "#{op}: tensor #{id} belongs to worker #{inspect(worker)}, but this call runs on " <>
                "#{inspect(conn.name)}; every tensor of a call must be on its worker (copy it over " <>
                "with Nx.backend_copy/2, or Moat.to_binary/1 and Moat.from_binary/4)"

      _local ->
        raise Error.new(
                :stale_generation,
                op,
                "tensor belongs to worker generation #{old}, but #{inspect(worker)} " <>
                  "restarted and is now generation #{last_generation(worker)}; its data is gone"
              )
    end
  end

  @doc false
  # Where a handle's tensor is: {:remote, node} (a worker of another node),
  # :current (a running worker of this VM), :stale (an earlier incarnation
  # of one) or :unknown (an incarnation this VM never ran). A pid made
  # before this VM became a distributed node names the new node; one read
  # back from a VM that was not distributed names :nonode@nohost, which no
  # node can reach.
  @spec locate(Ref.t()) :: {:remote, node()} | :current | :stale | :unknown
  def locate(%Ref{worker: name, incarnation: inc} = ref) do
    case remote_node(ref) do
      nil ->
        cond do
          :persistent_term.get({__MODULE__, :incarnation, inc}, nil) != name -> :unknown
          match?(%__MODULE__{incarnation: ^inc}, :persistent_term.get({__MODULE__, name}, nil)) -> :current
          true -> :stale
        end

      node ->
        {:remote, node}
    end
  end

  defp remote_node(%Ref{owner: owner}) when is_pid(owner) do
    case node(owner) do
      node when node == node() or node == :nonode@nohost -> nil
      node -> node
    end
  end

  defp remote_node(%Ref{}), do: nil

  # Copies a tensor of another node's worker into this connection's worker:
  # the copy's handle, made before its upload as every handle is.
  defp import!(conn, ref, node, op) do
    case fetch(ref, node, op) do
      {:ok, %{shape: shape, dtype: type}, data} ->
        id = new_id()
        copy = ref(conn, id)
        upload(conn, id, data, shape, type)
        copy

      {:error, e} ->
        raise e
    end
  end

  # A tensor's bytes and metadata, from the node whose worker holds it.
  defp fetch(%Ref{id: id} = ref, node, op) do
    case on_owner(node, :export, [ref]) do
      {:ok, {:ok, meta, data}} ->
        {:ok, Map.put(meta, :transfer, :distribution), data}

      {:ok, {:error, %Error{} = e}} ->
        if gone?(e) do
          {:error,
           Error.new(
             :foreign_tensor,
             op,
             "tensor #{id} lives in a worker of node #{node}, which cannot send it: #{e.message} " <>
               "(handles on other nodes do not keep a tensor alive: its own node must hold it while they use it)"
           )}
        else
          # The tensor's own failure (an op of it failed there), as it would
          # raise on its node.
          {:error, %{e | message: "#{e.message} (tensor #{id}, of node #{node})"}}
        end

      {:error, why} ->
        {:error, Error.new(:worker_unreachable, op, "tensor #{id} lives in a worker of node #{node}: #{why}")}
    end
  end

  # Whether the owner's answer means the tensor's data is not there (as
  # opposed to an op of it that failed).
  defp gone?(%Error{reason: :op_failed, message: message}), do: message =~ "unknown tensor id"
  defp gone?(%Error{reason: reason}), do: reason != :timeout

  @doc false
  # On the node whose worker holds the tensor, for another node that met
  # its handle: `to_binary/1`'s answer, never an exception.
  def export(%Ref{} = ref) do
    case locate(ref) do
      :current ->
        to_binary(ref)

      _ ->
        {:error, Error.new(:foreign_tensor, nil, "its worker incarnation is not running there any more")}
    end
  rescue
    e in Error -> {:error, e}
  end

  # Runs a function of this module on the node that holds a handle's
  # tensor: {:ok, result}, or {:error, why} where that node cannot be asked.
  defp on_owner(node, fun, args) do
    {:ok, :erpc.call(node, __MODULE__, fun, args)}
  catch
    :error, {:erpc, :noconnection} ->
      {:error, "that node is not connected (or not reachable from this one)"}

    :error, {:exception, :undef, [{__MODULE__, ^fun, _, _} | _]} ->
      {:error, "that node does not run this version of Moat"}

    kind, reason ->
      {:error, "asking that node failed: #{Exception.format_banner(kind, reason)}"}
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
    e in Error -> reraise Error.with_op(e, :from_binary), __STACKTRACE__
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
  (as a pin, an id of its own) only until then. A tensor of another node's
  worker comes from that node (`transfer: :distribution`).
  """
  @spec to_binary(Ref.t()) :: {:ok, map(), binary()} | {:error, Error.t()}
  def to_binary(%Ref{worker: name} = ref) do
    case remote_node(ref) do
      nil ->
        conn = conn(name)
        [id] = ids!(conn, [ref], :to_binary)

        case conn.shared do
          nil -> call(conn, :to_binary, [id], nil)
          shared -> to_binary_shared(conn, shared, ref, id)
        end

      node ->
        fetch(ref, node, :to_binary)
    end
  end

  defp to_binary_shared(%__MODULE__{releaser: releaser} = conn, shared, ref, id) do
    pin = new_id()
    # The pin goes like a tensor: released below, or by this process's
    # garbage should it die before.
    token = Finalizer.new(releaser, pin)

    case request(conn, :to_binary, [pin], [id], Shared.pin_attrs(shared), :infinity) do
      {:ok, meta, _} when is_map_key(meta, :address) or is_map_key(meta, :path) ->
        read = Shared.read_pinned(shared, meta)
        if Finalizer.release(token), do: send(releaser, {:moat_release, pin})

        case read do
          {:ok, data} ->
            {:ok, meta |> Map.drop([:address, :path, :inode]) |> Map.put(:transfer, :shared_memory), data}

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
    transmit(conn.port, iodata)
    :atomics.add(conn.counters, @sent, 1)
    Process.delete(@pinned)
    :ok
  rescue
    e in ArgumentError ->
      # Only a closed port is the worker's doing.
      if not is_port(conn.port) or Port.info(conn.port), do: reraise(e, __STACKTRACE__)
      raise Error.new(:worker_unavailable, op, cause(conn))
  end

  # A local worker's port, or a remote worker's session (Moat.Remote).
  defp transmit(port, iodata) when is_port(port), do: Port.command(port, iodata)
  defp transmit(session, iodata), do: Remote.command(session, iodata)
end

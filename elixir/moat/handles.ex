defmodule Moat.Handles do
  @moduledoc """
  Handles (`Moat.Ref`): their making, their release, and the checks of
  every handle a frame reads.

  Handles are made here (`ref/2`) so that each carries the token that frees
  its tensor once the VM has garbage-collected the handle (see `Moat`,
  "Memory"), and the connection's incarnation: a random number drawn when
  the worker started, which every use checks (`ids!/3`), so that a handle
  from another node, another VM or an earlier worker never names this
  worker's tensors. A handle whose worker runs on another connected node is
  copied into this one at the boundary (see `Moat.Ref`).

  Frames go out through `Moat.Client`; tensor bytes through `Moat.Transfer`.
  """

  alias Moat.{Client, Error, Finalizer, Ref, Releaser, Scope, Transfer}

  @doc """
  A handle for `id` in this connection's generation. From now on, the tensor
  is released when the handle is garbage (or by `release/1`, or at the end of
  a `Moat.scope/1`). Make it before sending the frames that define `id`, so
  that the worker drops what it received should this process die before it
  sends them all (releasing an id the worker does not know is harmless).
  """
  @spec ref(Client.t(), pos_integer()) :: Ref.t()
  def ref(%Client{name: name, generation: g, incarnation: inc, owner: owner, releaser: releaser} = conn, id) do
    announce_creator(name, releaser)
    collect_under_pressure(conn)
    Scope.record(name, inc, id)
    %Ref{worker: name, generation: g, incarnation: inc, owner: owner, id: id, token: Finalizer.new(releaser, id)}
  end

  # After the worker reports memory pressure, the next handle a process makes
  # first collects that process's garbage and sends the releases it caused,
  # so a busy loop frees its dropped temporaries before it makes more.
  defp collect_under_pressure(%Client{name: name, releaser: releaser} = conn) do
    key = {:moat_pressure, name}
    reports = Client.pressure_reports(conn)

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
    case Client.current(name) do
      %Client{incarnation: ^inc, releaser: releaser} ->
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
  @spec release_ids(atom(), non_neg_integer(), [pos_integer()]) :: :ok
  def release_ids(name, inc, ids) do
    case Client.current(name) do
      %Client{incarnation: ^inc, releaser: releaser} ->
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
  is written (`Moat.Client.pin/1`), so a garbage collection while
  `Moat.Client.cast/6` waits for the window cannot release them before the
  frame that reads them.
  """
  @spec ids!(Client.t(), [Ref.t()], atom()) :: [pos_integer()]
  def ids!(%Client{incarnation: inc} = conn, refs, op) do
    Client.pin(refs)
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
  defp copied_ids!(%Client{incarnation: inc} = conn, refs, op) do
    {ids, copies} =
      Enum.map_reduce(refs, [], fn
        %Ref{incarnation: ^inc, id: id, token: token}, copies ->
          deallocated?(token, id, op)
          {id, copies}

        ref, copies ->
          copy = not_here!(conn, ref, op)
          {copy.id, [copy | copies]}
      end)

    Client.pin([copies | refs])
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
                  "restarted and is now generation #{Client.last_generation(worker)}; its data is gone"
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
          Client.incarnation_worker(inc) != name -> :unknown
          match?(%Client{incarnation: ^inc}, Client.current(name)) -> :current
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
        id = Client.new_id()
        copy = ref(conn, id)
        Transfer.upload(conn, id, data, shape, type)
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

  @doc """
  Evaluates a handle's tensor and returns its bytes as `Moat.Client.call/5`
  does, with the reply's metadata (see `Moat.Transfer.read/4`). A tensor of
  another node's worker comes from that node (`transfer: :distribution`).
  """
  @spec to_binary(Ref.t(), non_neg_integer() | nil) :: {:ok, map(), binary()} | {:error, Error.t()}
  def to_binary(%Ref{worker: name} = ref, max_bytes \\ nil) do
    case remote_node(ref) do
      nil ->
        conn = Client.conn(name)
        [id] = ids!(conn, [ref], :to_binary)
        Transfer.read(conn, id, ref, max_bytes)

      node ->
        fetch(ref, node, :to_binary)
    end
  end

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
end

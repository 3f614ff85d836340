defmodule Moat.Peer do
  @moduledoc false
  # Other BEAM VMs running Moat, for tests of tensors that cross nodes: peers
  # (:peer) on loopback with this project's code paths. The functions below
  # the first section run on a peer (test modules exist only in the test
  # VM, so whatever a peer runs must be compiled into the build, as this is).

  ## In the test VM

  # One process keeps distribution up for every test module that asked for
  # it, counting them: a module's `stop_distribution/1` may run after the
  # next module's `ensure_distributed/0` (ExUnit runs a module's setup_all
  # `on_exit` callbacks apart from the next module's setup), and must not
  # stop distribution under it.
  @keeper :moat_test_distribution

  @doc """
  Makes this VM a distributed node (starting epmd if need be) until every
  caller has called `stop_distribution/1`; returns what to give it, or nil
  where the VM was one already.
  """
  def ensure_distributed do
    case Process.whereis(@keeper) do
      nil -> if Node.alive?(), do: nil, else: start_keeper()
      keeper -> ask(keeper, :use) || ensure_distributed()
    end
  end

  @doc "Ends what `ensure_distributed/0` started (the last caller's stops distribution)."
  def stop_distribution(nil), do: :ok
  def stop_distribution(keeper), do: ask(keeper, :stop) && :ok

  # The keeper's answer, or nil when it exited first (it was stopping).
  defp ask(keeper, what) do
    ref = Process.monitor(keeper)
    send(keeper, {what, self(), ref})

    receive do
      {^ref, :ok} ->
        Process.demonitor(ref, [:flush])
        keeper

      {:DOWN, ^ref, _, _, _} ->
        nil
    end
  end

  defp start_keeper do
    # epmd -daemon is a no-op where one runs already.
    {_, 0} = System.cmd(epmd(), ["-daemon"])
    caller = self()

    # Distribution stops when the process that started it exits: a process
    # of its own keeps it up for the tests.
    keeper =
      spawn(fn ->
        Process.register(self(), @keeper)
        {:ok, _} = :net_kernel.start(:"moat_test_#{System.pid()}@127.0.0.1", %{name_domain: :longnames})
        send(caller, {:distributed, self()})
        keep(1)
      end)

    receive do
      {:distributed, ^keeper} -> keeper
    end
  end

  defp keep(users) do
    receive do
      {:use, from, ref} ->
        send(from, {ref, :ok})
        keep(users + 1)

      {:stop, from, ref} when users == 1 ->
        # Stopped before the answer, so the caller finds the VM as it was.
        :net_kernel.stop()
        send(from, {ref, :ok})

      {:stop, from, ref} ->
        send(from, {ref, :ok})
        keep(users - 1)
    end
  end

  defp epmd do
    erts = Path.join([to_string(:code.root_dir()), "erts-#{:erlang.system_info(:version)}", "bin", "epmd"])
    System.find_executable("epmd") || erts
  end

  @doc """
  Starts a peer VM running Moat (its default backend Moat.Backend), linked
  to the caller; returns `{peer, node}`. `name: nil` starts one that is not
  a distributed node (driven through its standard I/O; call it with
  `call/4`).
  """
  def start(name, opts \\ []) do
    # Peers connect to each other only when a test says so; global's guard
    # against overlapping partitions would otherwise disconnect nodes as
    # other peers stop.
    paths = Enum.flat_map(:code.get_path(), &[~c"-pa", &1])
    paths = [~c"-kernel", ~c"prevent_overlapping_partitions", ~c"false", ~c"-connect_all", ~c"false" | paths]

    spec =
      case name do
        nil -> %{connection: :standard_io, args: paths}
        name -> %{name: name, host: ~c"127.0.0.1", longnames: true, args: paths}
      end

    {:ok, peer, node} = :peer.start_link(Map.merge(spec, Map.new(opts)))
    :ok = call(if(name, do: node, else: peer), __MODULE__, :boot, [])
    {peer, node}
  end

  @doc "Runs `module.fun(args)` on a peer: its node, or its pid where it is not distributed."
  def call(node, module, fun, args) when is_atom(node), do: :erpc.call(node, module, fun, args, 60_000)
  def call(peer, module, fun, args) when is_pid(peer), do: :peer.call(peer, module, fun, args, 60_000)

  ## On a peer

  @doc false
  def boot do
    {:ok, _} = Application.ensure_all_started(:moat)
    Nx.global_default_backend(Moat.Backend)
    :ok
  end

  @doc """
  Makes tensors of `values` held by a process of this node (until
  `drop/1`), so that they outlive the call; returns `{holder, tensors}`.
  """
  def hold(values_list) do
    caller = self()

    holder =
      spawn(fn ->
        tensors = Enum.map(values_list, &Nx.tensor(&1, type: :s32))
        Enum.each(tensors, &Nx.to_binary/1)
        send(caller, {:held, self(), tensors})
        # Used after the wait, so that the holder's garbage collections
        # (the releaser nudges idle creators) leave them alone.
        receive do
          :drop -> tensors
        end
      end)

    receive do
      {:held, ^holder, tensors} -> {holder, tensors}
    end
  end

  @doc "Like `hold/1`, for an s32 iota of `n` elements (evaluated)."
  def hold_iota(n) do
    caller = self()

    holder =
      spawn(fn ->
        t = Nx.iota({n}, type: :s32)
        Nx.to_binary(t)
        send(caller, {:held, self(), t})

        receive do
          :drop -> t
        end
      end)

    receive do
      {:held, ^holder, t} -> {holder, t}
    end
  end

  @doc "Like `hold/1`, for a tensor whose op fails (an index out of range)."
  def hold_failed do
    caller = self()

    holder =
      spawn(fn ->
        failed = Nx.take(Nx.tensor([1, 2], type: :s32), Nx.tensor([5]))
        send(caller, {:held, self(), failed})

        receive do
          :drop -> failed
        end
      end)

    receive do
      {:held, ^holder, failed} -> {holder, failed}
    end
  end

  @doc "Lets a holder go: its tensors are released once it exits."
  def drop(holder) do
    ref = Process.monitor(holder)
    send(holder, :drop)

    receive do
      {:DOWN, ^ref, _, _, _} -> :ok
    end
  end

  @doc """
  Fills this node's worker with `n` tensors of `[2000, 2000]`, kept for the
  life of the node: where a handle from elsewhere aliased one of this
  worker's ids, it would read these values. Returns the highest id.
  """
  def fill(n) do
    {_holder, tensors} = hold(List.duplicate([2000, 2000], n))
    :persistent_term.put({__MODULE__, :fill}, tensors)
    tensors |> Enum.map(& &1.data.ref.id) |> Enum.max()
  end

  @doc "The tensor's values, or how reading it raised."
  def read(tensor), do: attempt(fn -> Nx.to_flat_list(tensor) end)

  @doc """
  What a few ops on a tensor (maybe of another node) give here, in order,
  each as `read/1` gives it (the last transfers it, which releases it).
  """
  def ops(tensor) do
    local = Nx.tensor([1, 1], type: :s32)

    [
      read: read(tensor),
      add: attempt(fn -> tensor |> Nx.add(local) |> Nx.to_flat_list() end),
      sum: attempt(fn -> tensor |> Nx.sum() |> Nx.to_number() end),
      binary: attempt(fn -> for <<x::signed-32-native <- Moat.to_binary(tensor.data.ref)>>, do: x end),
      shape: attempt(fn -> Moat.shape(tensor.data.ref) end),
      copy: attempt(fn -> tensor |> Nx.backend_copy(Nx.BinaryBackend) |> Nx.to_flat_list() end),
      transfer: attempt(fn -> tensor |> Nx.backend_transfer(Moat.Backend) |> Nx.to_flat_list() end)
    ]
  end

  @doc "Receives one `{:tensor, from, tensor}` message and answers `{:used, ops(tensor)}`."
  def receiver do
    receive do
      {:tensor, from, tensor} -> send(from, {:used, self(), ops(tensor)})
    end
  end

  @doc "Writes a tensor of `values`, serialized with :erlang.term_to_binary/1, to `path`."
  def write(path, values) do
    tensor = Nx.tensor(values, type: :s32)
    File.write!(path, :erlang.term_to_binary(tensor))
    tensor.data.ref.id
  end

  @doc "Reads back a tensor `write/2` wrote and uses it (`ops/1`)."
  def read_back(path), do: path |> File.read!() |> :erlang.binary_to_term() |> ops()

  @doc "Starts a distributed Nx.Serving named `name` here, computing 2x + 1."
  def start_serving(name, postprocess?) do
    caller = self()

    spawn(fn ->
      serving = Nx.Serving.jit(&affine/1)

      serving =
        if postprocess?,
          do: Nx.Serving.distributed_postprocessing(serving, &Nx.backend_transfer(&1, Nx.BinaryBackend)),
          else: serving

      {:ok, _} = Nx.Serving.start_link(serving: serving, name: name, batch_size: 4, batch_timeout: 20)
      send(caller, :serving)
      Process.sleep(:infinity)
    end)

    receive do
      :serving -> :ok
    end
  end

  @doc false
  def affine(x), do: x |> Nx.multiply(2) |> Nx.add(1)

  @doc "Whether this node sees the serving `name` (its :pg group reached it)."
  def sees_serving?(name), do: :pg.get_members(Nx.Serving.PG, name) != []

  @doc """
  Runs a batch of this node's Moat tensors through the distributed serving
  `name` (on another node); the result's values (or how reading it raised)
  and the node whose worker holds the result.
  """
  def run_serving(name, rows) do
    batch = rows |> Enum.map(&Nx.tensor(&1, type: :s32)) |> Nx.Batch.stack()
    result = Nx.Serving.batched_run({:distributed, name}, batch)

    holder =
      case result do
        %Nx.Tensor{data: %Moat.Backend{ref: ref}} -> node(ref.owner)
        %Nx.Tensor{data: %other{}} -> other
      end

    {read(result), holder}
  end

  defp attempt(fun) do
    {:ok, fun.()}
  rescue
    e in Moat.Error -> {:raised, e.reason, Exception.message(e)}
  end
end

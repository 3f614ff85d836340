defmodule Moat.DistributionTest do
  # Tensors that leave the VM whose worker holds them: sent to another node
  # in a message, through a distributed Nx.Serving, or serialized with
  # :erlang.term_to_binary/1 and read back after a worker restart or in a
  # later VM. Every use gives the tensor's own values or raises; none reads
  # another tensor that has the same id (each worker fills itself with
  # [2000, 2000]s first, so that an aliased id would read those). Real peer
  # VMs on loopback (:peer), each with its own worker.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.Peer

  setup_all do
    keeper = Peer.ensure_distributed()
    on_exit(fn -> Peer.stop_distribution(keeper) end)
  end

  # A node name of its own for each peer: a peer of an earlier test may
  # still be on its way down.
  defp name(role), do: :"moat_#{role}_#{System.pid()}_#{System.unique_integer([:positive])}"

  defp all_ok(values, used), do: Enum.map(used, fn {use, _} -> {use, {:ok, values[use]}} end)

  # What Moat.Peer.ops/1 gives for a tensor of [4, 5] (its ops add [1, 1]).
  @four_five [read: [4, 5], add: [5, 6], sum: 9, binary: [4, 5], shape: {2}, copy: [4, 5], transfer: [4, 5]]

  describe "a tensor sent to another node" do
    test "reads its own values there, copied from its node at the boundary" do
      {_pa, a} = Peer.start(name(:a))
      {_pb, b} = Peer.start(name(:b))
      highest = Peer.call(b, Peer, :fill, [300])
      {_holder, [t]} = Peer.call(a, Peer, :hold, [[[4, 5]]])
      assert t.data.ref.id <= highest, "node b's worker has a tensor of the same id"

      # Here first (this VM's worker has tensors of its own), and back on its
      # own node, where the handle is the original again.
      assert Nx.to_flat_list(t) == [4, 5]
      assert Nx.to_flat_list(Nx.add(t, Nx.tensor([1, 1], type: :s32, backend: Moat.Backend))) == [5, 6]
      assert Peer.call(a, Peer, :read, [t]) == {:ok, [4, 5]}

      receiver = Node.spawn(b, Peer, :receiver, [])
      send(receiver, {:tensor, self(), t})
      assert_receive {:used, ^receiver, used}, 30_000
      assert used == all_ok(@four_five, used)

      # Node b's last op, Nx.backend_transfer/2, released it on node a, as it
      # would on one node.
      assert {:raised, :deallocated, _} = Peer.call(a, Peer, :read, [t])
      assert %Moat.Error{reason: :foreign_tensor} = catch_error(Nx.to_flat_list(t))
      assert node(t.data.ref.owner) == a
    end

    test "whose op failed on its node raises that failure, naming the op" do
      {_pa, a} = Peer.start(name(:a))
      {_pb, b} = Peer.start(name(:b))
      {_holder, failed} = Peer.call(a, Peer, :hold_failed, [])
      assert {:raised, :op_failed, at_home} = Peer.call(a, Peer, :read, [failed])
      assert {:raised, :op_failed, message} = Peer.call(b, Peer, :read, [failed])
      assert message =~ at_home and message =~ "take"
    end

    test "raises :foreign_tensor once its node dropped it, :worker_unreachable once that node is gone" do
      {pa, a} = Peer.start(name(:a))
      {_pb, b} = Peer.start(name(:b))
      Peer.call(b, Peer, :fill, [300])
      {holder, [dropped]} = Peer.call(a, Peer, :hold, [[[4, 5]]])
      {_holder, [kept]} = Peer.call(a, Peer, :hold, [[[6, 7]]])

      assert Peer.call(b, Peer, :read, [dropped]) == {:ok, [4, 5]}
      Peer.call(a, Peer, :drop, [holder])

      # Handles elsewhere do not keep a tensor alive: until node a's release
      # reaches its worker, reads still see the tensor, then they raise.
      eventually(
        fn ->
          case Peer.call(b, Peer, :read, [dropped]) do
            {:ok, [4, 5]} -> false
            {:raised, :foreign_tensor, message} -> message =~ "unknown tensor id"
          end
        end,
        10_000
      )

      assert Peer.call(b, Peer, :read, [kept]) == {:ok, [6, 7]}
      :peer.stop(pa)
      assert {:raised, :worker_unreachable, message} = Peer.call(b, Peer, :read, [kept])
      assert message =~ "not connected"
    end
  end

  describe "Nx.Serving {:distributed, name}" do
    test "answers a batch of another node's tensors with the right values" do
      {_pa, a} = Peer.start(name(:a))
      {_pb, b} = Peer.start(name(:b))
      Peer.call(a, Peer, :fill, [300])
      Peer.call(b, Peer, :fill, [300])
      serving = name(:serving)
      :ok = Peer.call(a, Peer, :start_serving, [serving, true])
      true = :erpc.call(b, Node, :connect, [a])
      eventually(fn -> Peer.call(b, Peer, :sees_serving?, [serving]) end, 10_000)

      # The batch's tensors are node b's; node a's serving copies them in.
      assert Peer.call(b, Peer, :run_serving, [serving, [[1, 2], [3, 4]]]) ==
               {{:ok, [3, 5, 7, 9]}, Nx.BinaryBackend}
    end

    test "without postprocessing, the result is node a's: its values, or :foreign_tensor once a released it" do
      {_pa, a} = Peer.start(name(:a))
      {_pb, b} = Peer.start(name(:b))
      Peer.call(a, Peer, :fill, [300])
      Peer.call(b, Peer, :fill, [300])
      serving = name(:raw_serving)
      :ok = Peer.call(a, Peer, :start_serving, [serving, false])
      true = :erpc.call(b, Node, :connect, [a])
      eventually(fn -> Peer.call(b, Peer, :sees_serving?, [serving]) end, 10_000)

      for _ <- 1..5 do
        assert {read, ^a} = Peer.call(b, Peer, :run_serving, [serving, [[1, 2], [3, 4]]])
        assert match?({:ok, [3, 5, 7, 9]}, read) or match?({:raised, :foreign_tensor, _}, read), inspect(read)
      end
    end
  end

  describe "a serialized handle" do
    setup do
      path = Path.join(System.tmp_dir!(), "moat_handle_#{System.pid()}_#{System.unique_integer([:positive])}")
      on_exit(fn -> File.rm(path) end)
      {:ok, path: path}
    end

    test "raises :stale_generation after its worker restarted" do
      worker = start_worker(:serialized_worker, log_level: :error)
      t = Nx.tensor([4, 5], type: :s32, backend: {Moat.Backend, worker: worker})
      binary = :erlang.term_to_binary(t)
      generation = Moat.Worker.info(worker).generation
      kill(os_pid(worker))
      await_generation_after(worker, generation)
      filler = for _ <- 1..50, do: Nx.tensor([2000, 2000], type: :s32, backend: {Moat.Backend, worker: worker})

      back = :erlang.binary_to_term(binary)
      assert_raise Moat.Error, ~r/generation #{generation}.*restarted/, fn -> Nx.to_flat_list(back) end
      assert %Moat.Error{reason: :stale_generation} = catch_error(Nx.add(back, hd(filler)) |> Nx.to_flat_list())
      assert Moat.deallocate(back.data.ref) == :already_deallocated
    end

    test "raises :foreign_tensor in a later VM of the same node name", %{path: path} do
      node_name = name(:same)
      {p1, n1} = Peer.start(node_name)
      id = Peer.call(n1, Peer, :write, [path, [4, 5]])
      :peer.stop(p1)

      {_p2, n2} = start_again(node_name)
      assert n2 == n1
      assert id <= Peer.call(n2, Peer, :fill, [300])

      for {use, result} <- Peer.call(n2, Peer, :read_back, [path]) do
        assert {:raised, :foreign_tensor, message} = result, "#{use}: #{inspect(result)}"
        assert message =~ "never ran"
      end
    end

    test "raises :foreign_tensor in a later VM that is not a distributed node, and here", %{path: path} do
      {p1, :nonode@nohost} = Peer.start(nil)
      id = Peer.call(p1, Peer, :write, [path, [4, 5]])
      :peer.stop(p1)

      {p2, :nonode@nohost} = Peer.start(nil)
      assert id <= Peer.call(p2, Peer, :fill, [300])

      for {use, result} <- Peer.call(p2, Peer, :read_back, [path]) do
        assert {:raised, :foreign_tensor, _} = result, "#{use}: #{inspect(result)}"
      end

      # This VM is a distributed node: the handle names :nonode@nohost,
      # which no node can reach.
      back = path |> File.read!() |> :erlang.binary_to_term()
      assert %Moat.Error{reason: :foreign_tensor} = catch_error(Nx.to_flat_list(back))
      assert %Moat.Error{reason: :foreign_tensor} = catch_error(Moat.to_binary(back.data.ref))
    end
  end

  # A node name is free again once epmd has seen its last VM go.
  defp start_again(node_name, tries \\ 50) do
    Peer.start(node_name)
  catch
    :exit, _ when tries > 0 ->
      Process.sleep(100)
      start_again(node_name, tries - 1)
  end
end

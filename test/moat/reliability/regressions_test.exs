defmodule Moat.Reliability.RegressionsTest do
  # Bugs the reliability suite found in the client, one test each (the others
  # are covered where they belong: the owner surviving damaged frames in
  # malformed_test.exs, the crash cause reaching every caller in crash_test.exs).
  use ExUnit.Case, async: false

  alias Moat.Client

  test "ids drawn concurrently by many first callers are unique" do
    # Ids once came from a counter created lazily by its first caller, under
    # this key; racing first callers each made one and drew the same ids.
    :persistent_term.erase({Client, :ids})
    parent = self()

    for _ <- 1..50 do
      spawn_link(fn -> send(parent, {:ids, [Client.new_id() | Client.new_ids(200)]}) end)
    end

    ids =
      for _ <- 1..50 do
        assert_receive {:ids, ids}, 5_000
        ids
      end
      |> List.flatten()

    assert length(ids) == 50 * 201
    assert length(Enum.uniq(ids)) == length(ids)
    assert Enum.all?(ids, &(&1 > 0 and &1 < 18_446_744_073_709_551_616))
  end

  test "senders killed while they wait for the window do not shrink it" do
    # A frame was once counted before it was written, so each sender killed
    # while waiting took a slot of the window with it; after `window` such
    # deaths every cast waited forever for an ack that could not come.
    worker = Moat.Case.start_worker(:window_victims, worker_path: Moat.Reliability.fault_worker_path(), window: 2)
    conn = Client.conn(worker)
    # Stall the session so nothing is acknowledged for a while.
    Moat.Reliability.inject(worker, {:sleep, 800})
    senders = for _ <- 1..12, do: spawn(fn -> Client.cast(conn, :release, [], [], nil) end)
    Process.sleep(200)
    waiting = Enum.filter(senders, &Process.alive?/1)
    # More than the window's worth of them.
    assert length(waiting) >= 4
    Enum.each(waiting, &Process.exit(&1, :kill))
    {:ok, _, _} = Client.call(conn, :sync, [], nil)

    task = Task.async(fn -> for _ <- 1..20, do: Client.cast(conn, :release, [], [], nil) end)
    assert Task.yield(task, 5_000), "casts still wait for acknowledgements that cannot come"
  end

  test "a process killed while it sends ops leaves no tensor in the worker" do
    # An op's result handles were once made after its frame was sent; a
    # process killed in between left the tensor with no handle to release it.
    worker = Moat.Case.start_worker(:killed_creators)
    a = Nx.tensor([1.0, 2.0], backend: {Moat.Backend, worker: worker})
    base = Moat.memory_info(worker).tensors

    for delay <- 1..30 do
      pid = spawn(fn -> Stream.repeatedly(fn -> Nx.add(a, a) end) |> Stream.run() end)
      Process.sleep(rem(delay, 7) + 1)
      Process.exit(pid, :kill)
    end

    Moat.Case.eventually(
      fn ->
        for p <- Process.list(), do: :erlang.garbage_collect(p)
        Moat.memory_info(worker).tensors <= base
      end,
      5_000
    )

    assert Nx.to_flat_list(a) == [1.0, 2.0]
  end

  test "a tensor a scope released is gone for what the process does next" do
    worker = Moat.Case.start_worker(:scoped)

    leaked =
      Moat.scope(fn ->
        Nx.tensor([1.0, 2.0], backend: {Moat.Backend, worker: worker}) |> Nx.add(1) |> then(&{:ok, &1.data.ref.id})
      end)

    assert {:ok, _} = leaked

    inner = Moat.scope(fn -> send(self(), {:t, Nx.tensor([3.0], backend: {Moat.Backend, worker: worker})}) && :done end)
    assert inner == :done
    assert_received {:t, t}
    error = assert_raise Moat.Error, fn -> Nx.to_binary(t) end
    assert error.message =~ "unknown tensor id"
  end
end

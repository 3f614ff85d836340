defmodule Moat.Reliability.WatchdogTest do
  # A worker that stops making progress while calls wait on it is found by
  # the watchdog, killed by its OS pid and restarted, and every waiting
  # caller gets a Moat.Error; a long computation, which keeps using CPU
  # time, is left alone. The hang and the computation are injected
  # (the fault-injection build's :hang and :spin).
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error, Reliability}

  @moduletag :capture_log
  @watchdog 400

  setup do
    name = :"watchdog_#{System.unique_integer([:positive])}"
    test = self()

    :telemetry.attach_many(
      {name, :lifecycle},
      [[:moat, :worker, :up], [:moat, :worker, :down]],
      fn [:moat, :worker, ev], _m, %{worker: ^name} = meta, _ ->
        send(test, {:lifecycle, ev, meta, System.monotonic_time(:millisecond)})
      end,
      nil
    )

    on_exit(fn -> :telemetry.detach({name, :lifecycle}) end)
    child = {Moat.Worker, name: name, worker_path: Reliability.fault_worker_path(), watchdog: @watchdog}

    start_supervised!(%{
      id: name,
      type: :supervisor,
      start: {Supervisor, :start_link, [[child], [strategy: :one_for_one, max_restarts: 100, max_seconds: 1]]}
    })

    assert_receive {:lifecycle, :up, %{generation: 1}, _}, 5_000
    %{worker: name}
  end

  test "a hung worker is killed and restarted; every waiting caller gets an error", %{worker: worker} do
    %{generation: g, os_pid: os_pid} = Moat.Worker.info(worker)
    Reliability.inject(worker, :hang)
    test = self()

    for i <- 1..4 do
      spawn(fn ->
        result =
          try do
            t = Nx.tensor([i * 1.0], backend: {Moat.Backend, worker: worker}) |> Nx.add(1)
            send(test, {:waiting, i, System.monotonic_time(:millisecond)})
            Nx.to_binary(t)
          rescue
            e in Error -> e
          end

        send(test, {:caller, i, result})
      end)
    end

    waiting_since =
      for i <- 1..4 do
        assert_receive {:waiting, ^i, at}, 5_000
        at
      end
      |> Enum.min()

    for i <- 1..4 do
      assert_receive {:caller, ^i, %Error{reason: :worker_died, message: message}}, 5_000
      assert message =~ "hung"
    end

    assert_receive {:lifecycle, :down, %{generation: ^g, reason: reason}, down_at}, 1_000
    assert reason =~ "killed by the watchdog"
    # Found within the watchdog period plus two checks of the first call's
    # wait (the watchdog counts from there: no progress while calls wait; a
    # loaded machine may take a while to get the callers that far).
    assert down_at - waiting_since < @watchdog + 3 * div(@watchdog, 4) + 200
    assert_receive {:lifecycle, :up, %{generation: g2}, _}, 5_000
    assert g2 == g + 1
    eventually(fn -> not os_alive?(os_pid) end)
    assert Nx.tensor([1.0], backend: {Moat.Backend, worker: worker}) |> Nx.add(1) |> Nx.to_flat_list() == [2.0]
  end

  test "a long computation is not a hang: it keeps the CPU busy, and its callers get their results",
       %{worker: worker} do
    %{generation: g} = Moat.Worker.info(worker)
    Reliability.inject(worker, {:spin, 5 * @watchdog})
    t = Nx.tensor([1.0, 2.0], backend: {Moat.Backend, worker: worker})
    {us, sum} = :timer.tc(fn -> t |> Nx.add(1) |> Nx.sum() |> Nx.to_number() end)
    assert sum == 5.0
    assert us > 4 * @watchdog * 1000
    assert Moat.Worker.info(worker).generation == g
    refute_received {:lifecycle, :down, _, _}
  end

  test "an idle worker is not a hung one", %{worker: worker} do
    %{generation: g} = Moat.Worker.info(worker)
    Process.sleep(3 * @watchdog)
    assert {:ok, _, _} = Client.call(Client.conn(worker), :sync, [], nil)
    assert Moat.Worker.info(worker).generation == g
  end

  test "a starved worker is not a hung one: runnable threads are read from /proc" do
    busy = Port.open({:spawn, "sh -c 'while :; do :; done'"}, [])
    sleeping = Port.open({:spawn, "sleep 60"}, [])
    {:os_pid, busy_pid} = Port.info(busy, :os_pid)
    {:os_pid, sleeping_pid} = Port.info(sleeping, :os_pid)

    try do
      eventually(fn -> Moat.Worker.runnable?(busy_pid) end)
      eventually(fn -> not Moat.Worker.runnable?(sleeping_pid) end)
      refute Moat.Worker.runnable?(0)
    after
      System.cmd("kill", ["-KILL", "#{busy_pid}", "#{sleeping_pid}"])
    end
  end
end

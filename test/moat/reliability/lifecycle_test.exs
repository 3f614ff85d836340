defmodule Moat.Reliability.LifecycleTest do
  # Restart intensity and orphans: a crash loop ends in a supervisor exit, not
  # a spin, and no worker (nor its input holder) outlives its port, its
  # owner or the application. (The VM killed while the worker is busy is in
  # worker_test.exs.)
  use ExUnit.Case, async: false
  import Moat.Case
  import ExUnit.CaptureLog

  alias Moat.{Client, Error, Reliability}

  @moduletag :capture_log

  setup do
    test = self()
    id = {__MODULE__, make_ref()}
    events = [[:moat, :worker, :up], [:moat, :worker, :down]]
    :telemetry.attach_many(id, events, &__MODULE__.forward/4, test)
    on_exit(fn -> :telemetry.detach(id) end)
    :ok
  end

  @doc false
  def forward([:moat, :worker, event], _measurements, meta, test), do: send(test, {event, meta})

  test "a crash loop ends in a supervisor exit after the allowed restarts" do
    max_restarts = 3
    Process.flag(:trap_exit, true)

    log =
      capture_log(fn ->
        {:ok, sup} =
          Supervisor.start_link([{Moat.Worker, name: :crash_loop}],
            strategy: :one_for_one,
            max_restarts: max_restarts,
            max_seconds: 10
          )

        # Every incarnation dies as soon as it is up.
        pids = kill_each_incarnation(sup, [])
        send(self(), {:pids, pids})
      end)

    assert_received {:pids, pids}
    assert_received {:supervisor_exit, :shutdown}
    # The first start and exactly max_restarts restarts: no spin.
    assert length(pids) == max_restarts + 1

    assert length(Regex.scan(~r/Moat worker :crash_loop \(generation \d\) died: killed by signal 9/, log)) ==
             length(pids)

    Enum.each(pids, fn pid -> eventually(fn -> not os_alive?(pid) end, 1_000) end)

    # Afterwards a caller gets an error at once, naming what happened last.
    error = assert_raise Error, fn -> Moat.from_binary(f32([1.0]), {1}, {:f, 32}, worker: :crash_loop) end
    assert error.reason == :worker_unavailable
    assert error.message =~ "SIGKILL"

    Reliability.record(
      :crashes,
      "crash loop (every incarnation SIGKILLed at start)",
      length(pids),
      length(pids),
      0,
      "supervisor (max_restarts #{max_restarts}) exits with :shutdown after #{max_restarts} restarts; later callers get :worker_unavailable at once"
    )
  end

  defp kill_each_incarnation(sup, pids) do
    receive do
      {:up, %{worker: :crash_loop, os_pid: pid}} ->
        kill(pid)
        kill_each_incarnation(sup, [pid | pids])

      {:EXIT, ^sup, reason} ->
        send(self(), {:supervisor_exit, reason})
        Enum.reverse(pids)
    after
      10_000 -> flunk("the crash loop neither restarted nor ended")
    end
  end

  test "closing the port from outside ends the worker and its holder; a new one takes over" do
    worker = start_worker(:port_closed)
    %{os_pid: pid, generation: g} = Moat.Worker.info(worker)
    assert_receive {:up, %{worker: ^worker, generation: ^g}}
    [holder] = children(pid)
    Port.close(Client.conn(worker).port)

    assert_receive {:down, %{worker: ^worker, generation: ^g, reason: reason}}, 1_000
    assert reason =~ "port closed"
    eventually(fn -> not os_alive?(pid) and not os_alive?(holder) end, 1_000)
    assert_receive {:up, %{worker: ^worker, generation: g2}}, 2_000
    assert g2 == g + 1

    Reliability.record(
      :crashes,
      "port closed by another process",
      1,
      1,
      0,
      "worker and input holder exit within 1 s; next generation serves"
    )
  end

  test "stopping the application stops the worker and its holder" do
    %{os_pid: pid, generation: g} = Moat.Worker.info()
    [holder] = children(pid)
    on_exit(fn -> Application.ensure_all_started(:moat) end)

    :ok = Application.stop(:moat)
    assert_receive {:down, %{worker: Moat.Worker, generation: ^g, reason: :shutdown}}, 1_000
    eventually(fn -> not os_alive?(pid) and not os_alive?(holder) end, 1_000)

    {:ok, _} = Application.ensure_all_started(:moat)
    assert Moat.to_binary(Moat.from_binary(f32([2.0]), {1}, {:f, 32})) == f32([2.0])

    Reliability.record(
      :crashes,
      "application stopped",
      1,
      1,
      0,
      "worker and input holder exit within 1 s; restarting the application serves again"
    )
  end

  defp children(os_pid) do
    Path.wildcard("/proc/#{os_pid}/task/*/children")
    |> Enum.flat_map(&(&1 |> File.read!() |> String.split()))
  end
end

defmodule Moat.RemoteWorkerTest do
  # A worker that runs as an Erlang C-node (`moat_port --node ...
  # --supervise`) on loopback, driven by this VM (node a) through
  # `{Moat.Worker, node: ...}`, and a peer VM (node b, `:peer`) that uses it
  # through a distributed Nx.Serving on node a. The C-node's OS process is
  # killed mid-call: callers get errors, `--supervise` (the binary's own
  # supervision, standing in for systemd) starts it again, and this VM
  # reconnects as a new generation.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.Peer

  @moduletag timeout: 180_000

  setup_all do
    keeper = Peer.ensure_distributed()
    on_exit(fn -> Peer.stop_distribution(keeper) end)
  end

  defp unique(role), do: :"moat_#{role}_#{System.pid()}_#{System.unique_integer([:positive])}"

  # The C-node under --supervise, and its cookie: a file of this user only.
  defp start_cnode(extra \\ []) do
    dir = Path.join(System.tmp_dir!(), "moat_cnode_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    cookie = Base.encode32(:crypto.strong_rand_bytes(10))
    cookie_file = Path.join(dir, "cookie")
    File.write!(cookie_file, cookie)
    File.chmod!(cookie_file, 0o600)
    node = :"#{unique(:cnode)}@127.0.0.1"
    args = ["--node", "#{node}", "--cookie-file", cookie_file, "--supervise" | extra]

    port =
      Port.open({:spawn_executable, Moat.Worker.executable()}, [:binary, :exit_status, :stderr_to_stdout, args: args])

    {:os_pid, supervisor} = Port.info(port, :os_pid)

    on_exit(fn ->
      kill(supervisor, "TERM")
      File.rm_rf!(dir)
    end)

    [name, _] = String.split("#{node}", "@")
    eventually(fn -> match?({:port, _, _}, :erl_epmd.port_please(~c"#{name}", ~c"127.0.0.1")) end, 30_000)
    Node.set_cookie(node, String.to_atom(cookie))
    %{node: node, cookie: cookie, cookie_file: cookie_file, port: port, supervisor: supervisor}
  end

  defp raised(fun) do
    {:ok, fun.()}
  rescue
    e in Moat.Error -> {:raised, e.reason, e.message}
  end

  test "computes, dies mid-call, comes back as a new generation, and serves another node" do
    cnode = start_cnode()
    forward_events([[:moat, :worker, :up], [:moat, :worker, :down]])
    w = start_worker(:remote_w, node: cnode.node)
    node = cnode.node

    assert_receive {:telemetry, [:moat, :worker, :up], _, %{worker: :remote_w, generation: 1, node: ^node} = up}, 30_000
    info = Moat.Worker.info(w)
    assert %{node: ^node, shared_memory: nil, generation: 1} = info
    assert up.os_pid == info.os_pid and os_alive?(info.os_pid)

    # Small and chunked transfers both ways, and ops.
    t = Nx.tensor([1.0, 2.0, 3.0], backend: {Moat.Backend, worker: w})
    assert Nx.to_flat_list(Nx.add(t, 1)) == [2.0, 3.0, 4.0]
    big = Nx.iota({3_000_000}, type: :f32, backend: Nx.BinaryBackend)
    on_worker = Nx.backend_transfer(big, {Moat.Backend, worker: w})
    assert Nx.to_binary(on_worker) == Nx.to_binary(big)
    assert Nx.to_flat_list(Nx.slice(Nx.add(on_worker, 1), [2_999_998], [2])) == [2_999_999.0, 3_000_000.0]

    # Calls in flight when the worker's process dies get errors.
    a = Nx.iota({700, 700}, type: :f32, backend: {Moat.Backend, worker: w}) |> Nx.divide(490_000)

    slow = fn ->
      Enum.reduce(1..400, a, fn _, acc -> acc |> Nx.dot(a) |> Nx.sin() end) |> Nx.sum() |> Nx.to_number()
    end

    callers = for _ <- 1..3, do: Task.async(fn -> raised(slow) end)
    Process.sleep(300)
    assert Enum.all?(callers, &(Task.yield(&1, 0) == nil)), "the calls finished before the kill"
    kill(info.os_pid)

    for caller <- callers do
      assert {:raised, :worker_died, message} = Task.await(caller, 30_000)
      assert message =~ "#{node}"
    end

    assert_receive {:telemetry, [:moat, :worker, :down], _, %{generation: 1, node: ^node, reason: reason}}, 10_000
    assert reason =~ "went down"

    # A call made while it restarts waits for it (config :restart_wait).
    assert Nx.to_flat_list(Nx.add(Nx.tensor([1, 2], backend: {Moat.Backend, worker: w}), 1)) == [2, 3]
    assert_receive {:telemetry, [:moat, :worker, :up], _, %{generation: 2, node: ^node, os_pid: new_pid}}, 30_000
    assert new_pid != info.os_pid and os_alive?(cnode.supervisor)
    assert {:raised, :stale_generation, _} = raised(fn -> Nx.to_flat_list(t) end)

    # Node b reaches the worker through node a's distributed serving.
    {_pb, b} = Peer.start(unique(:b))
    serving = unique(:serving)
    test = self()

    {:ok, _} =
      Nx.Serving.new(fn _opts ->
        fn batch ->
          x = Nx.Defn.jit_apply(&Function.identity/1, [batch]) |> Nx.backend_transfer({Moat.Backend, worker: w})
          send(test, {:served_on, x.data.ref.worker, x.data.ref.generation})
          x |> Nx.multiply(2) |> Nx.add(1)
        end
      end)
      |> Nx.Serving.distributed_postprocessing(&Nx.backend_transfer(&1, Nx.BinaryBackend))
      |> then(&Nx.Serving.start_link(serving: &1, name: serving, batch_size: 4, batch_timeout: 20))

    true = :erpc.call(b, Node, :connect, [node()])
    eventually(fn -> Peer.call(b, Peer, :sees_serving?, [serving]) end, 10_000)

    assert Peer.call(b, Peer, :run_serving, [serving, [[1, 2], [3, 4]]]) == {{:ok, [3, 5, 7, 9]}, Nx.BinaryBackend}
    assert_received {:served_on, ^w, 2}
  end

  test "a connection with the wrong cookie, or none at all, computes nothing; the worker keeps serving" do
    cnode = start_cnode()
    w = start_worker(:remote_w2, node: cnode.node)
    t = Nx.tensor([5, 6], backend: {Moat.Backend, worker: w})

    {_pc, c} = Peer.start(unique(:c))
    true = :erpc.call(c, :erlang, :set_cookie, [cnode.node, :not_the_cookie])
    refute :erpc.call(c, :net_kernel, :connect_node, [cnode.node])
    refute cnode.node in :erpc.call(c, Node, :list, [:hidden])

    # Bytes that are no handshake at all.
    [name, _] = String.split("#{cnode.node}", "@")
    {:port, port, _} = :erl_epmd.port_please(~c"#{name}", ~c"127.0.0.1")
    {:ok, socket} = :gen_tcp.connect(~c"127.0.0.1", port, [:binary, active: false])
    :ok = :gen_tcp.send(socket, <<0, 5, ?N, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0>>)
    assert {:error, _} = :gen_tcp.recv(socket, 0, 15_000)

    assert Nx.to_flat_list(Nx.add(t, 1)) == [6, 7]
    assert Moat.Worker.info(w).generation == 1
  end

  test "a cookie file open to other users is refused before anything starts" do
    dir = Path.join(System.tmp_dir!(), "moat_cookie_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    file = Path.join(dir, "cookie")
    File.write!(file, "c00kie")
    File.chmod!(file, 0o644)

    {out, 2} =
      System.cmd(Moat.Worker.executable(), ["--node", "x@127.0.0.1", "--cookie-file", file], stderr_to_stdout: true)

    assert out =~ "owner-only"

    {out, 2} =
      System.cmd(Moat.Worker.executable(), ["--node", "x@127.0.0.1", "--cookie", "c00kie"], stderr_to_stdout: true)

    assert out =~ "unknown option --cookie"
  end
end

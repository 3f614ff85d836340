# The C-node transport beside the port, on loopback, in one run: a worker
# started as a port (shared memory off, and on: the default) and one started
# as a C-node (`moat_port --node ...`), driven by the same calls. Medians.
#
#   mix run -r bench/support.exs bench/remote.exs   (bin/bench runs it)

import Bench

{_, 0} = System.cmd("epmd", ["-daemon"])

unless Node.alive?() do
  {:ok, _} = :net_kernel.start(:"moat_bench_#{System.pid()}@127.0.0.1", %{name_domain: :longnames})
end

dir = Path.join(System.tmp_dir!(), "moat_bench_cnode_#{System.pid()}")
File.mkdir_p!(dir)
cookie = Base.encode32(:crypto.strong_rand_bytes(10))
cookie_file = Path.join(dir, "cookie")
File.write!(cookie_file, cookie)
File.chmod!(cookie_file, 0o600)
cnode = :"moat_bench_cnode_#{System.pid()}@127.0.0.1"

cnode_port =
  Port.open({:spawn_executable, Moat.Worker.executable()}, [
    :binary,
    :exit_status,
    args: ["--node", "#{cnode}", "--cookie-file", cookie_file]
  ])

{:os_pid, cnode_pid} = Port.info(cnode_port, :os_pid)
Node.set_cookie(cnode, String.to_atom(cookie))

{:ok, _} =
  Supervisor.start_link(
    [
      Supervisor.child_spec({Moat.Worker, name: :bench_pipe, shared_memory: false}, id: :pipe),
      Supervisor.child_spec({Moat.Worker, name: :bench_cnode, node: cnode}, id: :cnode)
    ],
    strategy: :one_for_one
  )

workers = [
  {"port (pipe)", :bench_pipe},
  {"port (default: shared memory)", Moat.Worker},
  {"C-node on loopback", :bench_cnode}
]

n_ops = 5_000
mib64 = f32(16 * 1024 * 1024, 1.5)

results =
  for {label, w} <- workers do
    conn = Moat.Client.conn(w)
    for _ <- 1..200, do: {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
    sync = samples(1000, fn -> {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil) end)
    small = moat(f32(4, 1.0), {4}, w)
    add_rt = samples(500, fn -> small |> Nx.add(small) |> Nx.to_binary() end)

    dispatch =
      for _ <- 1..3 do
        t0 = System.monotonic_time(:microsecond)
        last = Enum.reduce(1..n_ops, small, fn _, acc -> Nx.add(acc, small) end)
        {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
        dt = System.monotonic_time(:microsecond) - t0
        Nx.to_binary(last)
        n_ops / (dt / 1_000_000)
      end

    upload = fn ->
      ref = Moat.from_binary(mib64, {16 * 1024 * 1024}, {:f, 32}, worker: w)
      :ok = Moat.eval(ref)
      ref
    end

    big = upload.()
    up = for _ <- 1..3, do: time_us(fn -> upload.() |> Moat.deallocate() end)
    down = for _ <- 1..3, do: time_us(fn -> Moat.to_binary(big) end)
    gbs = fn us -> byte_size(mib64) / 1000 / median(us) end
    {label, median(sync), median(add_rt), median(dispatch), gbs.(up), gbs.(down)}
  end

IO.puts("### Transports on loopback (medians; 64 MiB f32, 3 reps; dispatch: a chain of #{n_ops} adds)\n")
row(["", "`:sync` round trip (µs)", "add + to_binary (µs)", "dispatch (ops/s)", "upload (GB/s)", "readback (GB/s)"])
row(["---", "---:", "---:", "---:", "---:", "---:"])

for {label, sync, add_rt, dispatch, up, down} <- results do
  row([label, fmt(sync), fmt(add_rt), "#{round(dispatch)}", fmt(up), fmt(down)])
end

System.cmd("kill", ["#{cnode_pid}"])
File.rm_rf!(dir)

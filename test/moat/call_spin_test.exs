defmodule Moat.CallSpinTest do
  # `config :moat, call_spin_us: N`: a caller waits awake, up to N µs, for
  # the pipe its worker answers on to become readable before it blocks
  # (Moat.Client, Moat.Finalizer.wait_readable/2). The pipe must be the
  # worker's, every answer must still reach its own caller, a worker's death
  # must answer callers still waiting, and the timeout must hold.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error, Finalizer}

  setup do
    Application.put_env(:moat, :call_spin_us, 200)
    on_exit(fn -> Application.delete_env(:moat, :call_spin_us) end)
  end

  # This VM's fds whose link is `target`, with their access mode (0 read,
  # 1 write).
  defp fds_of(target) do
    for fd <- File.ls!("/proc/self/fd"), File.read_link("/proc/self/fd/" <> fd) == {:ok, target} do
      [_, flags] = Regex.run(~r/^flags:\s+([0-7]+)$/m, File.read!("/proc/self/fdinfo/" <> fd))
      {String.to_integer(fd), Bitwise.band(String.to_integer(flags, 8), 3)}
    end
  end

  test "a local worker's connection knows this VM's read end of the pipe the worker answers on" do
    conn = Client.conn(Moat.Worker)
    assert is_integer(conn.reply_fd)
    {:ok, pipe} = File.read_link("/proc/#{conn.info.os_pid}/fd/4")
    assert {conn.reply_fd, 0} in fds_of(pipe)
    assert Moat.to_binary(Moat.from_binary(f32([1.0, 2.0]), {2}, {:f, 32})) == f32([1.0, 2.0])
  end

  test "wait_readable: true at once for what is readable, false after its time for what never is" do
    # A regular file is always readable.
    {:ok, file} = :file.open(__ENV__.file, [:read, :raw])

    try do
      [{fd, 0} | _] = __ENV__.file |> Path.expand() |> fds_of()
      assert Finalizer.wait_readable(fd, 200)
    after
      :file.close(file)
    end

    # The write end of the worker's input (its fd 3, `:nouse_stdio`) never is.
    {:ok, input} = File.read_link("/proc/#{Client.conn(Moat.Worker).info.os_pid}/fd/3")
    [{write_end, 1}] = Enum.filter(fds_of(input), &(elem(&1, 1) == 1))
    t0 = System.monotonic_time(:microsecond)
    refute Finalizer.wait_readable(write_end, 150)
    assert System.monotonic_time(:microsecond) - t0 >= 150

    assert_raise ArgumentError, fn -> Finalizer.wait_readable(0, 201) end
    assert_raise ArgumentError, fn -> Finalizer.wait_readable(-1, 10) end
  end

  test "many concurrent callers, each gets its own answer, in order" do
    parent = self()

    for i <- 1..16 do
      spawn_link(fn ->
        mine = for j <- 1..20, do: {j, Moat.from_binary(f32([i * 1.0, j * 1.0]), {2}, {:f, 32})}
        ok = Enum.all?(mine, fn {j, ref} -> Moat.to_binary(ref) == f32([i * 1.0, j * 1.0]) end)
        send(parent, {:done, i, ok})
      end)
    end

    for i <- 1..16, do: assert_receive({:done, ^i, true}, 30_000)
  end

  test "a worker killed while callers wait answers them all" do
    name = :call_spin_victim
    start_supervised!({Moat.Worker, name: name})
    big = Moat.from_binary(:binary.copy(f32([1.0e-3]), 512 * 512), {512, 512}, {:f, 32}, worker: name)
    conn = Client.conn(name)

    slow =
      Enum.reduce(1..120, big, fn _, acc ->
        id = Client.new_id()
        ids = Moat.Handles.ids!(conn, [acc, big], :matmul)
        Client.cast(conn, :matmul, [id], ids, %{type: {:f, 32}})
        Moat.Handles.ref(conn, id)
      end)

    parent = self()

    for i <- 1..4 do
      spawn(fn ->
        result =
          try do
            Moat.to_binary(slow)
          rescue
            e -> e
          end

        send(parent, {:done, i, result})
      end)
    end

    eventually(fn -> :ets.info(conn.table, :size) == 4 end)
    kill(Moat.Worker.info(name).os_pid)
    for i <- 1..4, do: assert_receive({:done, ^i, %Error{reason: :worker_died}}, 2_000)
  end

  # Moat.Client clamps the setting to the NIF's own bound (200 µs): the two
  # must agree, or every call would raise.
  test "a setting above the bound waits at most the bound" do
    Application.put_env(:moat, :call_spin_us, 10_000_000)
    assert Client.conn(Moat.Worker).reply_fd != nil
    t = Nx.from_binary(f32([3.0]), :f32, backend: Moat.Backend)
    assert Nx.to_binary(Nx.add(t, 1)) == f32([4.0])
  end

  test "the timeout holds" do
    name = :call_spin_slow
    start_supervised!({Moat.Worker, name: name})
    conn = Client.conn(name)
    big = Moat.from_binary(:binary.copy(f32([1.0e-3]), 512 * 512), {512, 512}, {:f, 32}, worker: name)

    slow =
      Enum.reduce(1..120, big, fn _, acc ->
        id = Client.new_id()
        Client.cast(conn, :matmul, [id], Moat.Handles.ids!(conn, [acc, big], :matmul), %{type: {:f, 32}})
        Moat.Handles.ref(conn, id)
      end)

    t0 = System.monotonic_time(:millisecond)

    assert {:error, %Error{reason: :timeout}} =
             Client.call(conn, :eval, Moat.Handles.ids!(conn, [slow], :eval), nil, 50)

    assert System.monotonic_time(:millisecond) - t0 < 1_000
  end
end

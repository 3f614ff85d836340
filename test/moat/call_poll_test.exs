defmodule Moat.CallPollTest do
  # `config :moat, call_poll_us: N`: a caller polls its mailbox before it
  # blocks (Moat.Client). Every answer must still reach its own caller, a
  # worker's death must answer callers still polling, and the timeout must
  # hold however long the poll.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error}

  setup do
    Application.put_env(:moat, :call_poll_us, 200)
    on_exit(fn -> Application.delete_env(:moat, :call_poll_us) end)
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

  test "a worker killed while callers poll answers them all" do
    # Callers poll for up to 10 s: they are still polling when it dies.
    Application.put_env(:moat, :call_poll_us, 10_000_000)
    name = :call_poll_victim
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

  test "the timeout holds while polling" do
    Application.put_env(:moat, :call_poll_us, 10_000_000)
    name = :call_poll_slow
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

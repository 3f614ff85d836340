defmodule Moat.Reliability.MalformedTest do
  # Malformed input from the Elixir side: each kind the Rust tests cover
  # (port/tests/malformed.rs, worker.rs), reached through Moat.Client, gets a
  # clear Moat.Error and the worker keeps serving. Then the other direction:
  # damaged frames from the worker never take its owner down.
  use ExUnit.Case, async: false
  import Moat.Case
  import ExUnit.CaptureLog
  import Bitwise

  alias Moat.{Client, Error, Handles, Protocol, Reliability, Transfer}

  @moduletag :capture_log

  setup do
    worker = start_worker(:"malformed_#{System.unique_integer([:positive])}", log_level: :error)
    conn = Client.conn(worker)
    one = Moat.from_binary(f32([1.0, 2.0]), {2}, {:f, 32}, worker: worker)
    %{worker: worker, conn: conn, one: one}
  end

  defp cast(conn, op, ins, attrs) do
    id = Client.new_id()
    Client.cast(conn, op, [id], Handles.ids!(conn, ins, op), attrs)
    Handles.ref(conn, id)
  end

  defp read_error(ref) do
    error = assert_raise Error, fn -> Moat.to_binary(ref) end
    assert error.reason == :op_failed
    error
  end

  defp serves(worker) do
    ref = Moat.from_binary(f32([7.0]), {1}, {:f, 32}, worker: worker)
    assert Moat.to_binary(ref) == f32([7.0])
  end

  test "unknown ops", %{worker: worker, conn: conn, one: one} do
    error = read_error(cast(conn, :frobnicate, [one], nil))
    assert {error.op, error.message} == {:frobnicate, "frobnicate: unknown op frobnicate"}

    # With no id to carry the failure, it is logged rather than lost.
    log =
      capture_log(fn ->
        Client.cast(conn, :frobnicate, [], [], nil)
        serves(worker)
      end)

    assert log =~ "refused a frame (frobnicate): unknown op frobnicate"
  end

  test "wrong arity", %{worker: worker, conn: conn, one: one} do
    error = read_error(cast(conn, :add, [one], %{type: {:f, 32}}))
    assert error.message =~ "add takes 2 inputs, got 1"
    error = read_error(cast(conn, :matmul, [one, one, one], %{type: {:f, 32}}))
    assert error.message =~ "matmul takes 2 inputs, got 3"
    serves(worker)
  end

  test "bad dtypes", %{worker: worker, conn: conn, one: one} do
    # The public API refuses them before sending anything (worker_test.exs);
    # sent anyway, the worker refuses them too.
    error = read_error(cast(conn, :astype, [one], %{type: {:f, 8}}))
    assert error.message =~ "unsupported type {:f, 8}"
    id = Client.new_id()
    Transfer.upload(conn, id, <<0::32>>, [1], {:q, 32})
    error = read_error(Handles.ref(conn, id))
    assert {error.op, error.message} == {:from_binary, "from_binary: missing or unsupported dtype"}
    serves(worker)
  end

  test "payload sizes that do not match the shape", %{worker: worker, conn: conn} do
    id = Client.new_id()
    Transfer.upload(conn, id, <<0::96>>, [4], {:f, 32})
    error = read_error(Handles.ref(conn, id))
    assert error.message =~ "bytes is 12 but the shape and dtype need 16"
    serves(worker)
  end

  test "ids that do not exist", %{worker: worker, conn: conn, one: one} do
    ghost = Handles.ref(conn, Client.new_id())
    error = read_error(ghost)
    assert error.message =~ "unknown tensor id #{ghost.id} (never defined, or released)"
    error = read_error(cast(conn, :add, [one, ghost], %{type: {:f, 32}}))
    assert error.op == :add and error.message =~ "unknown tensor id"
    # A released id is gone too.
    Client.cast(conn, :release, [], [one.id], nil)
    assert read_error(one).message =~ "unknown tensor id #{one.id}"
    serves(worker)
  end

  test "stale generations, caught by the worker when the client misses them", %{worker: worker, conn: conn, one: one} do
    stale = %{conn | generation: conn.generation + 1}
    assert {:error, %Error{reason: :stale_generation} = e} = Client.call(stale, :to_binary, [one.id], nil)
    assert e.message =~ "to_binary was sent to worker generation #{conn.generation + 1}"
    serves(worker)
  end

  test "malformed headers that carry a seq are answered to their caller", %{worker: worker, conn: conn} do
    assert {:error, %Error{reason: :op_failed, op: :sync} = e} = Client.call(conn, :sync, [0], nil)
    assert e.message =~ "ins: bad tensor id 0"
    assert {:error, %Error{op: :to_binary} = e} = Client.call(conn, :to_binary, [1, 2], nil)
    assert e.message =~ "to_binary takes one tensor id, got 2"
    serves(worker)
  end

  test "oversized frames are refused and the worker keeps serving" do
    # A client configured to send larger chunks than the worker accepts.
    worker = start_worker(:oversized, chunk_bytes: 8192, max_frame_bytes: 4096, log_level: :error)

    log =
      capture_log(fn ->
        ref = Moat.from_binary(:binary.copy(<<0>>, 6000), {1500}, {:f, 32}, worker: worker)
        error = assert_raise Error, fn -> Moat.to_binary(ref) end
        assert error.op == :protocol
        assert error.message =~ "frame of more than 4096 bytes refused"
        serves(worker)
      end)

    assert log =~ "refused a frame (protocol): frame of more than 4096 bytes refused"
  end

  test "garbage frames are refused and the worker keeps serving", %{worker: worker, conn: conn} do
    log =
      capture_log(fn ->
        for garbage <- [
              <<0, 0, 0, 3, 1, 2, 3>>,
              <<0, 0, 0, 0>>,
              <<255, 255, 255, 255>>,
              "",
              Protocol.encode_header(:nope)
            ] do
          Port.command(conn.port, garbage)
        end

        serves(worker)
      end)

    assert length(Regex.scan(~r/refused a frame \(protocol\)/, log)) == 5
  end

  test "damaged frames from the worker never take its owner down", ctx do
    fuzz_the_owner(ctx, Reliability.env_int("MOAT_FUZZ_MS", 1_000))
  end

  @tag :soak
  @tag timeout: 300_000
  test "soak: a minute of damaged frames from the worker", ctx do
    fuzz_the_owner(ctx, 60_000)
  end

  defp fuzz_the_owner(%{worker: worker, conn: conn}, budget) do
    # The worker is ours, but a memory error inside MLX could corrupt what it
    # writes before it dies: its owner must survive any frame.
    owner = conn.owner
    deadline = System.monotonic_time(:millisecond) + budget
    capture_log(fn -> send(self(), {:rounds, fuzz_owner(owner, conn.port, deadline, 0)}) end)
    assert_received {:rounds, n}
    assert Process.alive?(owner)
    assert Client.conn(worker).owner == owner
    serves(worker)

    Reliability.record(
      :malformed,
      "damaged frames sent to the worker's owner (Elixir decoder), #{div(budget, 1000)} s",
      n,
      n,
      0,
      "owner never crashed; still serving"
    )
  end

  defp fuzz_owner(owner, port, deadline, n) do
    if System.monotonic_time(:millisecond) > deadline do
      n
    else
      for _ <- 1..50, do: send(owner, {port, {:data, damaged_frame()}})
      # A round trip through the owner: it has handled them all.
      :sys.get_state(owner)
      fuzz_owner(owner, port, deadline, n + 50)
    end
  end

  @replies [
    {:ack, 64},
    {:ok, 9, %{bytes: 16, dtype: {:f, 32}, shape: [2, 2]}},
    {:ok, 3, nil},
    {:more, 9},
    {:error, 12, :matmul, %{kind: :invalid, message: "[matmul] shapes"}},
    {:error, 0, :protocol, %{kind: :protocol, message: "frame refused"}},
    {:hello, 1, %{os_pid: 1, generation: 2}}
  ]

  defp damaged_frame do
    header = Protocol.encode_header(mutate(Enum.random(@replies)))
    frame = <<byte_size(header)::32, header::binary, :crypto.strong_rand_bytes(Enum.random([0, 0, 4, 17]))::binary>>
    if Enum.random(1..2) == 1, do: flip(frame, Enum.random(1..4)), else: frame
  end

  defp mutate(term) when is_tuple(term) and tuple_size(term) > 0 do
    i = Enum.random(0..(tuple_size(term) - 1))
    if Enum.random(1..3) == 1, do: random_term(), else: put_elem(term, i, mutate(elem(term, i)))
  end

  defp mutate(term), do: if(Enum.random(1..2) == 1, do: random_term(), else: term)

  defp random_term do
    Enum.random([
      fn -> Enum.random([0, -1, 1, 64, 1 <<< 64, -(1 <<< 70), 2_147_483_648]) end,
      fn -> Enum.random(Protocol.worker_atoms()) end,
      fn -> :crypto.strong_rand_bytes(Enum.random(0..8)) end,
      fn -> {random_leaf(), random_leaf()} end,
      fn -> [random_leaf(), random_leaf()] end,
      fn -> %{random_leaf() => random_leaf()} end,
      fn -> 1.5 end
    ]).()
  end

  defp random_leaf, do: Enum.random([0, -5, :ok, "x", nil, [], {}])

  defp flip(frame, 0), do: frame

  defp flip(frame, k) do
    i = Enum.random(0..(byte_size(frame) - 1))
    <<pre::binary-size(i), b, post::binary>> = frame
    flip(<<pre::binary, bxor(b, 1 <<< Enum.random(0..7)), post::binary>>, k - 1)
  end
end

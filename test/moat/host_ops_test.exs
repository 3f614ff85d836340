defmodule Moat.HostOpsTest do
  # Moat.Backend computes exact integer ops on values made on the BEAM there
  # as well (`host`), and reads of them take no round trip. Each such op is
  # run both ways here, over the edge values of every integer type MLX has,
  # against each other type: the bytes kept on the BEAM must be the worker's,
  # bit for bit, or not kept at all. And a handle whose tensor is gone must
  # raise on a read exactly as it did with the round trip.
  use ExUnit.Case, async: false
  import Moat.Case

  @worker :host_ops_worker
  @ints for k <- [:s, :u], b <- [8, 16, 32, 64], do: {k, b}
  @ops [:add, :subtract, :multiply, :bitwise_and, :bitwise_or, :bitwise_xor, :min, :max] ++
         [:logical_and, :logical_or, :logical_xor] ++
         [:equal, :not_equal, :greater, :less, :greater_equal, :less_equal]

  setup do
    start_worker(@worker)
    :ok
  end

  defp moat(t), do: Nx.backend_transfer(t, {Moat.Backend, worker: @worker})

  # min, min + 1, -1, 0, 1, a bit pattern, max - 1, max (in range of the type).
  defp edges({:s, b}) do
    max = Bitwise.bsl(1, b - 1) - 1
    [-max - 1, -max, -1, 0, 1, 2, div(max, 3), max - 1, max]
  end

  defp edges({:u, b}) do
    max = Bitwise.bsl(1, b) - 1
    [0, 1, 2, div(max, 3), Bitwise.bsl(1, b - 1) - 1, Bitwise.bsl(1, b - 1), max - 1, max]
  end

  # The worker's bytes: the same handle read with the round trip.
  defp worker_bytes(%Nx.Tensor{} = t), do: Nx.to_binary(put_in(t.data.host, nil))

  test "every host-computed op gives the worker's bytes, for every pair of integer types" do
    kept =
      for op <- @ops, ta <- @ints, tb <- @ints, reduce: MapSet.new() do
        kept ->
          # Rows of `a` against every edge of `b` (broadcast), at most 256 bytes.
          b = moat(Nx.tensor([edges(tb)], type: tb))

          edges(ta)
          |> Enum.chunk_every(3)
          |> Enum.reduce(kept, fn rows, kept ->
            a = moat(Nx.tensor(Enum.map(rows, &[&1]), type: ta))
            check(apply(Nx, op, [a, b]), op, ta, tb, kept)
          end)
      end

    # Not vacuous: every op is kept on the BEAM for every type with itself.
    for op <- @ops, t <- @ints, do: assert({op, t, t} in kept, "#{op} on #{inspect(t)} not kept")
    # Ordering u64 against s64 (both converted to s64) is not.
    for op <- [:min, :less, :equal], do: refute({op, {:u, 64}, {:s, 64}} in kept)
  end

  test "a number operand (Nx's s32 constant) and a scalar on either side" do
    for t <- @ints, x <- edges(t), op <- [:add, :multiply, :less, :max, :bitwise_xor] do
      a = moat(Nx.tensor(x, type: t))
      check(apply(Nx, op, [a, 7]), op, t, {:s, 32}, MapSet.new())
      check(apply(Nx, op, [-3, a]), op, {:s, 32}, t, MapSet.new())
    end
  end

  defp check(result, op, ta, tb, kept) do
    worker = worker_bytes(result)

    case result.data.host do
      nil ->
        kept

      host ->
        assert host == worker,
               "#{op}(#{inspect(ta)}, #{inspect(tb)}) -> #{inspect(result.type)}: host #{inspect(host)}, " <>
                 "worker #{inspect(worker)}"

        assert Nx.to_binary(result) == worker
        MapSet.put(kept, {op, ta, tb})
    end
  end

  test "ops not provably exact stay on the worker" do
    a = moat(Nx.tensor([-128, 7, 0], type: :s8))
    b = moat(Nx.tensor([1, 2, 3], type: :s8))

    for op <- [:quotient, :remainder, :left_shift, :right_shift, :pow, :divide, :atan2] do
      assert apply(Nx, op, [a, b]).data.host == nil, "#{op} kept"
    end

    # Floats, and integers wider than the 256 bytes a handle keeps.
    assert Nx.add(moat(Nx.tensor([1.0, 2.0])), 1).data.host == nil
    wide = moat(Nx.iota({40}, type: :s64, backend: Nx.BinaryBackend))
    assert Nx.add(wide, 1).data.host == nil
  end

  test "a read of host values takes no round trip" do
    counter = Nx.add(moat(Nx.tensor(41)), 1)
    assert replies(fn -> assert Nx.to_number(Nx.less(counter, 50)) == 1 end) == 0
    assert replies(fn -> assert Nx.to_number(counter) == 42 end) == 0
    copy = Nx.backend_copy(counter, Nx.BinaryBackend)
    assert replies(fn -> assert copy.data.state == <<42::signed-native-32>> end) == 0
    assert replies(fn -> Nx.backend_transfer(Nx.add(counter, 1), Nx.BinaryBackend) end) == 0
    # The count sees a round trip when there is one.
    assert replies(fn -> assert worker_bytes(counter) == <<42::signed-native-32>> end) == 1
  end

  # The final replies ({:ok, ...} or {:error, ...}) the worker's owner sends
  # while `fun` runs.
  defp replies(fun) do
    owner = Moat.Client.conn(@worker).owner
    test = self()

    tracer =
      spawn_link(fn ->
        count = fn count, loop ->
          receive do
            {:trace, _, :send, {alias, {tag, _, _}}, _} when tag in [:ok, :error] and is_reference(alias) ->
              loop.(count + 1, loop)

            {:trace, _, _, _, _} ->
              loop.(count, loop)

            :stop ->
              send(test, {:replies, count})
          end
        end

        count.(0, count)
      end)

    :erlang.trace(owner, true, [:send, {:tracer, tracer}])
    fun.()
    :erlang.trace(owner, false, [:send])
    ref = :erlang.trace_delivered(owner)
    assert_receive {:trace_delivered, ^owner, ^ref}
    send(tracer, :stop)
    assert_receive {:replies, count}
    count
  end

  describe "a handle whose tensor is gone raises as with the round trip" do
    test "Nx.backend_deallocate/1" do
      t = Nx.add(moat(Nx.tensor([1, 2])), 1)
      assert t.data.host != nil
      Nx.backend_deallocate(t)
      error = assert_raise Moat.Error, fn -> Nx.to_binary(t) end
      assert error.reason == :deallocated
      assert_raise Moat.Error, ~r/deallocated/, fn -> Nx.backend_copy(t, Nx.BinaryBackend) end
    end

    test "a Moat.scope/1 release: of the value, and of an input" do
      {:ok, kept, input} =
        Moat.scope(fn ->
          input = moat(Nx.tensor([5, 6]))
          send(self(), {:made, input, Nx.add(input, 1)})
          {:ok, Nx.multiply(input, 2), input}
        end)

      assert_received {:made, released_input, released}
      # Kept values read (through the worker: the scope's flag is set).
      assert Nx.to_flat_list(kept) == [10, 12]
      assert Nx.to_flat_list(input) == [5, 6]
      error = assert_raise Moat.Error, fn -> Nx.to_binary(released) end
      assert error.message =~ "unknown tensor id"

      {:ok, scoped} = Moat.scope(fn -> {:ok, moat(Nx.tensor([1, 2]))} end)
      assert Nx.to_flat_list(scoped) == [1, 2]
      :ok = Moat.scope(fn -> send(self(), {:gone, moat(Nx.tensor([3, 4]))}) && :ok end)
      assert_received {:gone, gone}
      # Computed from a released input: the worker's op fails, so must the read.
      derived = Nx.add(gone, 1)
      assert_raise Moat.Error, ~r/unknown tensor id/, fn -> Nx.to_binary(derived) end
      assert_raise Moat.Error, fn -> Nx.to_binary(released_input |> Nx.add(gone)) end
    end

    test "inside an open scope the shortcut holds; nested scopes close their own" do
      Moat.scope(fn ->
        outer = Nx.add(moat(Nx.tensor(1)), 1)
        inner = Moat.scope(fn -> Nx.add(outer, 1) end)
        assert replies(fn -> assert Nx.to_number(outer) == 2 end) == 0
        # What the inner scope kept reads through the worker.
        assert replies(fn -> assert Nx.to_number(inner) == 3 end) == 1
      end)
    end

    test "a restarted worker: stale handles raise :stale_generation" do
      t = Nx.add(moat(Nx.tensor([1, 2])), 1)
      generation = Moat.Worker.info(@worker).generation
      kill(os_pid(@worker))
      await_generation_after(@worker, generation)
      error = assert_raise Moat.Error, fn -> Nx.to_binary(t) end
      assert error.reason == :stale_generation
    end

    test "a handle rebuilt without its token (binary_to_term) reads through the worker" do
      t = Nx.add(moat(Nx.tensor([1, 2])), 1)
      copy = t |> :erlang.term_to_binary() |> :erlang.binary_to_term()
      Nx.backend_deallocate(t)
      assert_raise Moat.Error, fn -> Nx.to_binary(copy) end
    end
  end
end

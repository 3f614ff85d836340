defmodule Moat.CrashGuardTest do
  # Inputs that crash MLX 0.32.4 on the CPU (measured) end as a Moat.Error
  # naming the op, or with Nx's result; the worker process and every other
  # tensor survive.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.Error

  @worker :crash_guard_worker

  setup do
    start_worker(@worker)
    survivor = moat(Nx.tensor([1.0, 2.0, 3.0]))
    %{pid: os_pid(@worker), survivor: survivor}
  end

  defp moat(t), do: Nx.backend_transfer(t, {Moat.Backend, worker: @worker})

  defp assert_survived(%{pid: pid, survivor: survivor}) do
    assert os_pid(@worker) == pid
    assert Nx.to_flat_list(survivor) == [1.0, 2.0, 3.0]
  end

  # Made in the worker: Moat.Backend keeps no BEAM copy of the values (it
  # checks small Nx.tensor/2 indices at the call, and those of exact integer
  # ops on them, such as `Nx.add(t, 0)`), so the worker's guard answers.
  # `quotient` is computed only there.
  defp computed(t) do
    indices = Nx.quotient(moat(t), 1)
    assert indices.data.host == nil
    indices
  end

  defp assert_op_fails(op, message, fun) do
    error = assert_raise Error, fn -> fun.() |> Nx.to_binary() end
    assert error.reason == :op_failed
    assert error.op == op
    assert error.message =~ message
  end

  describe "out-of-range indices (MLX: SIGSEGV far out of range, garbage slightly out)" do
    test "take", ctx do
      t = moat(Nx.iota({3, 4}))

      for index <- [3, 1_000_000_000, -1] do
        assert_op_fails(:take, "index #{index} is out of bounds for axis 0", fn ->
          Nx.take(t, moat(Nx.tensor([0, index])))
        end)
      end

      assert_survived(ctx)
    end

    test "an unsigned index beyond s64", ctx do
      t = moat(Nx.iota({3}))
      huge = moat(Nx.tensor([18_446_744_073_709_551_615], type: :u64))
      assert_op_fails(:take, "out of bounds for axis 0", fn -> Nx.take(t, huge) end)
      assert_survived(ctx)
    end

    test "gather and take_along_axis", ctx do
      t = moat(Nx.iota({3, 4}))

      assert_op_fails(:gather, "index 4 is out of bounds for axis 1", fn ->
        Nx.gather(t, computed(Nx.tensor([[2, 4]])))
      end)

      assert_op_fails(:take_along_axis, "index 9 is out of bounds for axis 1", fn ->
        Nx.take_along_axis(t, moat(Nx.tensor([[0], [9], [1]])), axis: 1)
      end)

      assert_survived(ctx)
    end

    test "indexed_add and indexed_put (scatter)", ctx do
      t = moat(Nx.iota({3, 4}))
      indices = computed(Nx.tensor([[0, 0], [2, 100_000_000]]))
      updates = moat(Nx.tensor([1, 1]))

      assert_op_fails(:indexed_add, "index 100000000 is out of bounds", fn ->
        Nx.indexed_add(t, indices, updates)
      end)

      assert_op_fails(:indexed_put, "index 100000000 is out of bounds", fn ->
        Nx.indexed_put(t, indices, updates)
      end)

      assert_op_fails(:indexed_put, "index -3 is out of bounds", fn ->
        Nx.indexed_put(t, computed(Nx.tensor([[-3, 0]])), moat(Nx.tensor([1])))
      end)

      assert_survived(ctx)
    end

    test "indices too many for the memory limit (once: SIGSEGV while checking them)", ctx do
      t = moat(Nx.iota({4}, type: :f32))
      # A limit below the 64 GiB result, wherever the worker runs (a
      # GPU's default limit, 95% of its memory, may be above it).
      Moat.set_memory_limit(8 * 1024 ** 3, @worker)
      # 2^34 indices as a broadcast: no bytes until something evaluates them.
      indices = Nx.broadcast(moat(Nx.tensor(0, type: :u8)), {131_072, 131_072})
      error = assert_raise Error, fn -> t |> Nx.take(indices) |> Nx.to_binary() end
      assert error.message =~ "memory limit exceeded"
      few = Nx.broadcast(moat(Nx.tensor(3, type: :u8)), {1000})
      assert Nx.to_flat_list(Nx.take(t, few)) == List.duplicate(3.0, 1000)
      assert_survived(ctx)
    end

    test "a failed index check poisons what depends on it, nothing else", ctx do
      t = moat(Nx.iota({3}))
      bad = Nx.take(t, moat(Nx.tensor([7])))
      downstream = Nx.take(bad, moat(Nx.tensor([0])))
      assert_op_fails(:take, "index 7", fn -> downstream end)
      assert Nx.to_flat_list(Nx.take(t, moat(Nx.tensor([2, 0])))) == [2, 0]
      assert_survived(ctx)
    end
  end

  describe "integer division (MLX: SIGFPE on MIN / -1)" do
    test "MIN / -1 and MIN rem -1 give Nx.BinaryBackend's wrapped results", ctx do
      for type <- [:s8, :s16, :s32, :s64] do
        {_, bits} = Nx.Type.normalize!(type)
        min = -(2 ** (bits - 1))
        a = Nx.tensor([min, min, 7], type: type)
        b = Nx.tensor([-1, 1, -1], type: type)
        assert Nx.to_binary(Nx.quotient(moat(a), moat(b))) == Nx.to_binary(Nx.quotient(a, b))
        assert Nx.to_binary(Nx.remainder(moat(a), moat(b))) == Nx.to_binary(Nx.remainder(a, b))
      end

      assert_survived(ctx)
    end

    test "an integer divisor of zero fails the op, as it raises in Nx.BinaryBackend", ctx do
      a = moat(Nx.tensor([1, 2], type: :s32))
      b = moat(Nx.tensor([1, 0], type: :s32))
      assert_raise ArithmeticError, fn -> Nx.quotient(Nx.tensor([1, 2]), Nx.tensor([1, 0])) end
      assert_op_fails(:quotient, "division by zero", fn -> Nx.quotient(a, b) end)
      assert_op_fails(:remainder, "division by zero", fn -> Nx.remainder(a, b) end)
      assert_survived(ctx)
    end
  end

  describe "element counts that overflow (MLX: the count wraps, kernels write past the buffer)" do
    test "a power-of-two overflow (wraps to 0) and an odd one", ctx do
      scalar = moat(Nx.tensor(1.0))

      for shape <- [{65_536, 65_536, 65_536, 65_536}, {2_000_000_000, 2_000_000_000, 5}] do
        assert_op_fails(:broadcast, "more than any address space", fn -> Nx.broadcast(scalar, shape) end)
      end

      assert_survived(ctx)
    end

    test "the check covers every op's outputs", ctx do
      # A convolution whose input dilation makes the output too large.
      input = moat(Nx.iota({1, 1, 2, 2}, type: :f32))
      kernel = moat(Nx.iota({1, 1, 1, 1}, type: :f32))
      huge = Nx.conv(input, kernel, input_dilation: [1_000_000_000, 1_000_000_000])
      assert huge.shape == {1, 1, 1_000_000_001, 1_000_000_001}
      assert_op_fails(:conv, "more than any address space", fn -> huge end)
      assert_survived(ctx)
    end
  end

  describe "debug: detect_non_finite" do
    test "off by default: NaN is a value like any other", ctx do
      nan = Nx.LinAlg.cholesky(moat(Nx.tensor([[1.0, 2.0], [2.0, 1.0]])))
      assert Nx.to_flat_list(nan) |> Enum.member?(:nan)
      assert_survived(ctx)
    end

    test "on: reading a result raises naming the op that produced NaN or infinity" do
      start_worker(:non_finite_worker, debug: [detect_non_finite: true])
      pid = os_pid(:non_finite_worker)
      on = &Nx.backend_transfer(&1, {Moat.Backend, worker: :non_finite_worker})
      fine = on.(Nx.tensor([[4.0, 2.0], [2.0, 3.0]]))

      assert_op_fails(:cholesky, "NaN or infinity", fn ->
        Nx.LinAlg.cholesky(on.(Nx.tensor([[1.0, 2.0], [2.0, 1.0]])))
      end)

      big = on.(Nx.tensor([[3.0e38]]))
      assert_op_fails(:dot, "NaN or infinity", fn -> Nx.dot(big, big) end)
      assert Nx.to_flat_list(Nx.LinAlg.cholesky(fine)) |> Enum.all?(&is_float/1)
      assert os_pid(:non_finite_worker) == pid
    end
  end
end

defmodule Moat.BackendPropertiesTest do
  # Moat.Backend against Nx.BinaryBackend on random shapes, types and values.
  # Seeded (see Moat.Gen): a failure prints the command that replays it.
  use ExUnit.Case, async: false

  import Moat.Gen

  @cases 25

  # A shape that broadcasts against `shape` (some axes 1, maybe fewer axes).
  defp broadcastable(shape) do
    dims = Tuple.to_list(shape) |> Enum.map(&if(chance(0.3), do: 1, else: &1))
    dims |> Enum.drop(int(0, length(dims))) |> List.to_tuple()
  end

  describe "element-wise unary" do
    @float_math [
      exp: {-10.0, 10.0},
      expm1: {-5.0, 5.0},
      log: {0.01, 100.0},
      log1p: {-0.9, 10.0},
      sigmoid: {-10.0, 10.0},
      cos: {-10.0, 10.0},
      sin: {-10.0, 10.0},
      tan: {-1.5, 1.5},
      cosh: {-5.0, 5.0},
      sinh: {-5.0, 5.0},
      tanh: {-5.0, 5.0},
      acos: {-1.0, 1.0},
      asin: {-1.0, 1.0},
      atan: {-10.0, 10.0},
      acosh: {1.0, 10.0},
      asinh: {-10.0, 10.0},
      atanh: {-0.9, 0.9},
      sqrt: {0.0, 100.0},
      rsqrt: {0.01, 100.0},
      cbrt: {-100.0, 100.0},
      erf: {-3.0, 3.0},
      erfc: {-3.0, 3.0},
      erf_inv: {-0.9, 0.9}
    ]

    for {name, range} <- @float_math do
      test "#{name} on floats" do
        check(unquote(name), @cases, fn ->
          type = one_of(float_types())
          t = tensor(shape(), type, range: unquote(Macro.escape(range)), specials: 0.0)
          tolerance = if unquote(name) == :erf_inv, do: erf_inv_tolerance(type), else: math_tolerance(type)
          same([t], &apply(Nx, unquote(name), [&1]), tolerance: tolerance)
        end)
      end
    end

    test "math on integers computes in f32" do
      check(:int_math, @cases, fn ->
        t = tensor(shape(), one_of(int_types()), range: {1, 9})
        for name <- [:exp, :log, :sqrt, :cbrt, :sigmoid, :atan], do: same([t], &apply(Nx, name, [&1]), label: name)
      end)
    end

    test "non-finite inputs" do
      t = Nx.tensor([:nan, :infinity, :neg_infinity, -0.0, 0.0, 1.0], backend: Nx.BinaryBackend)

      for name <- [:exp, :expm1, :sigmoid, :atan, :sqrt, :cbrt, :abs, :negate, :is_nan, :is_infinity] do
        same([t], &apply(Nx, name, [&1]), label: name)
      end
    end

    test "non-finite inputs where Nx.BinaryBackend has no answer" do
      t = Nx.tensor([:nan, :infinity, :neg_infinity, -0.0, 0.0, 1.0], backend: Moat.Backend)
      # Nx.BinaryBackend gives NaN for tanh and erf of +-inf, and 1 as the sign of NaN and -inf.
      # Nx.BinaryBackend raises on ceil, floor and round of non-finite values.
      assert Nx.to_flat_list(Nx.tanh(t)) |> Enum.take(5) == [:nan, 1.0, -1.0, -0.0, 0.0]
      assert Nx.to_flat_list(Nx.erf(t)) |> Enum.take(5) == [:nan, 1.0, -1.0, -0.0, 0.0]
      assert Nx.to_flat_list(Nx.sign(t)) == [:nan, 1.0, -1.0, -0.0, 0.0, 1.0]

      for name <- [:ceil, :floor, :round] do
        assert Nx.to_flat_list(apply(Nx, name, [t])) == [:nan, :infinity, :neg_infinity, -0.0, 0.0, 1.0]
      end
    end

    test "abs, negate, sign, ceil, floor, round, is_nan, is_infinity, real, imag, conjugate" do
      check(:unary, @cases, fn ->
        # Non-finite inputs have their own tests (sign differs on them).
        t = tensor(shape(), one_of(real_types()), specials: 0.0)

        for name <- [:abs, :negate, :sign, :ceil, :floor, :round, :is_nan, :is_infinity, :real, :imag] do
          same([t], &apply(Nx, name, [&1]), label: name)
        end

        # f64 would conjugate to c128, which MLX cannot hold.
        if t.type != {:f, 64}, do: same([t], &Nx.conjugate/1)
      end)
    end

    test "complex unary ops" do
      check(:complex_unary, @cases, fn ->
        t = tensor(shape(), {:c, 64}, specials: 0.0, range: {-3.0, 3.0})

        for name <- [:abs, :negate, :real, :imag, :conjugate, :exp, :log, :sqrt, :sin, :cos, :phase, :is_nan] do
          same([t], &apply(Nx, name, [&1]), tolerance: {1.0e-5, 1.0e-5}, label: name)
        end
      end)
    end

    test "bitwise_not" do
      check(:bitwise_not, @cases, fn ->
        same([tensor(shape(), one_of(int_types()))], &Nx.bitwise_not/1)
      end)
    end
  end

  # f64 transcendental functions are accurate to a few ulp; f32 and below
  # differ from Erlang's libm in the last bit or two.
  defp math_tolerance({:f, 64}), do: {1.0e-13, 1.0e-15}
  defp math_tolerance({:f, 32}), do: {1.0e-5, 1.0e-6}
  defp math_tolerance(type), do: tolerance(type)

  # Nx.BinaryBackend's erf_inv is an approximation good to ~3e-8.
  defp erf_inv_tolerance({:f, 64}), do: {1.0e-7, 1.0e-8}
  defp erf_inv_tolerance(type), do: math_tolerance(type)

  describe "element-wise binary" do
    for name <- [:add, :subtract, :multiply, :min, :max] do
      test "#{name} with broadcasting and mixed types" do
        check(unquote(name), @cases, fn ->
          s = shape()
          {ta, tb} = {one_of(real_types()), one_of(real_types())}
          # Operands are converted to the output type first (Nx.BinaryBackend
          # computes on exact values): integers that meet a float stay exact
          # in bf16, and a u64 never meets a signed type (they merge to s64).
          tb = if ta == {:u, 64} and elem(tb, 0) == :s, do: {:u, 32}, else: tb
          ta = if tb == {:u, 64} and elem(ta, 0) == :s, do: {:u, 32}, else: ta
          range = if Nx.Type.float?(ta) or Nx.Type.float?(tb), do: {-256, 256}
          a = tensor(s, ta, range: range)
          b = tensor(broadcastable(s), tb, range: range)
          same(Enum.shuffle([a, b]), &apply(Nx, unquote(name), [&1, &2]))
        end)
      end
    end

    test "divide and atan2" do
      check(:divide, @cases, fn ->
        s = shape()
        # Operands are converted to the (float) output type first: integers
        # stay exact in bf16.
        a = tensor(s, one_of(real_types()), range: {-256, 256})
        b = tensor(broadcastable(s), one_of(real_types()), range: {-256, 256}) |> nonzero()
        same([a, b], &Nx.divide/2)
        # Nx.BinaryBackend's atan2 of infinities disagrees with C99 (MLX).
        finite = fn t -> Nx.select(Nx.is_infinity(t), Nx.tensor(1, type: t.type, backend: Nx.BinaryBackend), t) end
        same([finite.(a), finite.(b)], &Nx.atan2/2)
      end)
    end

    test "pow" do
      check(:pow, @cases, fn ->
        s = shape()

        if chance(0.5) do
          type = one_of(int_types())
          a = tensor(s, type, range: {-5, 5})
          b = tensor(broadcastable(s), type, range: {0, 6})
          same([a, b], &Nx.pow/2)
        else
          type = one_of(float_types())
          a = tensor(s, type, range: {0.1, 4.0}, specials: 0.0)
          b = tensor(broadcastable(s), type, range: {-3.0, 3.0}, specials: 0.0)
          same([a, b], &Nx.pow/2, tolerance: math_tolerance(type))
        end
      end)
    end

    test "bitwise and shifts" do
      check(:bitwise, @cases, fn ->
        s = shape()
        type = one_of(int_types())
        {_, bits} = type
        a = tensor(s, type)
        b = tensor(broadcastable(s), type)
        for name <- [:bitwise_and, :bitwise_or, :bitwise_xor], do: same([a, b], &apply(Nx, name, [&1, &2]), label: name)
        amount = tensor(broadcastable(s), type, range: {0, bits - 1})
        same([a, amount], &Nx.left_shift/2)
        same([a, amount], &Nx.right_shift/2)
      end)
    end

    test "comparisons and logical ops in the merged type" do
      check(:compare, @cases, fn ->
        s = shape()
        a = tensor(s, one_of(real_types()), range: {-3, 3})
        b = tensor(broadcastable(s), one_of(real_types()), range: {-3, 3})

        for name <-
              [:equal, :not_equal, :greater, :less, :greater_equal, :less_equal] ++
                [:logical_and, :logical_or, :logical_xor] do
          same([a, b], &apply(Nx, name, [&1, &2]), label: name)
        end

        same([a], &Nx.logical_not/1)
      end)
    end
  end

  describe "reductions" do
    for name <- [:sum, :product, :reduce_max, :reduce_min, :all, :any] do
      test "#{name} over random axes" do
        check(unquote(name), @cases, fn ->
          s = shape()
          type = one_of(real_types())
          range = if unquote(name) == :product, do: {-2, 2}, else: nil
          t = tensor(s, type, range: range && if(Nx.Type.float?(type), do: {-2.0, 2.0}, else: range))
          opts = [axes: subset(Nx.axes(s)), keep_axes: chance(0.5)]
          same([t], &apply(Nx, unquote(name), [&1, opts]), tolerance: reduce_tolerance(type))
        end)
      end
    end

    for name <- [:argmax, :argmin] do
      test "#{name} with ties, NaN and tie_break" do
        check(unquote(name), @cases, fn ->
          s = shape(rank: 1..3)
          t = tensor(s, one_of(real_types()), range: {-2, 2})
          axis = if chance(0.3), do: nil, else: int(0, tuple_size(s) - 1)
          opts = [tie_break: one_of([:low, :high]), keep_axis: chance(0.5), type: one_of([:s32, :s64, :u8])]
          opts = if axis, do: [axis: axis] ++ opts, else: opts
          same([t], &apply(Nx, unquote(name), [&1, opts]))
        end)
      end
    end

    for name <- [:cumulative_sum, :cumulative_product, :cumulative_min, :cumulative_max] do
      test "#{name} on any axis, both directions" do
        check(unquote(name), @cases, fn ->
          s = shape(rank: 1..3)
          type = one_of(real_types())
          t = tensor(s, type, range: if(Nx.Type.float?(type), do: {-2.0, 2.0}, else: {-3, 3}))
          opts = [axis: int(0, tuple_size(s) - 1), reverse: chance(0.5)]
          t = if chance(0.3), do: Nx.transpose(t), else: t
          same([t], &apply(Nx, unquote(name), [&1, opts]), tolerance: reduce_tolerance(type))
        end)
      end
    end
  end

  defp reduce_tolerance({:f, 16}), do: {1.0e-2, 1.0e-2}
  defp reduce_tolerance({:bf, 16}), do: {5.0e-2, 5.0e-2}
  defp reduce_tolerance({:f, 32}), do: {1.0e-5, 1.0e-5}
  defp reduce_tolerance(type), do: tolerance(type)

  describe "sorting" do
    test "sort and argsort are stable, NaN above +inf" do
      check(:sort, @cases, fn ->
        s = shape(rank: 1..3, dims: 1..5)
        t = tensor(s, one_of(real_types()), range: {-3, 3})
        opts = [axis: int(0, tuple_size(s) - 1), direction: one_of([:asc, :desc])]
        same([t], &Nx.argsort(&1, opts))
        same([t], &Nx.sort(&1, opts))
      end)
    end

    test "top_k" do
      check(:top_k, @cases, fn ->
        s = shape(rank: 1..3, dims: 1..5)
        t = tensor(s, one_of(real_types()), range: {-3, 3})
        k = int(1, elem(s, tuple_size(s) - 1))
        same([t], &Nx.top_k(&1, k: k))
      end)
    end
  end

  describe "blocks" do
    test "all_close" do
      check(:all_close, @cases, fn ->
        s = shape()
        a = tensor(s, one_of(real_types()), range: {-3, 3})
        noise = tensor(s, {:f, 32}, range: {-1.0e-6, 1.0e-6}, specials: 0.0)
        b = if chance(0.5), do: Nx.add(a, noise), else: tensor(s, one_of(real_types()), range: {-3, 3})
        opts = [equal_nan: chance(0.5)]
        same([a, b], &Nx.all_close(&1, &2, opts))
      end)
    end
  end

  describe "shape and type" do
    test "as_type between every pair of types, non-finite included" do
      check(:as_type, 80, fn ->
        from = one_of(all_types())
        to = one_of(all_types())
        # Nx.BinaryBackend cannot truncate complex infinities to integers.
        specials = if from == {:c, 64} and Nx.Type.integer?(to), do: 0.0, else: 0.1
        range = if Nx.Type.float?(from), do: {-300.0, 300.0}, else: nil
        t = tensor(shape(), from, range: range, specials: specials)
        same([t], &Nx.as_type(&1, to))
      end)
    end

    test "bitcast" do
      check(:bitcast, @cases, fn ->
        {kind, bits} = from = one_of(real_types())
        to = one_of(Enum.filter(real_types(), fn {k, b} -> b == bits and {k, b} != {kind, bits} end) ++ [from])
        same([tensor(shape(), from, specials: 0.0)], &Nx.bitcast(&1, to))
      end)
    end

    test "reshape, squeeze, transpose, reverse, broadcast" do
      check(:shape_ops, @cases, fn ->
        s = shape(rank: 0..4, dims: 1..3)
        t = tensor(s, one_of(all_types()))
        same([t], &Nx.reshape(&1, {Nx.size(s)}))
        same([t], &Nx.squeeze/1)
        perm = Enum.shuffle(Nx.axes(t))
        same([t], &Nx.transpose(&1, axes: perm))
        reversed = subset(Nx.axes(s))
        same([t], &Nx.reverse(&1, axes: reversed))
        same([t], &Nx.broadcast(&1, Tuple.insert_at(s, 0, 2)))
        same([t], &(Nx.new_axis(&1, 0) |> Nx.broadcast(Tuple.insert_at(s, 0, 3), axes: Enum.to_list(0..tuple_size(s)))))
      end)
    end

    test "pad with negative and interior padding" do
      check(:pad, @cases, fn ->
        s = shape(rank: 1..3)
        t = tensor(s, one_of(real_types()))

        config =
          for d <- Tuple.to_list(s) do
            {lo, hi, i} = {int(-d, 3), int(-d, 3), int(0, 2)}
            if lo + hi + d + (d - 1) * i < 1, do: {0, 0, i}, else: {lo, hi, i}
          end

        same([t], &Nx.pad(&1, Nx.tensor(7, type: &1.type), config))
      end)
    end

    test "slice and put_slice with clamped starts and strides" do
      check(:slice, @cases, fn ->
        s = shape(rank: 1..3, dims: 1..5)
        t = tensor(s, one_of(real_types()))
        lengths = for d <- Tuple.to_list(s), do: int(1, d)
        starts = for d <- Tuple.to_list(s), do: int(0, d + 1)
        strides = for _ <- Tuple.to_list(s), do: int(1, 3)
        same([t], &Nx.slice(&1, starts, lengths, strides: strides))
        update = tensor(List.to_tuple(lengths), one_of(real_types()))
        same([t, update], &Nx.put_slice(&1, starts, &2))
      end)
    end

    test "concatenate and stack with mixed types" do
      check(:concatenate, @cases, fn ->
        s = shape(rank: 1..3, dims: 1..3)
        axis = int(0, tuple_size(s) - 1)
        ts = for _ <- 1..int(1, 3), do: tensor(put_elem(s, axis, int(1, 3)), one_of(real_types()))
        same([ts], &Nx.concatenate(&1, axis: axis))
        us = for _ <- 1..int(1, 3), do: tensor(s, one_of(real_types()))
        stack_axis = int(0, tuple_size(s))
        same([us], &Nx.stack(&1, axis: stack_axis))
      end)
    end

    test "select and clip" do
      check(:select, @cases, fn ->
        s = shape()
        pred = tensor(s, one_of(real_types()), range: {0, 1}, specials: 0.0)
        a = tensor(broadcastable(s), one_of(real_types()))
        b = tensor(broadcastable(s), one_of(real_types()))
        same([pred, a, b], &Nx.select/3)
        type = one_of(real_types())
        lo = tensor({}, type, range: {-5, 0}, specials: 0.0)
        hi = tensor({}, type, range: {0, 5}, specials: 0.0)
        same([tensor(s, type), lo, hi], &Nx.clip/3)
      end)
    end
  end

  describe "creation and conversion" do
    test "iota, eye and constants of every type" do
      check(:creation, @cases, fn ->
        s = shape(rank: 2..3)
        type = one_of(all_types())
        axis = one_of([nil | Enum.to_list(0..(tuple_size(s) - 1))])
        same([], fn -> Nx.iota(s, axis: axis, type: type) end)
        same([], fn -> Nx.eye(s, type: type) end)
        value = Nx.to_number(tensor({}, type))
        same([], fn -> Nx.broadcast(Nx.tensor(value, type: type), s) end)
        if type != {:c, 64}, do: same([], fn -> Nx.Constants.max_finite(type) end)
      end)
    end

    test "to_batched, both leftovers" do
      check(:to_batched, @cases, fn ->
        s = shape(rank: 1..3, dims: 1..5)
        t = tensor(s, one_of(all_types()))
        batch = int(1, elem(s, 0))
        leftover = one_of([:repeat, :discard])
        same([t], &Enum.to_list(Nx.to_batched(&1, batch, leftover: leftover)))
      end)
    end
  end
end

defmodule Moat.NxSuiteFixesTest do
  # What Nx's own ExUnit suite (bin/nx-suite) found on Moat, each checked
  # against Nx.BinaryBackend on a real worker.
  use ExUnit.Case, async: true
  import Moat.Case, only: [device_types: 1]

  defp moat(t), do: Nx.backend_transfer(t, Moat.Backend)
  defp host(t), do: Nx.backend_transfer(t, Nx.BinaryBackend)

  test "boolean options are falsy when nil, as in Nx" do
    a = Nx.tensor([1.0, :nan])
    assert host(Nx.all_close(moat(a), moat(a), equal_nan: nil)) == Nx.tensor(0, type: :u8)
    assert host(Nx.all_close(moat(a), moat(a), equal_nan: true)) == Nx.tensor(1, type: :u8)

    t = Nx.iota({2, 3}, type: :f32)
    assert host(Nx.sum(moat(t), axes: [1], keep_axes: nil)) == Nx.sum(t, axes: [1])
    assert host(Nx.argmax(moat(t), axis: 1, keep_axis: nil)) == Nx.argmax(t, axis: 1)
    assert host(Nx.cumulative_sum(moat(t), axis: 1, reverse: nil)) == Nx.cumulative_sum(t, axis: 1)
  end

  test "complex expm1, sigmoid and atan2 are composed in the worker; cbrt takes Nx's root" do
    z = Nx.tensor([Complex.new(:infinity, 3), Complex.new(1, 2), Complex.new(1.0e-4, -1.0e-4), Complex.new(0, 0)])

    for f <- [:expm1, :sigmoid, :cbrt] do
      expected = apply(Nx, f, [z])
      actual = host(apply(Nx, f, [moat(z)]))
      assert Nx.all_close(actual, expected, rtol: 1.0e-6, atol: 1.0e-12) == Nx.tensor(1, type: :u8), "#{f}"
    end

    assert host(Nx.expm1(moat(Nx.tensor(Complex.new(:infinity, 3))))) ==
             Nx.tensor(Complex.new(:neg_infinity, :infinity))

    assert host(Nx.cbrt(moat(Nx.tensor(Complex.new(:infinity, 3))))) == Nx.tensor(Complex.new(:infinity, 0))

    a = Nx.tensor([Complex.new(7, 0), Complex.new(-1, 0)])
    b = Nx.tensor([Complex.new(2, 0), Complex.new(0, 0)])
    assert host(Nx.atan2(moat(a), moat(b))) == Nx.atan2(a, b)

    # Nx raises for a non-zero imaginary part: at the call where the values
    # are on the BEAM (a small tensor made from BEAM data), else the op
    # fails, naming it.
    assert_raise ArithmeticError, "Complex.atan2 only accepts real numbers as arguments", fn ->
      Nx.atan2(moat(Nx.tensor([Complex.new(1, 1)])), moat(b))
    end

    computed = Nx.add(moat(Nx.tensor([Complex.new(1, 1)])), moat(b))
    bad = Nx.atan2(computed, moat(b))
    assert_raise Moat.Error, ~r/atan2.*zero imaginary part/, fn -> host(bad) end
  end

  test "indices and shift amounts made on the BEAM are checked at the call, as Nx does" do
    t = moat(Nx.tensor([[1, 2], [3, 4]]))

    for {fun, expected} <- [
          {&Nx.gather(t, moat(&1)), "index 3 is out of bounds for axis 0 in shape {2, 2}"},
          {&Nx.indexed_add(t, moat(&1), moat(Nx.tensor([1]))), "index 3 is out of bounds for axis 0 in shape {2, 2}"},
          {&Nx.indexed_put(t, moat(&1), moat(Nx.tensor([1]))), "index 3 is out of bounds for axis 0 in shape {2, 2}"}
        ] do
      assert_raise ArgumentError, expected, fn -> fun.(Nx.tensor([[3, -10]])) end
      assert_raise ArgumentError, fn -> Nx.gather(Nx.tensor([[1, 2], [3, 4]]), Nx.tensor([[3, -10]])) end
    end

    assert_raise ArgumentError, "index -1 is out of bounds for axis 1 in shape {2, 2}", fn ->
      Nx.gather(t, moat(Nx.tensor([[0, -1]])))
    end

    assert host(Nx.gather(t, moat(Nx.tensor([[1, 0]])))) == Nx.tensor([3])

    # Computed indices are checked in the worker: the error comes at readback.
    computed = Nx.as_type(Nx.add(moat(Nx.tensor([[3.0, 0.0]])), 0), :s64)
    assert_raise Moat.Error, fn -> host(Nx.gather(t, computed)) end
    # Integer arithmetic on BEAM values keeps them here (Moat.Backend's `host`).
    assert_raise ArgumentError, fn -> Nx.gather(t, Nx.add(moat(Nx.tensor([[3, 0]])), 0)) end

    one = moat(Nx.tensor(1))
    assert_raise ArgumentError, "cannot right shift by -1", fn -> Nx.right_shift(one, moat(Nx.tensor(-1))) end
    assert_raise ArgumentError, "cannot left shift by -1", fn -> Nx.left_shift(one, moat(Nx.tensor(-1))) end
    assert host(Nx.left_shift(one, moat(Nx.tensor(3)))) == Nx.tensor(8)
  end

  test "cholesky of a matrix with a zero pivot is Nx's, not NaN" do
    for type <- device_types([:f32, :f64]),
        m <- [[[25, 25], [25, 25]], [[4, 2, 2], [2, 1, 1], [2, 1, 5]], [[[25, 25], [25, 25]], [[4, 2], [2, 5]]]] do
      t = Nx.tensor(m, type: type)
      # Entries after a zero pivot are divided by Nx's eps, which amplifies
      # the rounding of their numerators.
      assert Nx.all_close(host(Nx.LinAlg.cholesky(moat(t))), Nx.LinAlg.cholesky(t), rtol: 1.0e-6) ==
               Nx.tensor(1, type: :u8)
    end

    # Past 256 rows the factor stays lazy: NaN from the first non-positive
    # pivot on (here the second), zero above the diagonal.
    l = host(Nx.LinAlg.cholesky(moat(Nx.broadcast(1.0, {300, 300}))))
    assert l[0][0] == Nx.tensor(1.0)
    assert host(Nx.all(Nx.is_nan(l[[1..299, 1..299]] |> Nx.take_diagonal()))) == Nx.tensor(1, type: :u8)
    assert l[0][1] == Nx.tensor(0.0)

    # A singular covariance no longer turns samples into NaN.
    key = Nx.Random.key(1)

    {sample, _} =
      Nx.Random.multivariate_normal(moat(key), moat(Nx.tensor([1.0, 1.0])), moat(Nx.tensor([[1.0, 1.0], [1.0, 1.0]])))

    refute host(Nx.any(Nx.is_nan(sample))) == Nx.tensor(1, type: :u8)
  end

  test "grouped convolutions in three spatial dimensions (depthwise, batch groups)" do
    x = Nx.iota({2, 4, 3, 4, 3}, type: :f32) |> Nx.divide(10)
    depthwise = Nx.iota({4, 1, 2, 2, 2}, type: :f32) |> Nx.subtract(3)
    batch_grouped = Nx.iota({4, 4, 2, 1, 2}, type: :f32) |> Nx.divide(7)

    for {kernel, opts} <- [
          {depthwise, [feature_group_size: 4, padding: :same]},
          {Nx.iota({4, 2, 1, 2, 2}, type: :f32), [feature_group_size: 2, strides: [1, 2, 1]]},
          {batch_grouped, [batch_group_size: 2, kernel_dilation: [2, 1, 1]]}
        ],
        type <- device_types([:f32, :f64]) do
      {x, kernel} = {Nx.as_type(x, type), Nx.as_type(kernel, type)}
      expected = Nx.conv(x, kernel, opts)
      actual = host(Nx.conv(moat(x), moat(kernel), opts))
      assert Nx.all_close(actual, expected, rtol: 1.0e-5) == Nx.tensor(1, type: :u8), inspect(opts)
    end
  end

  test "to_batched is a stream whose batches are made as it is consumed" do
    t = Nx.iota({5, 2})

    for leftover <- [:repeat, :discard] do
      batches = Nx.to_batched(moat(t), 2, leftover: leftover)
      assert %Stream{} = batches
      assert Enum.map(batches, &host/1) == Enum.to_list(Nx.to_batched(t, 2, leftover: leftover))
    end

    # Taking one batch makes one: a single slice frame, nothing for the rest.
    assert [first] = Nx.to_batched(moat(t), 1) |> Enum.take(1) |> Enum.map(&host/1)
    assert first == Nx.tensor([[0, 1]])
  end

  # c64 functions are Nx's formulas in f64 (Moat's nx_complex), so they give
  # Nx.BinaryBackend's values bit for bit, at infinities and NaN too.
  @specials [:infinity, :neg_infinity, :nan, 0.0, 3.0, -2.0, 1.0, 0.5]

  defp c64_grid do
    Nx.tensor(for(re <- @specials, im <- @specials, do: Complex.new(re, im)), type: :c64)
  end

  test "complex functions follow Nx.BinaryBackend at infinities, NaN and finite values" do
    z = c64_grid()

    for f <-
          [:exp, :log, :sqrt, :rsqrt, :sigmoid, :sin, :cos, :tan, :sinh, :cosh, :tanh] ++
            [:asin, :acos, :atan, :asinh, :acosh, :atanh] do
      expected = apply(Nx, f, [z])
      assert host(apply(Nx, f, [moat(z)])) == expected, "#{f}"
    end

    # The cases Nx's suite checks (Nx.NonFiniteTest), where C99 differs.
    arg = Nx.tensor(Complex.new(:infinity, 3))
    assert host(Nx.tanh(moat(arg))) == Nx.tensor(Complex.new(:nan, :nan))
    assert host(Nx.asinh(moat(arg))) == Nx.tensor(Complex.new(:infinity, :math.pi() / 4))
  end

  test "complex pow and product follow Nx.BinaryBackend" do
    z = c64_grid()
    n = Nx.size(z)
    a = Nx.tile(z, [n])
    b = z |> Nx.new_axis(1) |> Nx.tile([1, n]) |> Nx.reshape({n * n})
    assert host(Nx.pow(moat(a), moat(b))) == Nx.pow(a, b)

    # Nx folds from 1 + 0i with the textbook product: an infinite first
    # factor makes NaN (C99 recovers -inf + inf i).
    pairs = Nx.stack([a, b], axis: 1)
    assert host(Nx.product(moat(pairs), axes: [1])) == Nx.product(pairs, axes: [1])

    assert host(Nx.product(moat(Nx.tensor([Complex.new(:infinity, 3), Complex.new(-2, 4)])))) ==
             Nx.tensor(Complex.new(:nan, :nan))

    r = Nx.iota({2, 3, 5}, type: :c64) |> Nx.divide(7) |> Nx.add(Complex.new(0.5, 0.3))

    for axes <- [[0], [1, 2], [0, 2], [2]], keep <- [true, false] do
      expected = Nx.product(r, axes: axes, keep_axes: keep)
      actual = host(Nx.product(moat(r), axes: axes, keep_axes: keep))
      assert actual.shape == expected.shape
      assert Nx.all_close(actual, expected, rtol: 1.0e-6) == Nx.tensor(1, type: :u8)
    end
  end
end

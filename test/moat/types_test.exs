defmodule Moat.TypesTest do
  # The types MLX does not have (Moat.Types): f8 (E5M2), f8_e4m3fn, 2- and
  # 4-bit integers and c128, against Nx.BinaryBackend bit for bit, on
  # random shapes and values (seeded, see Moat.Gen). Tagged :f64: the
  # tests that compute f8 (in f64), hold c128 (as f64 pairs) or take every
  # type, which a GPU worker refuses (test_helper.exs skips them there).
  use ExUnit.Case, async: false

  import Moat.Gen
  import Moat.Case, only: [forward_events: 1]

  @cases 20

  setup do
    Nx.default_backend(Moat.Backend)
    :ok
  end

  # Exact: the same values (NaN matches NaN; -0.0 matches 0.0, since
  # Nx.BinaryBackend's abs, min and max keep the sign of a zero only
  # sometimes). The round trips below compare bytes.
  defp exact(inputs, fun) do
    expected = Nx.with_default_backend(Nx.BinaryBackend, fn -> apply(fun, inputs) end)
    actual = apply(fun, moat(inputs))
    assert %Moat.Backend{} = actual.data
    assert {actual.type, actual.shape} == {expected.type, expected.shape}

    assert Nx.to_flat_list(actual) == Nx.to_flat_list(expected),
           "#{inspect(actual.type)}: #{inspect(Nx.to_flat_list(expected))} expected, got " <>
             "#{inspect(Nx.to_flat_list(Nx.backend_copy(actual, Nx.BinaryBackend)))}\n" <>
             Enum.map_join(inputs, "\n", &inspect(Nx.to_flat_list(&1)))
  end

  @tag :f64
  test "every type travels to the worker and back bit for bit" do
    check(:round_trip, @cases, fn ->
      type = one_of(emulated_types())
      {_, bits} = type
      shape = shape(rank: 1..3, dims: 1..7)
      # Every bit pattern, NaN payloads included; sub-byte tensors of any size.
      binary = for _ <- 1..Tuple.product(shape), into: <<>>, do: <<:rand.uniform(Integer.pow(2, bits)) - 1::size(bits)>>

      on_binary =
        Nx.BinaryBackend.from_binary(
          %Nx.Tensor{type: type, shape: shape, names: Nx.axes(shape) |> Enum.map(fn _ -> nil end)},
          binary,
          []
        )

      t = Nx.backend_copy(on_binary, Moat.Backend)
      assert Nx.to_binary(t) == binary
      assert Nx.to_binary(Nx.backend_copy(t, Nx.BinaryBackend)) == binary
      assert Nx.to_binary(Nx.backend_transfer(Nx.backend_copy(t, Nx.BinaryBackend), Moat.Backend)) == binary
      assert Nx.to_binary(t, limit: 3) == Nx.to_binary(Nx.backend_copy(t, Nx.BinaryBackend), limit: 3)
    end)
  end

  test "the worker holds them in MLX types, as protocol.md's examples show" do
    c = Nx.tensor([Complex.new(1.0, 2.0)], type: :c128)
    assert {Moat.dtype(c.data.ref), Moat.shape(c.data.ref)} == {{:f, 64}, {1, 2}}
    assert Moat.to_binary(c.data.ref) == <<1.0::float-64-native, 2.0::float-64-native>>
    s4 = Nx.tensor([1, -2, 3], type: :s4)
    assert Nx.to_binary(s4) == <<0x1E, 3::4>>
    assert {Moat.dtype(s4.data.ref), Moat.to_binary(s4.data.ref)} == {{:s, 8}, <<1, 0xFE, 3>>}
    assert Moat.dtype(Nx.tensor([1.0], type: :f8).data.ref) == {:u, 8}
  end

  @tag :f64
  test "every f8 and f8_e4m3fn byte widens exactly and rounds back to itself" do
    for type <- f8_types() do
      bytes = Nx.from_binary(for(b <- 0..255, into: <<>>, do: <<b>>), type, backend: Nx.BinaryBackend)
      exact([bytes], &Nx.as_type(&1, :f32))
      exact([Nx.as_type(bytes, :f32)], &Nx.as_type(&1, type))
    end
  end

  @tag :f64
  test "conversions from and to every type round as Nx does" do
    check(:conversions, @cases * 3, fn ->
      {from, to} = {one_of(emulated_types() ++ all_types()), one_of(emulated_types() ++ [{:f, 32}, {:s, 64}])}
      t = tensor(shape(), from, range: one_of([{-10.0, 10.0}, {-600.0, 600.0}, {-0.05, 0.05}]), specials: 0.2)

      # Nx.BinaryBackend cannot convert complex infinities to integers.
      unless Nx.Type.complex?(from) and Nx.Type.integer?(to) do
        exact([t], &Nx.as_type(&1, to))
      end
    end)
  end

  @tag :f64
  test "e4m3fn rounds ties away from zero, saturates and caps the mantissa as Nx does" do
    values = [0.1, 1.96, 0.0155, 1000.0, -0.001, :nan, :infinity, :neg_infinity, 3.3, 0.0029296875, -0.0, 0.0]
    ties = for m <- 0..15, e <- -9..8, do: (m + 0.5) / 8 * :math.pow(2, e)

    exact(
      [Nx.tensor(values ++ ties ++ Enum.map(ties, &(-&1)), type: :f64, backend: Nx.BinaryBackend)],
      &Nx.as_type(&1, :f8_e4m3fn)
    )

    exact([Nx.tensor(values ++ ties, type: :f64, backend: Nx.BinaryBackend)], &Nx.as_type(&1, :f8))
  end

  @tag :f64
  test "arithmetic on f8 and sub-byte integers computes wide and rounds or wraps as Nx does" do
    check(:arithmetic, @cases * 2, fn ->
      type = one_of(small_int_types() ++ f8_types())
      shape = shape(rank: 1..3)
      {a, b} = {tensor(shape, type, specials: 0.05), tensor(shape, type, specials: 0.05)}

      for op <- [:add, :subtract, :multiply, :min, :max, :equal, :less, :greater_equal] do
        exact([a, b], &apply(Nx, op, [&1, &2]))
      end

      # (sign: Nx.BinaryBackend's sign of -inf is 1, see Moat.Backend's divergences.)
      for op <- [:negate, :abs, :is_nan], do: exact([a], &apply(Nx, op, [&1]))
      exact([a], &Nx.sum(&1, axes: [0]))
      exact([a], &Nx.reduce_max/1)
      exact([a, b], &Nx.select(Nx.greater(&1, &2), &1, &2))

      if elem(type, 0) in [:s, :u] do
        b = nonzero(b)
        for op <- [:quotient, :remainder, :bitwise_and, :bitwise_xor], do: exact([a, b], &apply(Nx, op, [&1, &2]))
        exact([a], &Nx.bitwise_not/1)
        exact([a], &Nx.population_count/1)
        exact([a], &Nx.left_shift(&1, Nx.tensor(1, type: type)))
        exact([a], &Nx.right_shift(&1, Nx.tensor(1, type: type)))
      else
        # Finite, nonzero divisors: Nx.BinaryBackend raises on the others.
        {a, b} = {tensor(shape, type, specials: 0.0), nonzero(tensor(shape, type, specials: 0.0))}
        exact([a, b], &Nx.divide/2)
        exact([a], &Nx.sqrt(Nx.abs(&1)))
        exact([a], &Nx.floor/1)
        # Computed in f64 like Nx.BinaryBackend, so even math rounds the same.
        for op <- [:exp, :sin, :tanh, :sigmoid, :atan, :erf], do: exact([a], &apply(Nx, op, [&1]))
        # (1 of the type: with an integer 1, Nx promotes f8_e4m3fn to f32, which is
        # plain f32 math within the f32 bounds, not the f8 path this checks.)
        exact([a], &Nx.log(Nx.add(Nx.abs(&1), Nx.tensor(1, type: type))))
        exact([a, b], &Nx.dot(Nx.flatten(&1), Nx.flatten(&2)))
      end
    end)
  end

  test "count_leading_zeros counts in the type's own bits" do
    # Nx.BinaryBackend has no count_leading_zeros below 8 bits.
    t = Nx.tensor([-1, 0, 1, 2, 7, -8], type: :s4)
    assert Nx.to_flat_list(Nx.count_leading_zeros(t)) == [0, 4, 3, 2, 1, 0]
    assert Nx.to_flat_list(Nx.count_leading_zeros(Nx.tensor([0, 1, 3], type: :u2))) == [2, 1, 0]
  end

  @tag :f64
  test "data movement keeps the stored bytes, for every type" do
    check(:movement, @cases * 2, fn ->
      type = one_of(emulated_types())
      t = tensor({3, 4}, type)
      exact([t], &Nx.reshape(&1, {4, 3}))
      exact([t], &Nx.transpose/1)
      exact([t], &Nx.reverse(&1, axes: [1]))
      exact([t], &Nx.slice(&1, [1, 1], [2, 2]))
      exact([t], &Nx.slice(&1, [Nx.tensor(1), 0], [2, 3], strides: [1, 2]))
      exact([t], &Nx.broadcast(&1, {2, 3, 4}))
      exact([t], &Nx.new_axis(&1, 1))
      exact([t, tensor({2, 4}, type)], &Nx.concatenate([&1, &2]))
      exact([t, tensor({3, 4}, type)], &Nx.stack([&1, &2], axis: 1))
      exact([t], &Nx.take(&1, Nx.tensor([2, 0]), axis: 1))
      exact([t], &Nx.pad(&1, Nx.tensor(1, type: type), [{1, 0, 1}, {0, 2, 0}]))
      exact([t], &Nx.put_slice(&1, [1, 1], Nx.tensor([[1, 0]], type: type)))
      exact([t], &(&1 |> Nx.to_batched(2) |> Enum.at(1)))
      # A predicate of the same type is read by value (-0.0 and 0 are false).
      exact([t, tensor({3, 4}, type)], &Nx.select(&1, &2, &1))
    end)
  end

  @tag :f64
  test "constants, iota and eye of every type" do
    for type <- emulated_types() do
      exact([], fn -> Nx.iota({3, 7}, type: type, axis: 1) end)
      exact([], fn -> Nx.eye(3, type: type) end)
      exact([], fn -> Nx.tensor(3, type: type) end)
      exact([], fn -> Nx.add(Nx.tensor([1, 2, 3], type: type), Nx.tensor(1, type: type)) end)
      assert Nx.to_flat_list(Nx.broadcast(Nx.tensor(1, type: type), {3})) == [1, 1, 1] or type == {:c, 128}
    end
  end

  test "inspect prints every type" do
    assert inspect(Nx.tensor([1, -2, 3], type: :s4)) =~ "[1, -2, 3]"
    assert inspect(Nx.tensor([1.5, :nan], type: :f8)) =~ "[1.5, NaN]"
    assert inspect(Nx.tensor([Complex.new(1, 2)], type: :c128)) =~ "1.0+2.0i"
  end

  @tag :f64
  test "c128 is computed on Nx.BinaryBackend, with fallback telemetry; moving it is native" do
    forward_events([[:moat, :fallback, :start]])

    check(:c128, @cases, fn ->
      # (Nx.BinaryBackend's FFTs of length 1 have no data.)
      shape = shape(rank: 1..2, dims: 2..4)
      {a, b} = {tensor(shape, {:c, 128}, specials: 0.0), tensor(shape, {:c, 128}, specials: 0.0)}
      exact([a, b], &Nx.divide/2)
      assert_receive {:telemetry, [:moat, :fallback, :start], _, %{op: :divide, input_types: [{:c, 128}, {:c, 128}]}}
      exact([a], &Nx.exp/1)
      exact([a], &Nx.sum/1)
      exact([tensor(shape, {:f, 64}, specials: 0.0)], &Nx.fft/1)
      flush_fallbacks()

      # Composed natively from f64 parts, with inputs of any type.
      other = tensor(shape, one_of([{:c, 128}, {:c, 64}, {:f, 64}, {:f, 32}, {:f, 8}, {:s, 4}]))

      for op <- [:add, :subtract, :multiply] do
        exact([a, other], &apply(Nx, op, [&1, &2]))
        exact([other, a], &apply(Nx, op, [&1, &2]))
      end

      for op <- [:negate, :conjugate, :real, :imag, :abs], do: exact([a], &apply(Nx, op, [&1]))
      exact([tensor(shape, {:c, 128}, specials: 0.3)], &Nx.abs/1)
      exact([tensor(shape, {:f, 64})], &Nx.conjugate/1)
      exact([a], &Nx.transpose/1)
      exact([a], &Nx.reshape(&1, {Nx.size(&1)}))
      exact([a, b], &Nx.concatenate([&1, &2]))
      refute_receive {:telemetry, [:moat, :fallback, :start], _, _}
    end)
  end

  @tag :f64
  test "c128 results, fallbacks included, stay on their worker" do
    other = Moat.Case.start_worker(:types_other)
    a = Nx.tensor([Complex.new(1.0, 2.0), 3.0], type: :c128, backend: {Moat.Backend, worker: other})

    for result <- [Nx.exp(a), Nx.multiply(a, a), Nx.take(a, Nx.tensor([1])), Nx.sum(a), Nx.transpose(a)] do
      assert result.data.ref.worker == other
    end

    assert Nx.to_flat_list(Nx.multiply(a, a)) == [Complex.new(-3.0, 4.0), Complex.new(9.0, 0.0)]
  end

  defp flush_fallbacks do
    receive do
      {:telemetry, [:moat, :fallback, :start], _, _} -> flush_fallbacks()
    after
      0 -> :ok
    end
  end

  @tag :f64
  test "f64 inputs to complex functions and their gradients" do
    x = Nx.tensor([1.0, 2.0, 3.0], type: :f64)
    exact([x], &Nx.conjugate/1)
    exact([x], &Nx.Defn.grad(&1, fn x -> x |> Nx.fft() |> Nx.abs() |> Nx.sum() end))
    exact([x, x], &Nx.complex/2)
  end
end

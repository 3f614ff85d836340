defmodule Moat.BackendBPropertiesTest do
  # Moat.Backend against Nx.BinaryBackend on random shapes, types and values
  # for indexing, dot/conv, linear algebra, windows, FFT and integer
  # division. Seeded: a failure prints the MOAT_SEED that reproduces it.
  use ExUnit.Case, async: false

  import Moat.GenB

  # -- indexing

  test "gather with and without axes" do
    check("gather", 30, 1_000, fn ->
      type = pick(all_types())
      shape = shape(int(1, 4))
      t = tensor(shape, type)
      axes = nonempty_axes(shape)
      idx = index_tuples(shape(int(0, 2)), Enum.map(axes, &elem(shape, &1)))
      expected = Nx.gather(t, idx, axes: axes)
      assert_same(back(Nx.gather(moat(t), moat(idx), axes: axes)), expected)
    end)
  end

  test "take and take_along_axis" do
    check("take", 30, 2_000, fn ->
      shape = shape(int(1, 3))
      t = tensor(shape, pick(all_types()))
      axis = int(0, tuple_size(shape) - 1)
      idx = indices(shape(int(0, 2)), elem(shape, axis))
      assert_same(back(Nx.take(moat(t), moat(idx), axis: axis)), Nx.take(t, idx, axis: axis))

      along = indices(put_elem(shape, axis, int(1, 4)), elem(shape, axis))
      expected = Nx.take_along_axis(t, along, axis: axis)
      assert_same(back(Nx.take_along_axis(moat(t), moat(along), axis: axis)), expected)
    end)
  end

  test "indexed_add and indexed_put, duplicates included" do
    check("indexed", 40, 3_000, fn ->
      shape = shape(int(1, 3), 1, 3)
      {target_type, updates_type} = holdable({pick(all_types()), pick(all_types())})
      target = tensor(shape, target_type)
      axes = nonempty_axes(shape)
      n = int(1, 8)
      idx = index_tuples({n}, Enum.map(axes, &elem(shape, &1)))
      rest = for {d, i} <- Enum.with_index(Tuple.to_list(shape)), i not in axes, do: d
      updates = tensor(List.to_tuple([n | rest]), updates_type)

      for op <- [:indexed_add, :indexed_put] do
        expected = apply(Nx, op, [target, idx, updates, [axes: axes]])
        actual = apply(Nx, op, [moat(target), moat(idx), moat(updates), [axes: axes]])
        assert_same(back(actual), expected)
      end
    end)
  end

  test "slice and put_slice with tensor start indices are clamped like Nx" do
    check("dynamic slice", 30, 4_000, fn ->
      shape = shape(int(1, 3))
      t = tensor(shape, pick(real_types()))
      dims = Tuple.to_list(shape)
      lengths = Enum.map(dims, &int(1, &1))
      strides = Enum.map(dims, fn _ -> int(1, 2) end)
      starts = Enum.map(dims, fn d -> start_index(int(-3, d + 3)) end)
      expected = Nx.slice(t, starts, lengths, strides: strides)
      actual = Nx.slice(moat(t), Enum.map(starts, &maybe_moat/1), lengths, strides: strides)
      assert_same(back(actual), expected)

      slice = tensor(List.to_tuple(lengths), pick(real_types()))
      expected = Nx.put_slice(t, starts, slice)
      actual = Nx.put_slice(moat(t), Enum.map(starts, &maybe_moat/1), moat(slice))
      assert_same(back(actual), expected)
    end)
  end

  # -- dot and convolution

  test "dot over any contraction and batch axes, integers wrapping exactly" do
    check("dot", 40, 5_000, fn ->
      {batch, contract, free_a, free_b} = {int(0, 1), int(0, 2), int(0, 2), int(0, 2)}
      batch_dims = Tuple.to_list(shape(batch))
      contract_dims = Tuple.to_list(shape(contract))
      {a_shape, ba, ca} = operand(batch_dims, contract_dims, Tuple.to_list(shape(free_a)))
      {b_shape, bb, cb} = operand(batch_dims, contract_dims, Tuple.to_list(shape(free_b)))
      {ta, tb} = dot_types()
      full = Nx.Type.integer?(ta) and Nx.Type.integer?(tb)
      a = tensor(a_shape, ta, full: full, exact: false)
      b = tensor(b_shape, tb, full: full, exact: false)
      expected = Nx.dot(a, ca, ba, b, cb, bb)
      assert_same(back(Nx.dot(moat(a), ca, ba, moat(b), cb, bb)), expected, rtol: 1.0e-4, atol: 1.0e-4)
    end)
  end

  test "conv with strides, padding, dilations, groups and permutations" do
    check("conv", 40, 6_000, fn ->
      spatial = int(1, 2)
      {fg, bg} = pick([{1, 1}, {2, 1}, {1, 2}])
      c = fg * int(1, 2)
      o = fg * bg * int(1, 2)

      input =
        tensor(
          List.to_tuple([bg * int(1, 2), c | Tuple.to_list(shape(spatial, 3, 6))]),
          pick([{:f, 32}, {:f, 64}, {:s, 32}])
        )

      kernel = tensor(List.to_tuple([o, div(c, fg) | Tuple.to_list(shape(spatial, 1, 3))]), {:f, 32})

      opts = [
        strides: for(_ <- 1..spatial, do: int(1, 2)),
        padding: pick([:valid, :same, for(_ <- 1..spatial, do: {int(-1, 2), int(-1, 2)})]),
        input_dilation: for(_ <- 1..spatial, do: int(1, 2)),
        kernel_dilation: for(_ <- 1..spatial, do: int(1, 2)),
        feature_group_size: fg,
        batch_group_size: bg
      ]

      opts = if bool(), do: opts, else: Keyword.merge(opts, permutations(spatial))

      case attempt(fn -> Nx.conv(input, kernel, opts) end) do
        {:ok, expected} ->
          assert_same(back(Nx.conv(moat(input), moat(kernel), opts)), expected, rtol: 1.0e-4, atol: 1.0e-4)

        :invalid ->
          :ok
      end
    end)
  end

  test "complex conv" do
    check("complex conv", 5, 6_500, fn ->
      input = Nx.complex(tensor({1, 2, 5}, {:f, 32}), tensor({1, 2, 5}, {:f, 32}))
      kernel = Nx.complex(tensor({3, 2, 2}, {:f, 32}), tensor({3, 2, 2}, {:f, 32}))

      assert_same(
        back(Nx.conv(moat(input), moat(kernel), padding: :same)),
        Nx.conv(input, kernel, padding: :same)
      )
    end)
  end

  # -- windows

  test "window reductions with strides, padding and dilations" do
    check("window", 40, 7_000, fn ->
      rank = int(1, 3)
      shape = shape(rank, 2, 5)
      t = tensor(shape, pick(all_types()))
      window = List.to_tuple(for d <- Tuple.to_list(shape), do: int(1, min(d, 3)))

      opts = [
        strides: for(_ <- 1..rank, do: int(1, 2)),
        padding: pick([:valid, :same, for(_ <- 1..rank, do: {int(-1, 2), int(-1, 2)})]),
        window_dilations: for(_ <- 1..rank, do: int(1, 2))
      ]

      for op <- [:window_sum, :window_product, :window_max, :window_min] do
        case attempt(fn -> apply(Nx, op, [t, window, opts]) end) do
          {:ok, expected} -> assert_same(back(apply(Nx, op, [moat(t), window, opts])), expected)
          :invalid -> :ok
        end
      end
    end)
  end

  test "window_scatter_max and window_scatter_min pick the last extreme position" do
    check("window scatter", 30, 8_000, fn ->
      rank = int(1, 3)
      shape = shape(rank, 2, 5)
      type = pick([{:s, 32}, {:f, 32}, {:u, 8}])
      t = tensor(shape, type)
      window = List.to_tuple(for d <- Tuple.to_list(shape), do: int(1, min(d, 3)))
      opts = [strides: for(_ <- 1..rank, do: int(1, 2)), padding: pick([:valid, :same])]
      grid = Nx.window_max(t, window, opts).shape
      source = tensor(grid, type)
      init = tensor({}, type)

      for op <- [:window_scatter_max, :window_scatter_min] do
        expected = apply(Nx, op, [t, source, init, window, opts])
        assert_same(back(apply(Nx, op, [moat(t), moat(source), moat(init), window, opts])), expected)
      end
    end)
  end

  # -- FFT

  test "fft and ifft with lengths and axes" do
    check("fft", 30, 9_000, fn ->
      shape = shape(int(1, 3), 1, 6)
      t = signal(shape)
      axis = int(0, tuple_size(shape) - 1)
      length = int(1, 8)

      for op <- [:fft, :ifft] do
        case attempt(fn -> along_axis(t, axis, &apply(Nx, op, [&1, [length: length]])) end) do
          {:ok, expected} ->
            actual = apply(Nx, op, [moat(t), [length: length, axis: axis]])
            assert_same(back(actual), expected, atol: 1.0e-4, rtol: 1.0e-4)

          :invalid ->
            :ok
        end
      end
    end)
  end

  test "fft2 and ifft2 over any two axes, irfft" do
    check("fft2 axes", 15, 10_500, fn ->
      shape = shape(3, 1, 4)
      t = signal(shape)
      [ax1, ax2] = Enum.take(Enum.shuffle(0..2), 2) |> Enum.sort()
      [l1, l2] = [int(2, 5), int(2, 5)]
      tol = [atol: 1.0e-4, rtol: 1.0e-4]

      for {op2, op} <- [fft2: :fft, ifft2: :ifft] do
        expected =
          t
          |> along_axis(ax2, &apply(Nx, op, [&1, [length: l2]]))
          |> along_axis(ax1, &apply(Nx, op, [&1, [length: l1]]))

        actual = apply(Nx, op2, [moat(t), [axes: [ax1, ax2], lengths: [l1, l2]]])
        assert_same(back(actual), expected, tol)
      end

      spectrum = Nx.rfft(tensor({int(2, 6)}, {:f, 32}, exact: false))
      length = int(2, 8)

      with {:ok, expected} <- attempt(fn -> Nx.irfft(spectrum, length: length) end) do
        assert_same(back(Nx.irfft(moat(spectrum), length: length)), expected, tol)
      end
    end)
  end

  test "fft2, ifft2 and rfft" do
    check("fft2", 20, 10_000, fn ->
      shape = shape(int(2, 3), 1, 5)
      t = signal(shape)
      lengths = [int(1, 6), int(1, 6)]
      tol = [atol: 1.0e-4, rtol: 1.0e-4]

      for op <- [:fft2, :ifft2] do
        with {:ok, expected} <- attempt(fn -> apply(Nx, op, [t, [lengths: lengths]]) end) do
          assert_same(back(apply(Nx, op, [moat(t), [lengths: lengths]])), expected, tol)
        end
      end

      real = tensor(shape, {:f, 32}, exact: false)
      length = int(1, 8)

      with {:ok, expected} <- attempt(fn -> Nx.rfft(real, length: length) end) do
        assert_same(back(Nx.rfft(moat(real), length: length)), expected, tol)
      end
    end)
  end

  # -- integer division and bit counts

  test "quotient truncates and remainder takes the dividend's sign, MIN / -1 included" do
    check("quotient", 30, 11_000, fn ->
      type = pick(int_types())
      shape = shape(int(0, 2), 1, 6)
      a = with_extremes(tensor(shape, type, full: bool()), type)
      b = tensor(shape, type, full: bool()) |> with_minus_one(type) |> nonzero()

      for op <- [:quotient, :remainder] do
        assert_same(back(apply(Nx, op, [moat(a), moat(b)])), apply(Nx, op, [a, b]))
      end
    end)
  end

  test "float remainder is C's fmod" do
    check("fmod", 20, 12_000, fn ->
      type = pick([{:f, 32}, {:f, 64}])
      a = tensor(shape(1, 1, 8), type, exact: false) |> Nx.multiply(10)
      b = a |> Nx.shape() |> tensor(type, exact: false) |> nonzero()
      assert_same(back(Nx.remainder(moat(a), moat(b))), Nx.remainder(a, b))
    end)
  end

  test "population_count and count_leading_zeros" do
    check("bits", 20, 13_000, fn ->
      t = tensor(shape(1, 1, 10), pick(int_types()), full: true)

      for op <- [:population_count, :count_leading_zeros] do
        assert_same(back(apply(Nx, op, [moat(t)])), apply(Nx, op, [t]))
      end
    end)
  end

  # -- linear algebra

  test "triangular_solve on either side, lower or upper, transposed or not" do
    check("triangular_solve", 30, 14_000, fn ->
      n = int(1, 4)
      type = pick([{:f, 32}, {:f, 64}])
      lower = bool()
      a = triangular(n, type, lower)
      left = bool()
      b = tensor(pick([{n}, if(left, do: {n, int(1, 3)}, else: {int(1, 3), n})]), type)
      opts = [left_side: left, lower: lower, transform_a: pick([:none, :transpose])]
      expected = Nx.LinAlg.triangular_solve(a, b, opts)

      assert_same(back(Nx.LinAlg.triangular_solve(moat(a), moat(b), opts)), expected,
        rtol: 1.0e-4,
        atol: 1.0e-4
      )
    end)
  end

  test "cholesky, lu, solve and determinant agree with Nx's implementations" do
    check("factorisations", 15, 15_000, fn ->
      n = int(1, 4)
      type = pick([{:f, 32}, {:f, 64}])
      m = tensor({n, n}, type, exact: false)
      spd = Nx.dot(m, [1], m, [1]) |> Nx.add(Nx.multiply(Nx.eye(n, type: type), n))
      tol = [rtol: 1.0e-3, atol: 1.0e-3]
      assert_same(back(Nx.LinAlg.cholesky(moat(spd))), Nx.LinAlg.cholesky(spd), tol)

      {p, l, u} = Nx.LinAlg.lu(m)
      {mp, ml, mu} = back(Nx.LinAlg.lu(moat(m)))
      assert_same(mp, p)
      assert_same(ml, l, tol)
      assert_same(mu, u, tol)

      b = tensor(pick([{n}, {n, 2}]), type, exact: false)
      assert_same(back(Nx.LinAlg.solve(moat(spd), moat(b))), Nx.LinAlg.solve(spd, b), tol)
      assert_same(back(Nx.LinAlg.determinant(moat(m))), Nx.LinAlg.determinant(m), tol)
    end)
  end

  test "qr (reduced and complete), eigh and svd reconstruct their input like Nx's" do
    check("decompositions", 15, 16_000, fn ->
      {m, n} = {int(1, 4), int(1, 4)}
      type = pick([{:f, 32}, {:f, 64}])
      a = tensor({m, n}, type, exact: false)
      tol = [rtol: 1.0e-3, atol: 1.0e-3]

      k = min(m, n)

      for mode <- [:reduced, :complete] do
        {q, r} = Nx.LinAlg.qr(a, mode: mode)
        {mq, mr} = back(Nx.LinAlg.qr(moat(a), mode: mode))
        assert_same(mr, r, tol)
        # Columns of q beyond k complete the basis; any orthonormal one will do.
        assert_same(Nx.slice_along_axis(mq, 0, k, axis: 1), Nx.slice_along_axis(q, 0, k, axis: 1), tol)
        assert_same(Nx.dot(mq, [0], mq, [0]), Nx.eye(elem(mq.shape, 1), type: type), tol)
        assert_same(Nx.dot(mq, mr), a, tol)
      end

      sym =
        Nx.add(
          a |> Nx.slice([0, 0], [min(m, n), min(m, n)]),
          Nx.transpose(a |> Nx.slice([0, 0], [min(m, n), min(m, n)]))
        )

      {w, _} = Nx.LinAlg.eigh(sym)
      {mw, mv} = back(Nx.LinAlg.eigh(moat(sym)))
      assert_same(mw, w, tol)
      assert_same(Nx.dot(Nx.multiply(mv, mw), [1], mv, [1]), sym, tol)

      {_, s, _} = Nx.LinAlg.svd(a)
      {mu, ms, mvt} = back(Nx.LinAlg.svd(moat(a)))
      assert_same(ms, s, tol)
      rebuilt = mu |> Nx.slice([0, 0], [m, k]) |> Nx.multiply(ms) |> Nx.dot(Nx.slice(mvt, [0, 0], [k, n]))
      assert_same(rebuilt, a, tol)
    end)
  end

  # -- helpers

  defp nonempty_axes(shape) do
    case subset(Nx.axes(shape)) do
      [] -> [int(0, tuple_size(shape) - 1)]
      axes -> axes
    end
  end

  # Index tuples of `outer ++ {length(dims)}`, each component in range.
  defp index_tuples(outer, dims) do
    type = pick([{:s, 32}, {:s, 64}, {:u, 32}])
    n = Tuple.product(outer)
    values = for _ <- 1..n//1, d <- dims, do: int(0, d - 1)

    Nx.tensor(values, type: type, backend: Nx.BinaryBackend)
    |> Nx.reshape(Tuple.insert_at(outer, tuple_size(outer), length(dims)))
  end

  defp start_index(i) do
    if bool(), do: i, else: Nx.tensor(i, type: pick([{:s, 32}, {:s, 64}]), backend: Nx.BinaryBackend)
  end

  defp maybe_moat(%Nx.Tensor{} = t), do: moat(t)
  defp maybe_moat(i), do: i

  # A shape whose batch axes come first (Nx requires it) and whose contracted
  # and free axes are interleaved at random; contracted axes listed in the
  # order of `contract_dims`, so both operands pair up.
  defp operand(batch_dims, contract_dims, free_dims) do
    tagged = Enum.with_index(contract_dims, &{{:c, &2}, &1}) ++ Enum.map(free_dims, &{:f, &1})
    all = Enum.map(batch_dims, &{:b, &1}) ++ Enum.shuffle(tagged)
    shape = all |> Enum.map(&elem(&1, 1)) |> List.to_tuple()
    positions = all |> Enum.with_index() |> Map.new(fn {{tag, _}, i} -> {tag, i} end)
    batch = Enum.to_list(0..(length(batch_dims) - 1)//1)
    contract = for j <- 0..(length(contract_dims) - 1)//1, do: Map.fetch!(positions, {:c, j})
    {shape, batch, contract}
  end

  defp dot_types do
    if bool() do
      {pick(int_types()), pick(int_types())}
    else
      holdable({pick(float_types() ++ [{:c, 64}]), pick(all_types())})
    end
  end

  # c64 with f64 merges to c128, which MLX cannot hold.
  defp holdable({{:c, 64}, {:f, 64}}), do: {{:c, 64}, {:f, 32}}
  defp holdable({{:f, 64}, {:c, 64}}), do: {{:f, 32}, {:c, 64}}
  defp holdable(types), do: types

  defp permutations(spatial) do
    rank = spatial + 2

    [
      input_permutation: Enum.shuffle(0..(rank - 1)),
      kernel_permutation: Enum.to_list(0..(rank - 1)),
      output_permutation: Enum.shuffle(0..(rank - 1))
    ]
  end

  # The expected result, or :invalid when Nx refuses the combination or
  # Nx.BinaryBackend returns fewer bytes than its shape holds (it does for
  # a last window that overhangs the padded input, and for FFTs of length 1;
  # the warnings it prints on the way are dropped).
  defp attempt(fun) do
    {result, _warnings} = ExUnit.CaptureIO.with_io(:stderr, fn -> expected(fun) end)
    result
  end

  defp expected(fun) do
    %Nx.Tensor{type: {_, bits}} = expected = fun.()
    if byte_size(Nx.to_binary(expected)) * 8 == Nx.size(expected) * bits, do: {:ok, expected}, else: :invalid
  rescue
    ArgumentError -> :invalid
    MatchError -> :invalid
  end

  # `fun` applied along `axis`: moved last and back. (Nx.BinaryBackend's fft
  # along a middle axis of a rank-3 tensor scrambles its result: it swaps the
  # axis with the last instead of moving it.)
  defp along_axis(t, axis, fun) do
    rank = tuple_size(t.shape)
    last = (Enum.to_list(0..(rank - 1)) -- [axis]) ++ [axis]
    back = Enum.map(0..(rank - 1), fn i -> Enum.find_index(last, &(&1 == i)) end)
    t |> Nx.transpose(axes: last) |> fun.() |> Nx.transpose(axes: back)
  end

  defp signal(shape) do
    if bool() do
      tensor(shape, {:f, 32}, exact: false)
    else
      Nx.complex(tensor(shape, {:f, 32}, exact: false), tensor(shape, {:f, 32}, exact: false))
    end
  end

  defp with_extremes(t, {:s, bits} = type) do
    min = -(2 ** (bits - 1))

    t
    |> Nx.to_flat_list()
    |> Enum.map(fn v -> if bool(), do: v, else: min end)
    |> Nx.tensor(type: type, backend: Nx.BinaryBackend)
    |> Nx.reshape(t.shape)
  end

  defp with_extremes(t, _type), do: t

  defp with_minus_one(t, {:s, _} = type) do
    t
    |> Nx.to_flat_list()
    |> Enum.map(fn v -> if bool(), do: v, else: -1 end)
    |> Nx.tensor(type: type, backend: Nx.BinaryBackend)
    |> Nx.reshape(t.shape)
  end

  defp with_minus_one(t, _type), do: t

  defp nonzero(t), do: Nx.select(Nx.equal(t, 0), Nx.tensor(1, type: t.type, backend: Nx.BinaryBackend), t)

  defp triangular(n, type, lower) do
    m = tensor({n, n}, type, exact: false)
    diag = Nx.multiply(Nx.eye(n, type: type, backend: Nx.BinaryBackend), 3)
    m = Nx.add(m, diag)
    if lower, do: Nx.tril(m), else: Nx.triu(m)
  end
end

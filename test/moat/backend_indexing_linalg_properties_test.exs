defmodule Moat.BackendIndexingLinalgPropertiesTest do
  # Moat.Backend against Nx.BinaryBackend on random shapes, types and values
  # for indexing, dot/conv, linear algebra, windows, FFT and integer
  # division. Seeded (see Moat.Gen): a failure prints the command that
  # replays it.
  use ExUnit.Case, async: false

  import Moat.Gen

  # Small integers and halves: exact in every type, and so are their sums.
  @exact [range: {-9, 9}, halves: 1.0, specials: 0.0]
  # Finite floats of no special form (integers within +-2).
  @inexact [range: {-2.0, 2.0}, halves: 0.0, specials: 0.0]

  # -- indexing

  test "gather with and without axes" do
    check(:gather, 30, fn ->
      shape = shape(rank: 1..4)
      t = tensor(shape, one_of(all_types()))
      axes = nonempty_axes(shape)
      idx = index_tuples(shape(rank: 0..2), Enum.map(axes, &elem(shape, &1)))
      same([t, idx], &Nx.gather(&1, &2, axes: axes))
    end)
  end

  test "take and take_along_axis" do
    check(:take, 30, fn ->
      shape = shape(rank: 1..3)
      t = tensor(shape, one_of(all_types()))
      axis = int(0, tuple_size(shape) - 1)
      idx = indices(shape(rank: 0..2), elem(shape, axis))
      same([t, idx], &Nx.take(&1, &2, axis: axis))
      along = indices(put_elem(shape, axis, int(1, 4)), elem(shape, axis))
      same([t, along], &Nx.take_along_axis(&1, &2, axis: axis))
    end)
  end

  test "indexed_add and indexed_put, duplicates included" do
    check(:indexed, 40, fn ->
      shape = shape(rank: 1..3, dims: 1..3)
      {target_type, updates_type} = holdable({one_of(all_types()), one_of(all_types())})
      axes = nonempty_axes(shape)
      n = int(1, 8)
      idx = index_tuples({n}, Enum.map(axes, &elem(shape, &1)))
      rest = for {d, i} <- Enum.with_index(Tuple.to_list(shape)), i not in axes, do: d
      updates_shape = List.to_tuple([n | rest])
      # Sums of duplicates: exact values, so the order of the additions
      # cannot show. Puts of any values.
      same(
        [tensor(shape, target_type, @exact), idx, tensor(updates_shape, updates_type, @exact)],
        &Nx.indexed_add(&1, &2, &3, axes: axes)
      )

      same(
        [tensor(shape, target_type), idx, tensor(updates_shape, updates_type)],
        &Nx.indexed_put(&1, &2, &3, axes: axes)
      )
    end)
  end

  test "slice and put_slice with tensor start indices are clamped like Nx" do
    check(:dynamic_slice, 30, fn ->
      shape = shape(rank: 1..3)
      t = tensor(shape, one_of(real_types()))
      dims = Tuple.to_list(shape)
      lengths = Enum.map(dims, &int(1, &1))
      strides = Enum.map(dims, fn _ -> int(1, 2) end)
      starts = Enum.map(dims, fn d -> start_index(int(-3, d + 3)) end)
      same([t, starts], &Nx.slice(&1, &2, lengths, strides: strides))
      slice = tensor(List.to_tuple(lengths), one_of(real_types()))
      same([t, starts, slice], &Nx.put_slice(&1, &2, &3))
    end)
  end

  # -- dot and convolution

  test "dot over any contraction and batch axes, integers wrapping exactly" do
    check(:dot, 40, fn ->
      {batch, contract, free_a, free_b} = {int(0, 1), int(0, 2), int(0, 2), int(0, 2)}
      batch_dims = Tuple.to_list(shape(rank: batch))
      contract_dims = Tuple.to_list(shape(rank: contract))
      {a_shape, ba, ca} = operand(batch_dims, contract_dims, Tuple.to_list(shape(rank: free_a)))
      {b_shape, bb, cb} = operand(batch_dims, contract_dims, Tuple.to_list(shape(rank: free_b)))
      {ta, tb} = dot_types()
      # Integers wrap when both sides are integers; beside a float they stay small.
      both_int = Nx.Type.integer?(ta) and Nx.Type.integer?(tb)

      values = fn type ->
        cond do
          both_int -> [range: :full]
          Nx.Type.integer?(type) -> @exact
          true -> @inexact
        end
      end

      a = tensor(a_shape, ta, values.(ta))
      b = tensor(b_shape, tb, values.(tb))
      same([a, b], &Nx.dot(&1, ca, ba, &2, cb, bb), tolerance: accumulated(1.0e-4))
    end)
  end

  test "conv with strides, padding, dilations, groups and permutations" do
    check(:conv, 40, fn ->
      # Three spatial axes with groups are split per group in the worker
      # (MLX groups only 1-D and 2-D convolutions).
      spatial = int(1, 3)
      {fg, bg} = one_of([{1, 1}, {2, 1}, {1, 2}])
      c = fg * int(1, 2)
      o = fg * bg * int(1, 2)
      input_shape = List.to_tuple([bg * int(1, 2), c | Tuple.to_list(shape(rank: spatial, dims: 3..6))])
      input = tensor(input_shape, one_of(wide_floats() ++ [{:s, 32}]), @exact)
      kernel_shape = List.to_tuple([o, div(c, fg) | Tuple.to_list(shape(rank: spatial, dims: 1..3))])
      kernel = tensor(kernel_shape, {:f, 32}, @exact)

      opts = [
        strides: for(_ <- 1..spatial, do: int(1, 2)),
        padding: one_of([:valid, :same, for(_ <- 1..spatial, do: {int(-1, 2), int(-1, 2)})]),
        input_dilation: for(_ <- 1..spatial, do: int(1, 2)),
        kernel_dilation: for(_ <- 1..spatial, do: int(1, 2)),
        feature_group_size: fg,
        batch_group_size: bg
      ]

      opts = if chance(0.5), do: opts, else: Keyword.merge(opts, permutations(spatial))

      with {:ok, expected} <- attempt(fn -> Nx.conv(input, kernel, opts) end) do
        assert_close(expected, Nx.conv(moat(input), moat(kernel), opts), tolerance: accumulated(1.0e-4))
      end
    end)
  end

  test "complex conv" do
    check(:complex_conv, 5, fn ->
      input = tensor({1, 2, 5}, {:c, 64}, @exact)
      kernel = tensor({3, 2, 2}, {:c, 64}, @exact)
      same([input, kernel], &Nx.conv(&1, &2, padding: :same), tolerance: accumulated())
    end)
  end

  # -- windows

  test "window reductions with strides, padding and dilations" do
    check(:window, 40, fn ->
      rank = int(1, 3)
      shape = shape(rank: rank, dims: 2..5)
      t = tensor(shape, one_of(all_types()), @exact)
      window = List.to_tuple(for d <- Tuple.to_list(shape), do: int(1, min(d, 3)))

      opts = [
        strides: for(_ <- 1..rank, do: int(1, 2)),
        padding: one_of([:valid, :same, for(_ <- 1..rank, do: {int(-1, 2), int(-1, 2)})]),
        window_dilations: for(_ <- 1..rank, do: int(1, 2))
      ]

      for op <- [:window_sum, :window_product, :window_max, :window_min] do
        with {:ok, expected} <- attempt(fn -> apply(Nx, op, [t, window, opts]) end) do
          assert_close(expected, apply(Nx, op, [moat(t), window, opts]), tolerance: accumulated())
        end
      end
    end)
  end

  test "window_scatter_max and window_scatter_min pick the last extreme position" do
    check(:window_scatter, 30, fn ->
      rank = int(1, 3)
      shape = shape(rank: rank, dims: 2..5)
      type = one_of([{:s, 32}, {:f, 32}, {:u, 8}])
      t = tensor(shape, type, @exact)
      window = List.to_tuple(for d <- Tuple.to_list(shape), do: int(1, min(d, 3)))
      opts = [strides: for(_ <- 1..rank, do: int(1, 2)), padding: one_of([:valid, :same])]
      grid = Nx.window_max(t, window, opts).shape
      source = tensor(grid, type, @exact)
      init = tensor({}, type, @exact)

      for op <- [:window_scatter_max, :window_scatter_min] do
        same([t, source, init], &apply(Nx, op, [&1, &2, &3, window, opts]), label: op)
      end
    end)
  end

  # -- FFT

  test "fft and ifft with lengths and axes" do
    check(:fft, 30, fn ->
      shape = shape(rank: 1..3, dims: 1..6)
      t = signal(shape)
      axis = int(0, tuple_size(shape) - 1)
      length = int(1, 8)

      for op <- [:fft, :ifft] do
        with {:ok, expected} <- attempt(fn -> along_axis(t, axis, &apply(Nx, op, [&1, [length: length]])) end) do
          actual = apply(Nx, op, [moat(t), [length: length, axis: axis]])
          assert_close(expected, actual, tolerance: accumulated(1.0e-4))
        end
      end
    end)
  end

  test "fft2 and ifft2 over any two axes, irfft" do
    check(:fft2_axes, 15, fn ->
      t = signal(shape(rank: 3, dims: 1..4))
      [ax1, ax2] = Enum.take(Enum.shuffle(0..2), 2) |> Enum.sort()
      [l1, l2] = [int(2, 5), int(2, 5)]

      for {op2, op} <- [fft2: :fft, ifft2: :ifft] do
        expected =
          t
          |> along_axis(ax2, &apply(Nx, op, [&1, [length: l2]]))
          |> along_axis(ax1, &apply(Nx, op, [&1, [length: l1]]))

        actual = apply(Nx, op2, [moat(t), [axes: [ax1, ax2], lengths: [l1, l2]]])
        assert_close(expected, actual, tolerance: accumulated(1.0e-4))
      end

      spectrum = Nx.rfft(tensor({int(2, 6)}, {:f, 32}, @inexact))
      length = int(2, 8)

      with {:ok, expected} <- attempt(fn -> Nx.irfft(spectrum, length: length) end) do
        assert_close(expected, Nx.irfft(moat(spectrum), length: length), tolerance: accumulated(1.0e-4))
      end
    end)
  end

  test "fft2, ifft2 and rfft" do
    check(:fft2, 20, fn ->
      shape = shape(rank: 2..3, dims: 1..5)
      t = signal(shape)
      lengths = [int(1, 6), int(1, 6)]

      for op <- [:fft2, :ifft2] do
        with {:ok, expected} <- attempt(fn -> apply(Nx, op, [t, [lengths: lengths]]) end) do
          assert_close(expected, apply(Nx, op, [moat(t), [lengths: lengths]]), tolerance: accumulated(1.0e-4))
        end
      end

      real = tensor(shape, {:f, 32}, @inexact)
      length = int(1, 8)

      with {:ok, expected} <- attempt(fn -> Nx.rfft(real, length: length) end) do
        assert_close(expected, Nx.rfft(moat(real), length: length), tolerance: accumulated(1.0e-4))
      end
    end)
  end

  # -- integer division and bit counts

  test "quotient truncates and remainder takes the dividend's sign, MIN / -1 included" do
    check(:quotient, 30, fn ->
      type = one_of(int_types())
      shape = shape(rank: 0..2, dims: 1..6)
      a = with_extremes(tensor(shape, type), type)
      b = tensor(shape, type) |> with_minus_one(type) |> nonzero()
      same([a, b], &Nx.quotient/2)
      same([a, b], &Nx.remainder/2)
    end)
  end

  test "float remainder is C's fmod" do
    check(:fmod, 20, fn ->
      type = one_of(wide_floats())
      a = tensor(shape(rank: 1, dims: 1..8), type, @inexact) |> Nx.multiply(10)
      b = a |> Nx.shape() |> tensor(type, @inexact) |> nonzero()
      same([a, b], &Nx.remainder/2)
    end)
  end

  test "population_count and count_leading_zeros" do
    check(:bits, 20, fn ->
      t = tensor(shape(rank: 1, dims: 1..10), one_of(int_types()), range: :full)
      same([t], &Nx.population_count/1)
      same([t], &Nx.count_leading_zeros/1)
    end)
  end

  # -- linear algebra

  test "triangular_solve on either side, lower or upper, transposed or not" do
    check(:triangular_solve, 30, fn ->
      n = int(1, 4)
      type = one_of(wide_floats())
      lower = chance(0.5)
      a = triangular(n, type, lower)
      left = chance(0.5)
      b = tensor(one_of([{n}, if(left, do: {n, int(1, 3)}, else: {int(1, 3), n})]), type, @exact)
      opts = [left_side: left, lower: lower, transform_a: one_of([:none, :transpose])]
      same([a, b], &Nx.LinAlg.triangular_solve(&1, &2, opts), tolerance: accumulated(1.0e-4))
    end)
  end

  test "cholesky, lu, solve and determinant agree with Nx's implementations" do
    check(:factorisations, 15, fn ->
      n = int(1, 4)
      type = one_of(wide_floats())
      m = tensor({n, n}, type, @inexact)
      spd = Nx.dot(m, [1], m, [1]) |> Nx.add(Nx.multiply(Nx.eye(n, type: type), n))
      tol = accumulated(1.0e-3)
      same([spd], &Nx.LinAlg.cholesky/1, tolerance: tol)

      {p, l, u} = Nx.LinAlg.lu(m)
      {mp, ml, mu} = Nx.LinAlg.lu(moat(m))
      assert_close(p, mp)
      assert_close({l, u}, {ml, mu}, tolerance: tol)

      b = tensor(one_of([{n}, {n, 2}]), type, @inexact)
      same([spd, b], &Nx.LinAlg.solve/2, tolerance: tol)
      same([m], &Nx.LinAlg.determinant/1, tolerance: tol)
    end)
  end

  test "qr (reduced and complete), eigh and svd reconstruct their input like Nx's" do
    check(:decompositions, 15, fn ->
      {m, n} = {int(1, 4), int(1, 4)}
      type = one_of(wide_floats())
      a = tensor({m, n}, type, @inexact)
      tol = [tolerance: accumulated(1.0e-3)]
      k = min(m, n)

      for mode <- [:reduced, :complete] do
        {q, r} = Nx.LinAlg.qr(a, mode: mode)
        {mq, mr} = back(Nx.LinAlg.qr(moat(a), mode: mode))
        assert_close(r, mr, tol)
        # Columns of q beyond k complete the basis; any orthonormal one will do.
        assert_close(Nx.slice_along_axis(q, 0, k, axis: 1), Nx.slice_along_axis(mq, 0, k, axis: 1), tol)
        assert_close(Nx.eye(elem(mq.shape, 1), type: type), Nx.dot(mq, [0], mq, [0]), tol)
        assert_close(a, Nx.dot(mq, mr), tol)
      end

      square = Nx.slice(a, [0, 0], [k, k])
      sym = Nx.add(square, Nx.transpose(square))
      {w, _} = Nx.LinAlg.eigh(sym)
      {mw, mv} = back(Nx.LinAlg.eigh(moat(sym)))
      assert_close(w, mw, tol)
      assert_close(sym, Nx.dot(Nx.multiply(mv, mw), [1], mv, [1]), tol)

      {_, s, _} = Nx.LinAlg.svd(a)
      {mu, ms, mvt} = back(Nx.LinAlg.svd(moat(a)))
      assert_close(s, ms, tol)
      rebuilt = mu |> Nx.slice([0, 0], [m, k]) |> Nx.multiply(ms) |> Nx.dot(Nx.slice(mvt, [0, 0], [k, n]))
      assert_close(a, rebuilt, tol)
    end)
  end

  # -- helpers

  # Sums and products (windows, dots, convolutions, FFTs, factorisations)
  # round differently from Nx's: half floats within a few of their ulps,
  # other floats within `tol` (default: f64 1.0e-12, others 1.0e-5).
  defp accumulated(tol \\ nil) do
    fn
      {:f, 16} -> {1.0e-2, 1.0e-2}
      {:bf, 16} -> {3.0e-2, 3.0e-2}
      {:f, 64} -> {tol || 1.0e-12, tol || 1.0e-12}
      _ -> {tol || 1.0e-5, tol || 1.0e-5}
    end
  end

  # Results read back onto Nx.BinaryBackend, to check them there.
  defp back(tuple) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> Enum.map(&back/1) |> List.to_tuple()
  defp back(%Nx.Tensor{} = t), do: Nx.backend_transfer(t, Nx.BinaryBackend)

  defp nonempty_axes(shape) do
    case subset(Nx.axes(shape)) do
      [] -> [int(0, tuple_size(shape) - 1)]
      axes -> axes
    end
  end

  # Index tuples of `outer ++ {length(dims)}`, each component in range.
  defp index_tuples(outer, dims) do
    type = one_of([{:s, 32}, {:s, 64}, {:u, 32}])
    n = Tuple.product(outer)
    values = for _ <- 1..n//1, d <- dims, do: int(0, d - 1)

    Nx.tensor(values, type: type, backend: Nx.BinaryBackend)
    |> Nx.reshape(Tuple.insert_at(outer, tuple_size(outer), length(dims)))
  end

  defp start_index(i) do
    if chance(0.5), do: i, else: Nx.tensor(i, type: one_of([{:s, 32}, {:s, 64}]), backend: Nx.BinaryBackend)
  end

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
    if chance(0.5) do
      {one_of(int_types()), one_of(int_types())}
    else
      holdable({one_of(float_types() ++ [{:c, 64}]), one_of(all_types())})
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

  defp signal(shape), do: tensor(shape, one_of([{:f, 32}, {:c, 64}]), @inexact)

  defp with_extremes(t, {:s, bits} = type) do
    min = -(2 ** (bits - 1))

    t
    |> Nx.to_flat_list()
    |> Enum.map(fn v -> if chance(0.5), do: v, else: min end)
    |> Nx.tensor(type: type, backend: Nx.BinaryBackend)
    |> Nx.reshape(t.shape)
  end

  defp with_extremes(t, _type), do: t

  defp with_minus_one(t, {:s, _} = type) do
    t
    |> Nx.to_flat_list()
    |> Enum.map(fn v -> if chance(0.5), do: v, else: -1 end)
    |> Nx.tensor(type: type, backend: Nx.BinaryBackend)
    |> Nx.reshape(t.shape)
  end

  defp with_minus_one(t, _type), do: t

  defp triangular(n, type, lower) do
    m = tensor({n, n}, type, @inexact)
    diag = Nx.multiply(Nx.eye(n, type: type, backend: Nx.BinaryBackend), 3)
    m = Nx.add(m, diag)
    if lower, do: Nx.tril(m), else: Nx.triu(m)
  end
end

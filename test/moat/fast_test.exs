defmodule Moat.FastTest do
  # Each fused kernel (one mlx::core::fast call in a real worker) against its
  # reference composition run on Nx.BinaryBackend, per type.
  use ExUnit.Case, async: true

  alias Moat.Fast

  # Tolerances (atol = rtol) of the fused kernel against the reference on
  # unit-normal data. f16 and bf16 are both computed in f32 and rounded once;
  # bf16 keeps 8 bits of mantissa, so a product or sum of rounded values
  # can differ by a few of its ulps (2^-8 relative).
  @tolerance %{{:f, 32} => 1.0e-5, {:f, 16} => 4.0e-3, {:bf, 16} => 3.0e-2, {:f, 64} => 1.0e-12}
  @types [{:f, 32}, {:f, 16}, {:bf, 16}]

  defp random(seed, shape, type \\ {:f, 32}) do
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape, type: {:f, 32})
    Nx.as_type(t, type)
  end

  defp moat(t), do: Nx.backend_transfer(t, Moat.Backend)

  # `fun` on Moat (the fused kernel) and on Nx.BinaryBackend (the reference).
  defp assert_fused(fun, args, type) do
    fused = apply(fun, Enum.map(args, &moat/1))
    reference = apply(fun, args)
    assert fused.data.__struct__ == Moat.Backend
    assert fused.type == type and fused.shape == reference.shape
    tol = Map.fetch!(@tolerance, type)
    fused = Nx.backend_transfer(fused, Nx.BinaryBackend)
    assert_all_close!(fused, reference, tol)
  end

  defp assert_all_close!(a, b, tol) do
    a = Nx.as_type(a, {:f, 64})
    b = Nx.as_type(b, {:f, 64})
    worst = a |> Nx.subtract(b) |> Nx.abs() |> Nx.subtract(Nx.multiply(Nx.abs(b), tol)) |> Nx.reduce_max()
    assert Nx.to_number(worst) <= tol, "differ by more than #{tol} (atol and rtol): #{inspect(Nx.to_number(worst))}"
  end

  describe "fused kernels against the reference" do
    for type <- @types do
      @type_ type

      test "rms_norm #{inspect(type)}" do
        x = random(1, {2, 3, 64}, @type_)
        w = random(2, {64}, @type_)
        assert_fused(&Fast.rms_norm(&1, &2, eps: 1.0e-6), [x, w], @type_)
      end

      test "layer_norm with and without bias #{inspect(type)}" do
        x = Nx.add(random(1, {2, 3, 64}, @type_), 3)
        w = random(2, {64}, @type_)
        b = random(3, {64}, @type_)
        assert_fused(&Fast.layer_norm(&1, &2, &3, eps: 1.0e-5), [x, w, b], @type_)
        assert_fused(&Fast.layer_norm(&1, &2, nil), [x, w], @type_)
      end

      test "rope, split-half and traditional, partial dims, offsets #{inspect(type)}" do
        x = random(4, {2, 3, 5, 16}, @type_)

        for traditional <- [false, true], dims <- [16, 8], seq_axis <- [-2, 1], offset <- [0, 7] do
          opts = [traditional: traditional, offset: offset, seq_axis: seq_axis, base: 500.0, scale: 0.5]
          assert_fused(&Fast.rope(&1, dims, opts), [x], @type_)
        end

        # Offsets as tensors: one for all, or one start per batch.
        for offsets <- [Nx.tensor(4), Nx.tensor([3, 11], type: {:u, 8})], seq_axis <- [-2, 1] do
          fun = &Fast.rope(&1, 16, offset: &2, seq_axis: seq_axis, traditional: seq_axis == 1)
          assert_fused(fun, [x, offsets], @type_)
        end

        assert_fused(
          &Fast.rope(&1, 8, offset: &2, freqs: Nx.tensor([1.0, 2.0, 5.0, 50.0])),
          [x, Nx.tensor([1, 2])],
          @type_
        )

        freqs = Nx.tensor([1.0, 2.0, 5.0, 50.0])
        assert_fused(&Fast.rope(&1, 8, freqs: freqs, offset: 3), [x], @type_)
        assert_fused(&Fast.rope(&1, 16, offset: 2), [Nx.reshape(x, {30, 16})], @type_)
      end

      test "scaled_dot_product_attention, grouped-query heads #{inspect(type)}" do
        q = random(5, {2, 4, 3, 16}, @type_)
        k = random(6, {2, 2, 7, 16}, @type_)
        v = random(7, {2, 2, 7, 8}, @type_)
        boolean = Nx.greater(Nx.iota({2, 1, 3, 7}), 4)
        additive = Nx.multiply(Nx.iota({4, 1, 7}, type: {:f, 32}), -0.25)

        for opts <- [[], [scale: 0.2], [mask: :causal], [mask: boolean], [mask: additive, scale: 0.5]] do
          assert_fused(&Fast.scaled_dot_product_attention(&1, &2, &3, opts), [q, k, v], @type_)
        end

        # A decode step: one query against the whole prefix, causal.
        q1 = random(8, {2, 4, 1, 16}, @type_)
        assert_fused(&Fast.scaled_dot_product_attention(&1, &2, &3, mask: :causal), [q1, k, v], @type_)
      end
    end

    for type <- @types do
      @type_ type
      test "attention over a valid prefix: lengths, starts, causal, sinks #{inspect(type)}" do
        q = random(9, {3, 4, 2, 16}, @type_)
        k = random(10, {3, 2, 9, 16}, @type_)
        v = random(11, {3, 2, 9, 8}, @type_)
        lengths = Nx.tensor([9, 5, 2])
        starts = Nx.tensor([0, 1, 0])
        sinks = Nx.tensor([0.5, -1.0, 2.0, 0.0])

        for opts <- [
              [lengths: lengths],
              [lengths: lengths, mask: :causal],
              [lengths: Nx.tensor(6), starts: starts, mask: :causal],
              [starts: starts],
              [sinks: sinks],
              [sinks: sinks, lengths: lengths, starts: starts, mask: :causal, scale: 0.3],
              [lengths: lengths, mask: Nx.greater(Nx.iota({3, 1, 2, 9}), 1)]
            ] do
          assert_fused(&Fast.scaled_dot_product_attention(&1, &2, &3, opts), [q, k, v], @type_)
        end
      end
    end

    # Several of the kernel's 64-key blocks: the running max, sum and
    # accumulator are rescaled as later blocks bring larger scores (q is
    # scaled up for a peaked softmax, the keys ramp up along the prefix).
    test "attention over more keys than one block, on every kernel set" do
      for set <- [:auto, :avx2, :scalar] do
        name = :"fast_blocks_#{set}_#{System.unique_integer([:positive])}"
        start_supervised!({Moat.Worker, name: name, cpu_kernels: set}, id: name)
        on = &Nx.backend_copy(&1, {Moat.Backend, worker: name})

        for type <- @types do
          ramp = Nx.iota({1, 1, 300, 1}, type: {:f, 32}) |> Nx.divide(100)
          q = random(20, {2, 6, 3, 32}) |> Nx.multiply(3) |> Nx.as_type(type)
          k = random(21, {2, 2, 300, 32}) |> Nx.add(ramp) |> Nx.as_type(type)
          v = random(22, {2, 2, 300, 24}, type)

          for opts <- [
                [mask: :causal],
                [lengths: Nx.tensor([300, 131]), starts: Nx.tensor([0, 70]), mask: :causal, sinks: random(23, {6})],
                [lengths: Nx.tensor(64), scale: 0.05]
              ] do
            fused =
              Fast.scaled_dot_product_attention(
                on.(q),
                on.(k),
                on.(v),
                Enum.map(opts, fn {o, t} -> {o, if(is_struct(t), do: on.(t), else: t)} end)
              )

            reference = Fast.scaled_dot_product_attention(q, k, v, opts)
            assert_all_close!(Nx.backend_transfer(fused, Nx.BinaryBackend), reference, Map.fetch!(@tolerance, type))
          end
        end
      end
    end

    test "attention's one-pass kernel agrees across kernel sets (scalar forced)" do
      name = :"fast_scalar_#{System.unique_integer([:positive])}"
      start_supervised!({Moat.Worker, name: name, cpu_kernels: :scalar}, id: name)
      on = &Nx.backend_copy(&1, {Moat.Backend, worker: name})

      for type <- @types do
        {q, k, v} =
          {random(12, {2, 8, 1, 40}, type), random(13, {2, 2, 33, 40}, type), random(14, {2, 2, 33, 24}, type)}

        {x, w} = {random(15, {3, 70}, type), random(16, {70}, type)}
        opts = [lengths: Nx.tensor([33, 20]), starts: Nx.tensor([3, 0]), mask: :causal, sinks: random(17, {8})]
        tol = Map.fetch!(@tolerance, type)
        reference = Fast.scaled_dot_product_attention(q, k, v, opts)

        scalar =
          Fast.scaled_dot_product_attention(
            on.(q),
            on.(k),
            on.(v),
            Enum.map(opts, fn {o, t} -> {o, if(is_struct(t), do: on.(t), else: t)} end)
          )

        assert_all_close!(Nx.backend_transfer(scalar, Nx.BinaryBackend), reference, tol)

        assert_all_close!(
          Nx.backend_transfer(Fast.rms_norm(on.(x), on.(w)), Nx.BinaryBackend),
          Fast.rms_norm(x, w),
          tol
        )
      end
    end

    @tag :f64
    test "f64 takes the reference composition on Moat (MLX's kernels compute it in f32)" do
      x = random(1, {2, 8}, {:f, 64})
      w = random(2, {8}, {:f, 64})
      assert_fused(&Fast.rms_norm/2, [x, w], {:f, 64})
      assert_fused(&Fast.layer_norm(&1, &2, nil), [x, w], {:f, 64})
    end
  end

  test "Moat.Backend runs each kernel, not the reference" do
    {bx, bw} = {random(1, {1, 2, 3, 8}), random(2, {8})}
    {x, w} = {moat(bx), moat(bw)}
    t = Nx.template({1, 2, 3, 8}, {:f, 32})
    no = fn -> flunk("the reference composition ran on Moat") end

    refs = %{
      2 => fn _, _ -> no.() end,
      3 => fn _, _, _ -> no.() end,
      4 => fn _, _, _, _ -> no.() end
    }

    for {struct, args, expected} <- [
          {%Fast.RMSNorm{}, [x, w], Fast.rms_norm(bx, bw)},
          {%Fast.LayerNorm{}, [x, w, w], Fast.layer_norm(bx, bw, bw)},
          {%Fast.Rope{dims: 8, seq_axis: 2}, [x], Fast.rope(bx, 8)},
          {%Fast.SDPA{scale: 0.5, causal: true}, [x, x, x],
           Fast.scaled_dot_product_attention(bx, bx, bx, scale: 0.5, mask: :causal)}
        ] do
      fused = Moat.Backend.block(struct, t, args, Map.fetch!(refs, length(args) + 1))
      assert_all_close!(Nx.backend_transfer(fused), expected, 1.0e-5)
    end
  end

  describe "rope on {B, T, H, D}" do
    # x = [1, 0] at every row: position p turns it to [cos p, sin p]. With
    # seq_axis: 1 every head of row t is at position offset + t; MLX, given
    # the tensor as it is, would rotate head h at t + h (only h = 0 right).
    test "every head of a row turns by the row's position" do
      {b, t, h, offset} = {2, 4, 3, 5}
      x = Nx.broadcast(Nx.tensor([1.0, 0.0]), {b, t, h, 2})

      expected =
        Nx.iota({1, t, 1, 1}, type: {:f, 32})
        |> Nx.add(offset)
        |> then(&Nx.concatenate([Nx.cos(&1), Nx.sin(&1)], axis: -1))
        |> Nx.broadcast({b, t, h, 2})

      for backend_x <- [x, moat(x)] do
        got = Fast.rope(backend_x, 2, seq_axis: 1, offset: offset, base: 1.0)
        assert_all_close!(Nx.backend_transfer(got), expected, 1.0e-6)
      end

      # The same tensor taken as {B, H, T, D} rotates along the other axis.
      wrong = Fast.rope(moat(x), 2, offset: offset, base: 1.0) |> Nx.backend_transfer()
      refute Nx.to_number(Nx.all_close(wrong, expected, atol: 1.0e-3)) == 1
    end
  end

  describe "rope with position ids" do
    # Positions {T} equal to offset + iota give the offset form's result;
    # {B, T} rows (left padding, packed sequences) give each batch its own,
    # checked against per-batch ropes of one position each. On Moat this is
    # the reference composition (MLX has no position-id kernel), compiled too.
    test "match the offset form, per batch and per position" do
      x = random(7, {2, 3, 5, 8})
      positions = Nx.tensor([[4, 0, 9, 2, 2], [0, 1, 2, 3, 4]])

      for backend <- [&Function.identity/1, &moat/1] do
        got = Fast.rope(backend.(x), 8, positions: backend.(Nx.iota({5}) |> Nx.add(3)))
        assert_all_close!(Nx.backend_transfer(got), Fast.rope(x, 8, offset: 3), 1.0e-5)

        got = Fast.rope(backend.(x), 6, positions: backend.(positions)) |> Nx.backend_transfer()

        for b <- 0..1, t <- 0..4 do
          p = Nx.to_number(positions[b][t])
          one = Fast.rope(Nx.slice(x, [b, 0, t, 0], [1, 3, 1, 8]), 6, offset: p)
          assert_all_close!(Nx.slice(got, [b, 0, t, 0], [1, 3, 1, 8]), one, 1.0e-5)
        end
      end

      jit = Nx.Defn.jit(&Fast.rope(&1, 6, positions: &2, seq_axis: 2), compiler: Moat.Compiler)

      assert_all_close!(
        Nx.backend_transfer(jit.(moat(x), moat(positions))),
        Fast.rope(x, 6, positions: positions),
        1.0e-5
      )
    end

    test "bad position ids are refused" do
      x = random(1, {2, 3, 5, 8})

      assert_raise ArgumentError, ~r/rope: :positions must have shape \{5\} or \{2, 5\}/, fn ->
        Fast.rope(x, 4, positions: Nx.iota({4}))
      end

      assert_raise ArgumentError, ~r/rope: :positions must be an integer tensor and comes instead of :offset/, fn ->
        Fast.rope(x, 4, positions: Nx.iota({5}), offset: 2)
      end

      assert_raise ArgumentError, ~r/rope: :positions must be an integer tensor/, fn ->
        Fast.rope(x, 4, positions: Nx.iota({5}, type: :f32))
      end
    end
  end

  describe "gradients flow through the reference" do
    # A directional finite difference in f64 checks Nx.Defn.grad of each
    # kernel (it differentiates the reference composition); then the same
    # gradient evaluated with Moat tensors agrees in f32.
    @cases [
      {:rms_norm, [{3, 8}, {8}]},
      {:layer_norm, [{3, 8}, {8}, {8}]},
      {:rope, [{2, 3, 4, 8}]},
      {:sdpa, [{1, 4, 3, 8}, {1, 2, 5, 8}, {1, 2, 5, 8}]},
      {:sdpa_prefix, [{2, 4, 1, 8}, {2, 2, 5, 8}, {2, 2, 5, 8}, {4}]}
    ]

    defp loss(:rms_norm, [x, w]), do: Nx.sum(Nx.multiply(Fast.rms_norm(x, w), Nx.iota(x.shape)))
    defp loss(:layer_norm, [x, w, b]), do: Nx.sum(Nx.pow(Fast.layer_norm(x, w, b), 2))
    defp loss(:rope, [x]), do: Nx.sum(Nx.multiply(Fast.rope(x, 6, offset: 2, seq_axis: 1), Nx.iota(x.shape)))

    defp loss(:sdpa, [q, k, v]),
      do: Nx.sum(Nx.multiply(Fast.scaled_dot_product_attention(q, k, v, mask: :causal), Nx.iota({1, 4, 3, 8})))

    defp loss(:sdpa_prefix, [q, k, v, sinks]) do
      opts = [mask: :causal, lengths: Nx.tensor([5, 3]), starts: Nx.tensor([1, 0]), sinks: sinks]
      Nx.sum(Nx.multiply(Fast.scaled_dot_product_attention(q, k, v, opts), Nx.iota({2, 4, 1, 8})))
    end

    for {name, shapes} <- @cases do
      @name name
      @shapes shapes

      test "#{name}" do
        args = @shapes |> Enum.with_index(fn s, i -> random(10 + i, s, {:f, 64}) end)
        dirs = @shapes |> Enum.with_index(fn s, i -> random(20 + i, s, {:f, 64}) end)
        grads = Nx.Defn.grad(List.to_tuple(args), &loss(@name, Tuple.to_list(&1)))

        eps = 1.0e-6
        step = fn sign -> Enum.zip_with(args, dirs, &Nx.add(&1, Nx.multiply(&2, sign * eps))) end
        numeric = Nx.to_number(Nx.subtract(loss(@name, step.(1)), loss(@name, step.(-1)))) / (2 * eps)

        analytic =
          Enum.zip_with(Tuple.to_list(grads), dirs, &Nx.to_number(Nx.sum(Nx.multiply(&1, &2)))) |> Enum.sum()

        assert_in_delta analytic, numeric, 1.0e-5 * max(1.0, abs(numeric))

        f32 = Enum.map(args, &Nx.as_type(&1, {:f, 32}))
        on_moat = Nx.Defn.grad(List.to_tuple(Enum.map(f32, &moat/1)), &loss(@name, Tuple.to_list(&1)))
        on_binary = Nx.Defn.grad(List.to_tuple(f32), &loss(@name, Tuple.to_list(&1)))

        for {m, b} <- Enum.zip(Tuple.to_list(on_moat), Tuple.to_list(on_binary)) do
          assert_all_close!(Nx.backend_transfer(m), b, 1.0e-4)
        end
      end
    end
  end

  test "inside defn: the kernel on Moat, the reference on Nx.BinaryBackend" do
    fun = fn x, w, q ->
      y = Fast.rms_norm(x, w)
      a = Fast.scaled_dot_product_attention(q, q, q, mask: :causal)
      {Fast.rope(y, 4, offset: 1), a}
    end

    args = [random(1, {2, 3, 8}), random(2, {8}), random(3, {1, 2, 3, 8})]
    {y, a} = apply(Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator), Enum.map(args, &moat/1))
    {ry, ra} = apply(Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator), args)
    assert y.data.__struct__ == Moat.Backend
    assert_all_close!(Nx.backend_transfer(y), ry, 1.0e-5)
    assert_all_close!(Nx.backend_transfer(a), ra, 1.0e-5)
  end

  test "swiglu is silu(gate) * up on every backend" do
    gate = random(1, {3, 8})
    up = random(2, {3, 8})
    expected = Nx.multiply(Nx.multiply(gate, Nx.sigmoid(gate)), up)
    assert_all_close!(Fast.swiglu(gate, up), expected, 1.0e-6)
    assert_all_close!(Nx.backend_transfer(Fast.swiglu(moat(gate), moat(up))), expected, 1.0e-5)
  end

  describe "bad input" do
    test "is refused with the op and the cause" do
      x = moat(random(1, {2, 3, 8}))

      assert_raise ArgumentError, ~r/rms_norm: weight must have shape \{8\}/, fn ->
        Fast.rms_norm(x, moat(random(2, {4})))
      end

      assert_raise ArgumentError, ~r/rope: dims must be a positive even/, fn -> Fast.rope(x, 3) end
      assert_raise ArgumentError, ~r/rope: dims must be/, fn -> Fast.rope(x, 10) end
      assert_raise ArgumentError, ~r/rope: :offset must be/, fn -> Fast.rope(x, 4, offset: -1) end
      assert_raise ArgumentError, ~r/rope: :offset must be/, fn -> Fast.rope(x, 4, offset: Nx.tensor(1.0)) end

      assert_raise ArgumentError, ~r/rope: an :offset tensor must be a scalar or \{2\}/, fn ->
        Fast.rope(x, 4, offset: Nx.tensor([1, 2, 3]))
      end

      assert_raise ArgumentError, ~r/rope: :seq_axis cannot be/, fn -> Fast.rope(x, 4, seq_axis: -1) end

      assert_raise ArgumentError, ~r/rope: :freqs must have shape \{2\}/, fn ->
        Fast.rope(x, 4, freqs: Nx.tensor([1.0]))
      end

      q = moat(random(1, {1, 3, 2, 8}))
      k = moat(random(2, {1, 2, 4, 8}))
      assert_raise ArgumentError, ~r/Hkv dividing Hq/, fn -> Fast.scaled_dot_product_attention(q, k, k) end
      q = moat(random(1, {1, 4, 2, 8}))

      assert_raise ArgumentError, ~r/mask of shape \{3, 4\} does not broadcast/, fn ->
        Fast.scaled_dot_product_attention(q, k, k, mask: Nx.iota({3, 4}))
      end

      # The worker is still there.
      assert Nx.to_number(Nx.sum(Fast.rms_norm(x, moat(Nx.broadcast(1.0, {8}))))) |> is_float()
    end
  end
end

defmodule Moat.QuantizedTest do
  # Quantized weights (Moat.quantize/2) in real workers, against
  # Nx.BinaryBackend: the quantized product against the dense one and
  # against dequantize-then-multiply, round trips, the operations that
  # dequantize (with telemetry), copies, memory, programs, gather_qmm, and the
  # worker's AVX2 and scalar kernels forced by :cpu_kernels
  # (MOAT_CPU_FEATURES) beside the default worker's (AVX-512 on a CPU with
  # it).
  use ExUnit.Case, async: false

  import Moat.Case

  @workers [Moat.Worker, :quant_avx2, :quant_scalar]

  setup_all do
    start_worker(:quant_scalar, cpu_kernels: :scalar)
    # A CPU without AVX2 runs the scalar set twice rather than skip.
    start_worker(:quant_avx2, cpu_kernels: if(Moat.Worker.info().cpu in [:avx2, :avx512], do: :avx2, else: :scalar))
    :ok
  end

  defp normal(seed, shape, type \\ :f32) do
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape, type: :f32)
    Nx.as_type(t, type)
  end

  defp uniform(seed, shape) do
    {t, _} = Nx.Random.uniform(Nx.Random.key(seed), shape: shape, type: :f32)
    t
  end

  defp on(t, worker), do: Nx.backend_copy(t, {Moat.Backend, worker: worker})
  defp binary(t), do: Nx.backend_copy(t, Nx.BinaryBackend)

  # ‖a - b‖ / ‖b‖ in f64.
  defp relative(a, b) do
    [a, b] = Enum.map([a, b], &(&1 |> binary() |> Nx.as_type(:f64)))
    diff = Nx.subtract(a, b)
    Nx.to_number(Nx.sqrt(Nx.divide(Nx.sum(Nx.multiply(diff, diff)), Nx.sum(Nx.multiply(b, b)))))
  end

  defp dot_t(x, w), do: Nx.dot(x, [Nx.rank(x) - 1], w, [1])

  defp count_dequantize(fun) do
    me = self()
    id = {__MODULE__, make_ref()}
    :telemetry.attach(id, [:moat, :quantized, :dequantize], fn _, _, meta, _ -> send(me, {:dequantized, meta}) end, nil)

    try do
      result = fun.()

      {result,
       Stream.repeatedly(fn -> receive(do: ({:dequantized, m} -> m), after: (0 -> nil)) end) |> Enum.take_while(& &1)}
    after
      :telemetry.detach(id)
    end
  end

  for worker <- @workers do
    describe "through #{inspect(worker)}" do
      @describetag worker: worker

      test "8-bit is within 1% of the dense product, 4-bit within 5%", %{worker: worker} do
        # 8-bit on unit-normal weights; 4-bit on uniform ones (on normal ones
        # 4-bit affine groups of 64 are about 9% off: the tails widen each
        # group's step, whatever computes the product).
        x = normal(1, {4, 512})

        for {bits, w, bound} <- [{8, normal(2, {96, 512}), 0.01}, {4, uniform(3, {96, 512}), 0.05}] do
          dense = dot_t(x, w)
          qw = Moat.quantize(on(w, worker), bits: bits, group_size: 64)
          got = dot_t(on(x, worker), qw)
          assert got.shape == {4, 96} and got.type == {:f, 32}
          assert relative(got, dense) < bound, "#{bits}-bit: #{relative(got, dense)}"
        end
      end

      test "the product is dequantize-then-multiply within 1e-5, every width and group", %{worker: worker} do
        x = on(normal(4, {3, 256}), worker)
        w = on(normal(5, {40, 256}), worker)

        for bits <- [2, 3, 4, 6, 8], group <- [32, 64, 128] do
          qw = Moat.quantize(w, bits: bits, group_size: group)
          reference = dot_t(binary(x), binary(Moat.dequantize(qw)))
          {got, events} = count_dequantize(fn -> dot_t(x, qw) end)
          assert events == [], "the quantized product dequantizes nothing"
          assert relative(got, reference) < 1.0e-5, "#{bits}/#{group}: #{relative(got, reference)}"
        end
      end

      test "batched, strided and broadcast inputs; f16 and bf16 weights", %{worker: worker} do
        w = normal(6, {24, 128})
        qw = Moat.quantize(on(w, worker), bits: 4, group_size: 32)
        dq = binary(Moat.dequantize(qw))

        inputs = [
          normal(7, {2, 3, 128}),
          Nx.transpose(normal(8, {128, 5})),
          Nx.broadcast(normal(9, {1, 128}), {4, 128})
        ]

        for x <- inputs do
          got = dot_t(on(x, worker), qw)
          reference = dot_t(x, dq)
          assert got.shape == reference.shape
          assert relative(got, reference) < 1.0e-5
        end

        # The moved x: a transpose of a Moat tensor.
        xt = on(normal(10, {128, 3}), worker) |> Nx.transpose()
        assert relative(dot_t(xt, qw), dot_t(binary(xt), dq)) < 1.0e-5

        for type <- [:f16, :bf16] do
          qh = Moat.quantize(on(Nx.as_type(w, type), worker), bits: 8, group_size: 64)
          assert qh.type == Nx.Type.normalize!(type)
          x = normal(11, {2, 128})
          got = dot_t(on(x, worker), qh)
          # x is f32: the product is f32, from the f16/bf16 scales in f32.
          assert got.type == {:f, 32}
          reference = dot_t(x, Nx.as_type(binary(Moat.dequantize(qh)), :f32))
          assert relative(got, reference) < 1.0e-2
        end
      end
    end
  end

  test "round trips keep every value within a step of its group" do
    w = normal(12, {8, 256})

    for bits <- [2, 3, 4, 6, 8], group <- [32, 64, 128], scale_type <- [:f32, :bf16] do
      qw = Moat.quantize(on(w, Moat.Worker), bits: bits, group_size: group, scale_type: scale_type)
      back = binary(Moat.dequantize(qw))
      assert back.shape == w.shape and back.type == w.type
      groups = Nx.reshape(w, {8, div(256, group), group})
      step = Nx.subtract(Nx.reduce_max(groups, axes: [2]), Nx.reduce_min(groups, axes: [2])) |> Nx.divide(2 ** bits - 1)
      err = Nx.abs(Nx.subtract(Nx.reshape(back, groups.shape), groups)) |> Nx.reduce_max(axes: [2])
      # MLX moves a group's grid so that 0 is on it: within one step (plus
      # the rounding of the scale and bias), not half. bf16 rounds the bias
      # (at most the group's largest magnitude m) by 2^-9 of it, and the
      # scale by 2^-9 of it, times q < 2^bits: at most 3 m 2^-9 together.
      rounding =
        if scale_type == :f32,
          do: 1.0e-5,
          else: Nx.multiply(Nx.reduce_max(Nx.abs(groups), axes: [2]), 3 * 2 ** -9) |> Nx.add(1.0e-5)

      assert Nx.to_number(Nx.all(Nx.less_equal(err, Nx.add(step, rounding)))) == 1, "#{bits}/#{group}/#{scale_type}"
    end
  end

  test "a quantized weight has the dense shape and type, prints and copies dequantized" do
    w = normal(13, {16, 64})
    qw = Moat.quantize(on(w, Moat.Worker), bits: 8, group_size: 32)
    assert {qw.shape, qw.type} == {{16, 64}, {:f, 32}}
    assert Moat.Quantized.quantized?(qw)
    assert %Moat.Quantized{bits: 8, group_size: 32, mode: :affine} = Moat.Quantized.info(qw)
    dense = binary(Moat.dequantize(qw))

    {copied, events} = count_dequantize(fn -> Nx.backend_copy(qw, Nx.BinaryBackend) end)
    assert copied == dense
    assert [%{op: :backend_copy, bits: 8}] = events
    assert Nx.to_binary(qw) == Nx.to_binary(dense)
    assert inspect(qw) =~ "Moat.Backend(#{Moat.Worker.info().device}, 8-bit affine, group 32, bf16 scales)"

    # Within Moat, to the same or another worker, it stays quantized.
    for worker <- [Moat.Worker, :quant_scalar] do
      {copy, events} = count_dequantize(fn -> Nx.backend_copy(qw, {Moat.Backend, worker: worker}) end)
      assert events == [] and Moat.Quantized.quantized?(copy) and copy.data.ref.worker == worker
      assert binary(copy) == dense
    end
  end

  test "other ops dequantize first, with telemetry" do
    w = normal(14, {8, 64})
    qw = Moat.quantize(on(w, Moat.Worker), bits: 4, group_size: 64)
    dense = binary(Moat.dequantize(qw))

    {sum, events} = count_dequantize(fn -> Nx.add(qw, 1.0) end)
    assert binary(sum) == Nx.add(dense, 1.0)
    assert [%{op: :add, shape: {8, 64}, type: {:f, 32}, bits: 4, group_size: 64, mode: :affine}] = events

    # A dot the quantized product does not cover: the weight on the left.
    x = normal(15, {3, 64})
    {left, [%{op: :dot}]} = count_dequantize(fn -> Nx.dot(qw, [1], on(x, Moat.Worker), [1]) end)
    assert relative(left, Nx.dot(dense, [1], x, [1])) < 1.0e-6

    # Blocks, lists (concatenate) and slices.
    {cat, _} = count_dequantize(fn -> Nx.concatenate([qw, qw]) end)
    assert binary(cat) == Nx.concatenate([dense, dense])
    assert binary(Nx.cumulative_sum(qw, axis: 1)) |> relative(Nx.cumulative_sum(dense, axis: 1)) < 1.0e-6
    assert binary(qw[[0..1, 0..3]]) == dense[[0..1, 0..3]]
  end

  # The byte arithmetic of MLX's CPU allocator: on the GPU, `w`'s
  # intermediates are held and freed otherwise (not investigated).
  @tag :cpu_only
  test "the memory limit counts the packed bytes" do
    worker = start_worker(:quant_memory)
    w = Nx.iota({1024, 1024}, type: :f32, backend: {Moat.Backend, worker: worker}) |> Nx.divide(1.0e6)
    Moat.eval(w.data.ref)
    before = Moat.memory_info(worker).active
    qw = Moat.quantize(w, bits: 4, group_size: 64)
    packed = Moat.Quantized.packed_bytes(qw.shape, qw.type, Moat.Quantized.info(qw))
    # bf16 scales and biases: 4.5 bits a weight.
    assert packed == 1024 * (512 + 16 * 4) and packed * 8 / (1024 * 1024) == 4.5
    Nx.backend_deallocate(w)
    assert Moat.memory_info(worker).active - before + 4 * 1024 * 1024 == packed
    # qw is used below, so a garbage collection cannot release it (release
    # on GC) before the count above is read.
    assert Moat.Quantized.info(qw).bits == 4
  end

  test "scale types: bf16 by default for f32 weights, f32 on request, the weight's own for half ones" do
    w = normal(30, {64, 256})
    x = normal(31, {2, 256})

    for {type, opts, want, bits_a_weight} <- [
          {:f32, [], {:bf, 16}, 4.5},
          {:f32, [scale_type: :f32], {:f, 32}, 5.0},
          {:f16, [], {:f, 16}, 4.5},
          {:f16, [scale_type: :bf16], {:bf, 16}, 4.5},
          {:bf16, [], {:bf, 16}, 4.5}
        ] do
      qw = Moat.quantize(on(Nx.as_type(w, type), Moat.Worker), [bits: 4, group_size: 64] ++ opts)
      q = Moat.Quantized.info(qw)
      assert q.scale_type == want
      assert Moat.Quantized.packed_bytes(qw.shape, qw.type, q) * 8 / Nx.size(w) == bits_a_weight

      # Every worker reads the same bytes: its product is dequantize-then-multiply
      # (computed in f32: a half weight's dequantized values are rounded to it).
      reference = dot_t(x, Nx.as_type(binary(Moat.dequantize(qw)), :f32))

      [first | _] =
        got = for worker <- @workers, do: dot_t(on(x, worker), Nx.backend_copy(qw, {Moat.Backend, worker: worker}))

      assert relative(first, reference) < if(type == :f32, do: 1.0e-5, else: 1.0e-2)
      for g <- got, do: assert(relative(g, first) < 1.0e-5, "#{type} #{inspect(want)}")
    end

    # bf16 scales cost little: f32 scales give about the same error.
    dense = dot_t(x, w)

    errors =
      for st <- [:bf16, :f32],
          do: relative(dot_t(on(x, Moat.Worker), Moat.quantize(on(w, Moat.Worker), bits: 8, scale_type: st)), dense)

    assert Enum.all?(errors, &(&1 < 0.01)), inspect(errors)

    assert_raise ArgumentError,
                 ~r/:scale_type is bf16, f32 or the weight's own type .* got :f16 for a f32 weight/,
                 fn ->
                   Moat.quantize(on(w, Moat.Worker), scale_type: :f16)
                 end

    assert_raise ArgumentError, ~r/mxfp4 has uint8 scales/, fn ->
      Moat.quantize(on(w, Moat.Worker), mode: :mxfp4, scale_type: :bf16)
    end
  end

  test "Moat.Compiler runs the quantized product in the program, from its arguments" do
    w = normal(16, {32, 128})
    x = on(normal(17, {2, 128}), Moat.Worker)
    qw = Moat.quantize(on(w, Moat.Worker), bits: 4, group_size: 32)
    eager = Nx.add(dot_t(x, qw), 1.0)

    {jitted, events} =
      count_dequantize(fn ->
        Nx.Defn.jit(fn x, w -> Nx.add(Nx.dot(x, [1], w, [1]), 1.0) end, compiler: Moat.Compiler).(x, qw)
      end)

    assert events == []
    assert binary(jitted) == binary(eager)

    # Another op on the weight inside the program dequantizes it there.
    summed = Nx.Defn.jit(fn w -> Nx.sum(w) end, compiler: Moat.Compiler).(qw)
    assert_in_delta Nx.to_number(summed), Nx.to_number(Nx.sum(binary(Moat.dequantize(qw)))), 1.0e-2

    # A dense weight of the same shape lowers another program.
    dense = on(w, Moat.Worker)
    f = Nx.Defn.jit(fn x, w -> Nx.dot(x, [1], w, [1]) end, compiler: Moat.Compiler)
    assert relative(f.(x, dense), dot_t(binary(x), w)) < 1.0e-6
    assert relative(f.(x, qw), dot_t(x, qw)) < 1.0e-6
  end

  test "microscaled modes multiply as they dequantize" do
    w = normal(18, {16, 64})
    x = on(normal(19, {2, 64}), Moat.Worker)

    for mode <- [:mxfp4, :mxfp8, :nvfp4] do
      qw = Moat.quantize(on(w, Moat.Worker), mode: mode)
      assert Moat.Quantized.info(qw).mode == mode
      reference = dot_t(binary(x), binary(Moat.dequantize(qw)))
      assert relative(dot_t(x, qw), reference) < 1.0e-5, "#{mode}"
      assert relative(binary(Moat.dequantize(qw)), w) < 0.2
    end
  end

  test "gather_qmm multiplies each batch entry by the expert its index names" do
    experts = normal(20, {4, 16, 64})
    qw = Moat.quantize(on(experts, Moat.Worker), bits: 8, group_size: 64)
    x = normal(21, {3, 1, 64})
    idx = Nx.tensor([2, 0, 3], type: :u32)
    got = Moat.gather_qmm(on(x, Moat.Worker), qw, on(idx, Moat.Worker))
    assert got.shape == {3, 1, 16}
    dq = binary(Moat.dequantize(qw))

    for {e, i} <- Enum.with_index([2, 0, 3]) do
      assert relative(got[i], Nx.dot(x[i], [1], dq[e], [1])) < 1.0e-5
    end

    bad = Moat.gather_qmm(on(x, Moat.Worker), qw, on(Nx.tensor([0, 4, 1], type: :u32), Moat.Worker))
    assert_raise Moat.Error, ~r/gather_qmm: rhs_indices hold 4 outside 0..4/, fn -> Nx.to_binary(bad) end
  end

  test "bad options and weights are refused with the cause" do
    w = on(normal(22, {4, 64}), Moat.Worker)
    assert_raise ArgumentError, ~r/affine takes bits \[2, 3, 4, 6, 8\], got 5/, fn -> Moat.quantize(w, bits: 5) end
    assert_raise ArgumentError, ~r/takes group_size/, fn -> Moat.quantize(w, group_size: 16) end
    assert_raise ArgumentError, ~r/unknown mode :q4/, fn -> Moat.quantize(w, mode: :q4) end
    # A GPU worker refuses the f64 weight first (test/moat/gpu_test.exs).
    if not gpu?() do
      assert_raise ArgumentError, ~r/f32, f16 or bf16, got \{:f, 64\}/, fn -> Moat.quantize(Nx.as_type(w, :f64)) end
    end

    assert_raise ArgumentError, ~r/multiple of the group size 64/, fn -> Moat.quantize(w[[.., 0..31]]) end
    assert_raise ArgumentError, ~r/rank at least 2/, fn -> Moat.quantize(w[0]) end
  end
end

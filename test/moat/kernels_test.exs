defmodule Moat.KernelsTest do
  # The worker's own CPU kernels of the f32/f16/bf16 transcendentals, against
  # Nx.BinaryBackend computing in f64: ulp bounds over dense sweeps, seeded
  # random samples and edge values, through the AVX2 kernels (where the CPU
  # has them) and through the scalar fallback forced by :cpu_kernels.
  use ExUnit.Case, async: false

  import Moat.Case

  # op => {domain of the sweep, bound in f32 ulp}. f16 and bf16 are computed
  # in f32 and rounded once: within 1 ulp of their type.
  @ops [
    exp: {{-103.0, 88.7}, 1.0},
    expm1: {{-20.0, 88.7}, 1.0},
    log: {{1.0e-38, 3.0e38}, 1.0},
    log1p: {{-0.999, 1.0e38}, 1.0},
    tanh: {{-12.0, 12.0}, 1.0},
    sigmoid: {{-100.0, 100.0}, 3.0},
    erf: {{-4.5, 4.5}, 1.01},
    erfc: {{-4.0, 10.0}, 2.0},
    sin: {{-1.0e4, 1.0e4}, 1.0},
    cos: {{-1.0e4, 1.0e4}, 1.0},
    rsqrt: {{1.0e-38, 3.0e38}, 1.5}
  ]

  # Special inputs and what C99/IEEE give (Nx.BinaryBackend raises or
  # returns NaN for several of them).
  @edges [
    exp: [{:infinity, :infinity}, {:neg_infinity, 0.0}, {:nan, :nan}, {89.0, :infinity}, {-105.0, 0.0}, {-0.0, 1.0}],
    expm1: [{:infinity, :infinity}, {:neg_infinity, -1.0}, {:nan, :nan}, {-0.0, -0.0}],
    log: [{0.0, :neg_infinity}, {-0.0, :neg_infinity}, {-1.0, :nan}, {:infinity, :infinity}, {:nan, :nan}],
    log1p: [{-1.0, :neg_infinity}, {-2.0, :nan}, {:infinity, :infinity}, {-0.0, -0.0}],
    tanh: [{:infinity, 1.0}, {:neg_infinity, -1.0}, {:nan, :nan}, {-0.0, -0.0}, {9.5, 1.0}, {-30.0, -1.0}],
    sigmoid: [{:infinity, 1.0}, {:neg_infinity, 0.0}, {:nan, :nan}, {-0.0, 0.5}],
    erf: [{:infinity, 1.0}, {:neg_infinity, -1.0}, {:nan, :nan}, {-0.0, -0.0}],
    erfc: [{:infinity, 0.0}, {:neg_infinity, 2.0}, {:nan, :nan}, {11.0, 0.0}],
    sin: [{:infinity, :nan}, {:neg_infinity, :nan}, {:nan, :nan}, {-0.0, -0.0}],
    cos: [{:infinity, :nan}, {:nan, :nan}, {-0.0, 1.0}],
    rsqrt: [{0.0, :infinity}, {-0.0, :neg_infinity}, {-1.0, :nan}, {:infinity, 0.0}, {:nan, :nan}]
  ]

  @types [{:f, 32}, {:f, 16}, {:bf, 16}]

  # The default worker takes the widest set; the others are forced, AVX2
  # only where the CPU has it.
  @flags File.read!("/proc/cpuinfo") |> String.split() |> MapSet.new()
  @avx2 Enum.all?(~w(avx2 fma f16c), &MapSet.member?(@flags, &1))
  @workers [Moat.Worker, :kernels_scalar] ++ if(@avx2, do: [:kernels_avx2], else: [])

  setup_all do
    start_worker(:kernels_scalar, cpu_kernels: :scalar)
    if @avx2, do: start_worker(:kernels_avx2, cpu_kernels: :avx2)
    :ok
  end

  test "the hello names the kernel set, and :cpu_kernels forces the fallback" do
    assert Moat.Worker.info(:kernels_scalar).cpu == :scalar
    assert Moat.Worker.info().cpu in [:avx512, :avx2, :scalar]

    assert {:error, {{%ArgumentError{message: message}, _}, _}} =
             start_supervised({Moat.Worker, name: :kernels_bad, cpu_kernels: :sse9})

    assert message =~ ":cpu_kernels must be"
  end

  for {op, {{lo, hi}, bound}} <- @ops, type <- @types, worker <- @workers do
    test "#{op} of #{inspect(type)} through #{inspect(worker)} keeps its bound against BinaryBackend" do
      op = unquote(op)
      type = unquote(type)
      {lo, hi} = range(unquote(lo), unquote(hi), type)
      xs = inputs(lo, hi) |> Nx.tensor(type: type, backend: Nx.BinaryBackend)
      exact = exact(op, xs)
      got = xs |> Nx.backend_transfer({Moat.Backend, worker: unquote(worker)}) |> then(&apply(Nx, op, [&1]))
      got = Nx.to_flat_list(got)
      bound = unquote(if type == {:f, 32}, do: bound, else: 1.0)
      errors = Enum.zip(got, exact) |> Enum.map(fn {g, e} -> ulps(g, e, type) end)
      histogram = Enum.frequencies_by(errors, &ceil/1)
      worst = Enum.max(errors)

      assert worst <= bound + 1.0e-6,
             "#{op} #{inspect(type)}: #{worst} ulp; histogram #{inspect(Enum.sort(histogram))} exceeds #{bound}"
    end
  end

  # The vector tanh switches from its polynomial to 1 - 2 / (e^2t + 1) at
  # 0.625 and clamps t at 9.5: every f32 within 2048 of those (and their
  # negatives) keeps the bound.
  for worker <- @workers do
    test "tanh of every f32 next to the vector kernel's switch points through #{inspect(worker)}" do
      xs =
        for at <- [0.625, 9.5], <<bits::32-native>> = <<at::float-32-native>>, d <- -2048..2048, sign <- [1, -1] do
          <<x::float-32-native>> = <<bits + d::32-native>>
          sign * x
        end

      got = Nx.tensor(xs, type: :f32, backend: {Moat.Backend, worker: unquote(worker)}) |> Nx.tanh()
      exact = exact(:tanh, Nx.tensor(xs, type: :f32, backend: Nx.BinaryBackend))

      for {x, g, e} <- Enum.zip([xs, Nx.to_flat_list(got), exact]) do
        assert ulps(g, e, {:f, 32}) <= 1.0, "tanh(#{x}) = #{g}, exact #{e}"
      end
    end
  end

  for {op, edges} <- @edges, worker <- @workers do
    test "#{op} of edge values through #{inspect(worker)}" do
      {ins, wants} = Enum.unzip(unquote(Macro.escape(edges)))

      for type <- @types do
        got =
          Nx.tensor(ins, type: type, backend: {Moat.Backend, worker: unquote(worker)})
          |> then(&apply(Nx, unquote(op), [&1]))
          |> Nx.to_flat_list()

        for {x, g, w} <- Enum.zip([ins, got, wants]) do
          assert same?(g, w), "#{unquote(op)}(#{inspect(x)}) in #{inspect(type)}: #{inspect(g)}, want #{inspect(w)}"
        end
      end
    end
  end

  test "pow of f32, f16 and bf16 with broadcasting keeps 1 ulp against BinaryBackend" do
    bases = inputs(1.0e-3, 1.0e3) |> Enum.take(1000)
    exps = [-3.5, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 7.25]

    for type <- @types, worker <- @workers do
      b = Nx.tensor(bases, type: type, backend: Nx.BinaryBackend) |> Nx.reshape({:auto, 1})
      e = Nx.tensor(exps, type: type, backend: Nx.BinaryBackend)
      exact = Nx.pow(Nx.as_type(b, :f64), Nx.as_type(e, :f64)) |> Nx.to_flat_list()
      moat = fn t -> Nx.backend_transfer(t, {Moat.Backend, worker: worker}) end
      got = Nx.pow(moat.(b), moat.(e)) |> Nx.to_flat_list()
      worst = Enum.zip(got, exact) |> Enum.map(fn {g, x} -> ulps(g, x, type) end) |> Enum.max()
      assert worst <= 1.0, "pow #{inspect(type)} through #{inspect(worker)}: #{worst} ulp"
    end
  end

  test "the fallback computes what the default kernels compute, within their bounds" do
    xs = inputs(-50.0, 50.0) |> Nx.tensor(type: :f32)

    for {op, {_, bound}} <- @ops, op not in [:log, :rsqrt] do
      [a, b] =
        for worker <- [Moat.Worker, :kernels_scalar] do
          xs |> Nx.backend_transfer({Moat.Backend, worker: worker}) |> then(&apply(Nx, op, [&1])) |> Nx.to_flat_list()
        end

      for {x, y} <- Enum.zip(a, b), do: assert(ulps(x, y, {:f, 32}) <= 2 * bound, "#{op}: #{x} vs #{y}")
    end
  end

  # The f64 results. Nx.BinaryBackend's expm1 and log1p are exp(x) - 1 and
  # log(1 + x), which lose the small values; Kahan's forms keep them.
  defp exact(:expm1, xs), do: Nx.to_flat_list(Nx.as_type(xs, :f64)) |> Enum.map(&expm1/1)
  defp exact(:log1p, xs), do: Nx.to_flat_list(Nx.as_type(xs, :f64)) |> Enum.map(&log1p/1)
  defp exact(op, xs), do: apply(Nx, op, [Nx.as_type(xs, :f64)]) |> Nx.to_flat_list()

  defp expm1(x) when abs(x) > 0.5, do: :math.exp(x) - 1

  defp expm1(x) do
    u = :math.exp(x)
    if u == 1.0, do: x, else: (u - 1) * x / :math.log(u)
  end

  defp log1p(x) do
    u = 1.0 + x
    if u == 1.0, do: x, else: :math.log(u) * x / (u - 1)
  end

  # A dense sweep (uniform, then log-spaced on each side of zero where the
  # range spans magnitudes) and seeded random samples.
  defp inputs(lo, hi) do
    :rand.seed(:exsss, {14, 15, 16})
    linear = for i <- 0..2000, do: lo + (hi - lo) * i / 2000
    random = for _ <- 1..1500, do: lo + (hi - lo) * :rand.uniform()

    logs =
      for {a, b} <- [{max(lo, 1.0e-40), hi}, {max(-hi, 1.0e-40), -lo}], a > 0 and b > a, i <- 0..1500 do
        sign = if b == -lo, do: -1, else: 1
        sign * :math.exp(:math.log(a) + (:math.log(b) - :math.log(a)) * i / 1500)
      end
      |> Enum.filter(&(&1 >= lo and &1 <= hi))

    linear ++ random ++ logs
  end

  # Keeps sweeps inside what half types hold.
  defp range(lo, hi, {:f, 16}) when lo > 0, do: {max(lo, 1.0e-7), min(hi, 65000.0)}
  defp range(lo, hi, {:f, 16}), do: {max(lo, -65000.0), min(hi, 65000.0)}
  defp range(lo, hi, _), do: {lo, hi}

  @mantissa %{{:f, 32} => 23, {:f, 16} => 10, {:bf, 16} => 7}
  @min_exp %{{:f, 32} => -149, {:f, 16} => -24, {:bf, 16} => -133}

  @max %{{:f, 32} => 3.4028235e38, {:f, 16} => 65504.0, {:bf, 16} => 3.3895314e38}

  # |got - exact| in ulp of `type` at `exact`; beyond the type's range the
  # result is an infinity.
  defp ulps(g, e, type) when g in [:infinity, :neg_infinity] and is_float(e) and abs(e) > :erlang.map_get(type, @max),
    do: if(g == :infinity == e > 0, do: 0, else: 1.0e9)

  defp ulps(g, e, _type) when is_atom(g) or is_atom(e), do: if(same?(g, e), do: 0, else: 1.0e9)

  defp ulps(g, e, type) do
    if g == e do
      0
    else
      exponent = if e == 0, do: -1000, else: floor(:math.log2(abs(e)))
      abs(g - e) / :math.pow(2, max(exponent - @mantissa[type], @min_exp[type]))
    end
  end

  defp same?(:nan, w), do: w == :nan
  defp same?(g, w) when is_atom(g) or is_atom(w), do: g == w
  defp same?(g, w) when is_float(w) and w != 0, do: abs(g - w) <= abs(w) * 1.0e-2
  # Signed zeros: 0.0 and -0.0 compare equal with ==, so compare their bits.
  defp same?(g, w), do: <<g::float-64>> == <<w::float-64>>
end

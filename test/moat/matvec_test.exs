defmodule Moat.MatVecTest do
  # The worker's decode-shaped products (x {M <= 16, K} by a weight {N, K} or
  # {K, N}: one pass over the weight in its own storage, accumulated in f32)
  # against Nx.BinaryBackend's Nx.dot, eagerly and in a Moat.Compiler program.
  # Every kernel set: the default worker's (the widest), the scalar
  # fallback, AVX2 where the CPU has it, and MLX's own matmul (:mlx).
  use ExUnit.Case, async: true

  import Moat.Case

  @flags File.read!("/proc/cpuinfo") |> String.split() |> MapSet.new()
  @avx2 Enum.all?(~w(avx2 fma f16c), &MapSet.member?(@flags, &1))
  @sets [scalar: :matvec_scalar, mlx: :matvec_mlx] ++ if(@avx2, do: [avx2: :matvec_avx2], else: [])

  setup_all do
    for {set, name} <- @sets, do: start_worker(name, cpu_kernels: set)
    :ok
  end

  # atol = rtol on unit-normal data, sums of K products: f32 differs in the
  # order of the sum; f16 and bf16 round once, from f32 (Nx rounds the same
  # f32 sum), so a few of their ulps.
  @tolerance %{{:f, 32} => 1.0e-4, {:f, 16} => 4.0e-3, {:bf, 16} => 3.0e-2}

  defp random(seed, shape, type) do
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape, type: {:f, 32})
    Nx.as_type(t, type)
  end

  defp moat(t, worker \\ Moat.Worker), do: Nx.backend_transfer(t, {Moat.Backend, worker: worker})

  defp assert_close!(got, want, tol) do
    assert got.shape == want.shape and got.type == want.type
    a = got |> Nx.backend_transfer(Nx.BinaryBackend) |> Nx.as_type({:f, 64})
    b = Nx.as_type(want, {:f, 64})
    worst = a |> Nx.subtract(b) |> Nx.abs() |> Nx.subtract(Nx.multiply(Nx.abs(b), tol)) |> Nx.reduce_max()
    assert Nx.to_number(worst) <= tol, "differ by more than #{tol}: #{Nx.to_number(worst)}"
  end

  # {x shape, w shape, contract x, contract w}: weights {N, K} (the
  # decoder's), {K, N}, a vector x, K and N off the kernels' vector widths,
  # 16 rows (the largest taken) and 17 (MLX's matmul).
  @cases [
    {{1, 96}, {40, 96}, [1], [1]},
    {{3, 77}, {129, 77}, [1], [1]},
    {{1, 96}, {96, 200}, [1], [0]},
    {{5, 33}, {33, 65}, [1], [0]},
    {{96}, {40, 96}, [0], [1]},
    {{16, 64}, {70, 64}, [1], [1]},
    {{17, 64}, {70, 64}, [1], [1]},
    {{2, 3, 64}, {50, 64}, [2], [1]}
  ]

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}] do
    test "x . w at decode shapes matches Nx.BinaryBackend (#{Nx.Type.to_string(type)})" do
      type = unquote(type)

      for {{xs, ws, cx, cw}, i} <- Enum.with_index(@cases), worker <- [Moat.Worker | Keyword.values(@sets)] do
        x = random(i, xs, type)
        w = random(100 + i, ws, type)
        want = Nx.dot(x, cx, w, cw)
        assert_close!(Nx.dot(moat(x, worker), cx, moat(w, worker), cw), want, @tolerance[type])
      end
    end
  end

  test "inside a compiled program, and over a transposed view of the weight" do
    x = random(1, {1, 48}, {:bf, 16})
    w = random(2, {48, 72}, {:bf, 16})
    f = Nx.Defn.jit(fn x, w -> Nx.dot(x, [1], Nx.transpose(w), [1]) end, compiler: Moat.Compiler)
    assert_close!(f.(moat(x), moat(w)), Nx.dot(x, w), @tolerance[{:bf, 16}])
  end

  test "mixed types take the output type first" do
    x = random(3, {2, 40}, {:f, 32})
    w = random(4, {24, 40}, {:bf, 16})
    assert_close!(Nx.dot(moat(x), [1], moat(w), [1]), Nx.dot(x, [1], w, [1]), 1.0e-4)
  end
end

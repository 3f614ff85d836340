defmodule Moat.NxDoctestTest do
  # Nx's own doctests with Moat.Backend as the default backend. Every
  # exclusion carries a one-line reason.
  use ExUnit.Case, async: false
  import Moat.DocTests

  setup do
    Nx.default_backend(Moat.Backend)
    # Nx's expected output has no backend signature line.
    Application.put_env(:moat, :inspect_backend, false)
    on_exit(fn -> Application.delete_env(:moat, :inspect_backend) end)
    :ok
  end

  # Element-wise, shape, reductions, sorting, creation.
  @excluded_elementwise [
    # Nx's f64 erf_inv is an approximation good to ~3e-8; Moat's is within an ulp of the
    # true value (erf_inv(0.1) = 0.0888559904942577; Nx shows 0.08885598780483887).
    "Nx.erf_inv/1 (453)",
    "Nx.erf_inv/1 (476)",
    # f64 erfc(2) is 1 ulp away: 0.004677734981047266 against Erlang's ...265.
    "Nx.erfc/1 (477)",
    # f64 log1p(2) is 1 ulp away: libm's log1p (MLX) against Nx's log(1 + x).
    "Nx.log1p/1 (480)"
  ]

  # Indexing, dot/conv, linear algebra, windows, FFT.
  @excluded_indexing []

  # Nx.LinAlg. The failing examples are re-run below, held to a tolerance.
  @excluded_linalg [
    # f32 rounding: LAPACK's factor is correctly rounded, Nx's is off by 2 ulps.
    "Nx.LinAlg.cholesky/1 (4)",
    "Nx.LinAlg.cholesky/1 (7)",
    # f32 rounding: Nx's LU prints 630.00006 for 630.
    "Nx.LinAlg.determinant/1 (95)",
    # A repeated eigenvalue has no unique eigenvectors; elsewhere 1-ulp rounding.
    "Nx.LinAlg.eigh/2 (70)",
    "Nx.LinAlg.eigh/2 (71)",
    "Nx.LinAlg.eigh/2 (72)",
    # Nx's values carry the rounding of its own iterative SVD (through pinv).
    "Nx.LinAlg.least_squares/3 (106)",
    "Nx.LinAlg.least_squares/3 (107)",
    "Nx.LinAlg.least_squares/3 (108)",
    # f32 rounding of the reconstructed p.l.u (Nx: 3.9999998 for 4).
    "Nx.LinAlg.lu/1 (79)",
    # Nx's inverse is off in the 6th digit (-110.37471 for -110.375).
    "Nx.LinAlg.matrix_power/2 (87)",
    # Nx's values carry the rounding of its own iterative SVD.
    "Nx.LinAlg.pinv/2 (67)",
    "Nx.LinAlg.pinv/2 (68)",
    # f32 rounding: sqrt(2) prints 1.4142135 here, 1.4142137 in Nx.
    "Nx.LinAlg.qr/2 (58)",
    # f32 rounding in the last digit.
    "Nx.LinAlg.solve/2 (43)",
    "Nx.LinAlg.solve/2 (46)",
    # f32 rounding: Nx's iterative SVD prints 0.99999994 for 1.
    "Nx.LinAlg.svd/2 (75)",
    # A singular matrix fails with a Moat.Error when the result is read, not with
    # ArgumentError at the call (ops are asynchronous).
    "Nx.LinAlg.triangular_solve/3 (40)"
  ]

  # GPU-only exclusions, applied where the default worker runs on a GPU
  # (bin/gpu). Examples on {:f, 64} tensors: the GPU refuses them with
  # ArgumentError (MLX's CUDA backend has no float64).
  gpu_f64 = [
    "Nx.LinAlg.solve/2 (44)",
    "Nx.LinAlg.triangular_solve/3 (27)",
    "Nx.LinAlg.triangular_solve/3 (31)",
    "Nx.LinAlg.triangular_solve/3 (32)",
    "Nx.LinAlg.triangular_solve/3 (41)",
    "Nx.LinAlg.triangular_solve/3 (42)",
    "Nx.acos/1 (443)",
    "Nx.acos/1 (466)",
    "Nx.acosh/1 (444)",
    "Nx.acosh/1 (467)",
    "Nx.all_close/3 (561)",
    "Nx.all_close/3 (562)",
    "Nx.as_type/2 (142)",
    "Nx.as_type/2 (145)",
    "Nx.as_type/2 (146)",
    "Nx.asin/1 (445)",
    "Nx.asin/1 (468)",
    "Nx.asinh/1 (446)",
    "Nx.asinh/1 (469)",
    "Nx.atan/1 (447)",
    "Nx.atan/1 (470)",
    "Nx.atan2/2 (333)",
    "Nx.atanh/1 (448)",
    "Nx.atanh/1 (471)",
    "Nx.cbrt/1 (449)",
    "Nx.cbrt/1 (472)",
    "Nx.cos/1 (450)",
    "Nx.cos/1 (473)",
    "Nx.cosh/1 (451)",
    "Nx.cosh/1 (474)",
    "Nx.erf/1 (452)",
    "Nx.erf/1 (475)",
    "Nx.erfc/1 (454)",
    "Nx.exp/1 (455)",
    "Nx.exp/1 (478)",
    "Nx.expm1/1 (456)",
    "Nx.expm1/1 (479)",
    "Nx.from_binary/3 (112)",
    "Nx.iota/2 (65)",
    "Nx.log/1 (465)",
    "Nx.log/1 (488)",
    "Nx.log1p/1 (457)",
    "Nx.rsqrt/1 (458)",
    "Nx.rsqrt/1 (481)",
    "Nx.sigmoid/1 (459)",
    "Nx.sigmoid/1 (482)",
    "Nx.sin/1 (460)",
    "Nx.sin/1 (483)",
    "Nx.sinh/1 (461)",
    "Nx.sinh/1 (484)",
    "Nx.sqrt/1 (462)",
    "Nx.sqrt/1 (485)",
    "Nx.tan/1 (463)",
    "Nx.tan/1 (486)",
    "Nx.tanh/1 (464)",
    "Nx.tanh/1 (487)",
    "Nx.tensor/2 (38)"
  ]

  # Other GPU-only differences. cuSOLVER's Cholesky (MLX's CUDA backend)
  # rounds one entry of this factor 1 ulp away from LAPACK's and Nx's
  # (1.5877134 for 1.5877135); re-run below within tolerance. f32 atan2,
  # phase and the exp/log of the other logsumexp examples, which CUDA's own
  # f32 functions put an ulp off, are computed in double on the GPU and pass.
  # MLX's CUDA column reduction adds the three exponentials of
  # logsumexp(axes: [:x]) in another order than Nx's left to right, which
  # shows in the last digit (5.142932 for 5.1429315).
  gpu_ulp = [
    "Nx.LinAlg.cholesky/1 (5)",
    "Nx.logsumexp/2 (974)"
  ]

  {gpu_linalg, gpu_nx} =
    if Moat.Worker.info().device == :gpu,
      do: Enum.split_with(gpu_f64 ++ gpu_ulp, &String.starts_with?(&1, "Nx.LinAlg.")),
      else: {[], []}

  @moduletag :nx_doctest
  doctest_examples(Nx, except_examples: @excluded_elementwise ++ @excluded_indexing ++ gpu_nx)
  doctest_examples(Nx.LinAlg, except_examples: @excluded_linalg ++ gpu_linalg)

  describe "excluded Nx.LinAlg examples, within tolerance" do
    test "cholesky" do
      l = Nx.LinAlg.cholesky(Nx.tensor([[[2.0, 3.0], [3.0, 5.0]], [[1.0, 0.0], [0.0, 1.0]]]))
      assert_close(l, [[[1.4142135, 0.0], [2.1213205, 0.7071065]], [[1.0, 0.0], [0.0, 1.0]]])

      t = Nx.tensor([[6.0, 3.0, 4.0, 8.0], [3.0, 6.0, 5.0, 1.0], [4.0, 5.0, 10.0, 7.0], [8.0, 1.0, 7.0, 25.0]])

      assert_close(Nx.LinAlg.cholesky(t), [
        [2.4494898, 0.0, 0.0, 0.0],
        [1.2247448, 2.1213202, 0.0, 0.0],
        [1.6329931, 1.4142138, 2.309401, 0.0],
        [3.2659862, -1.4142134, 1.5877135, 3.132491]
      ])
    end

    test "determinant" do
      t =
        Nx.tensor([
          [[2, 4, 6, 7], [5, 1, 8, 8], [1, 7, 3, 1], [3, 9, 2, 4]],
          [[2, 5, 1, 3], [4, 1, 7, 9], [6, 8, 3, 2], [7, 8, 1, 4]]
        ])

      assert_close(Nx.LinAlg.determinant(t), [630.0, 630.00006])
    end

    test "eigh" do
      a = Nx.tensor([[0, 1, 2], [1, 0, 2], [2, 2, 3]])
      {w, v} = Nx.LinAlg.eigh(a)
      assert_close(w, [5.0, -1.0, -1.0])
      # The eigenvectors of -1 are any orthonormal basis of their plane.
      assert_close(Nx.dot(Nx.multiply(v, w), [1], v, [1]), Nx.to_list(a))
      assert_close(Nx.dot(v, [0], v, [0]), Nx.to_list(Nx.eye(3)))

      {_, v} = Nx.LinAlg.eigh(Nx.tensor([[[2, 5], [5, 6]], [[1, 0], [0, 4]]]))
      assert_close(v, [[[0.56062883, 0.8280672], [0.8280672, -0.56062883]], [[0.0, 1.0], [1.0, 0.0]]])
    end

    test "least_squares" do
      assert_close(Nx.LinAlg.least_squares(Nx.tensor([[1, 2], [2, 3]]), Nx.tensor([1, 2])), [
        1.0000005,
        -2.3841858e-7
      ])

      a = Nx.tensor([[0, 1], [1, 1], [2, 1], [3, 1]])
      assert_close(Nx.LinAlg.least_squares(a, Nx.tensor([-1, 0.2, 0.9, 2.1])), [1.0000001, -0.95000035])

      a = Nx.tensor([[1, 2, 3], [4, 5, 6]])
      assert_close(Nx.LinAlg.least_squares(a, Nx.tensor([1, 2])), [-0.055555582, 0.111111075, 0.27777776])
    end

    test "lu" do
      t = Nx.tensor([[[9, 8, 7], [6, 5, 4], [3, 2, 1]], [[-1, 0, -1], [1, 0, 1], [1, 1, 1]]])
      {p, l, u} = Nx.LinAlg.lu(t)
      assert_close(p |> Nx.dot([2], [0], l, [1], [0]) |> Nx.dot([2], [0], u, [1], [0]), Nx.to_list(t))
    end

    test "matrix_power" do
      expected = [[[-4.875, 1.375], [2.75, -0.75]], [[-110.37471, 76.87479], [92.24976, -64.24983]]]
      assert_close(Nx.LinAlg.matrix_power(Nx.iota({2, 2, 2}), -3), expected)
    end

    test "pinv" do
      assert_close(Nx.LinAlg.pinv(Nx.tensor([[1, 1], [3, 4]])), [
        [4.0000577, -1.0000169],
        [-3.000044, 1.000013]
      ])

      assert_close(Nx.LinAlg.pinv(Nx.tensor([[0.5, 0], [0, 1], [0.5, 0]])), [
        [0.99999994, 0.0, 0.99999994],
        [0.0, 1.0, 0.0]
      ])
    end

    test "qr" do
      t = Nx.tensor([[3, 2, 1], [0, 1, 1], [0, 0, 1], [0, 0, 1]], type: :f32)
      {q, r} = Nx.LinAlg.qr(t, mode: :reduced)
      assert_close(q, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.7071068], [0.0, 0.0, 0.70710677]])
      assert_close(r, [[3.0, 2.0, 1.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.4142137]])
    end

    test "solve" do
      a = Nx.tensor([[1, 3, 2, 1], [2, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])
      assert_close(Nx.LinAlg.solve(a, Nx.tensor([-3, 0, 4, -2])), [1.0, -2.0, 3.0000002, -4.0])

      a = Nx.tensor([[[14, 10], [9, 9]], [[4, 11], [2, 3]]])
      b = Nx.tensor([[[2, 4], [3, 2]], [[1, 5], [-3, -1]]])
      expected = [[[-0.3333333, 0.44444442], [0.6666666, -0.2222222]], [[-3.6, -2.6], [1.4, 1.4]]]
      assert_close(Nx.LinAlg.solve(a, b), expected)
    end

    test "svd" do
      {u, s, vt} = Nx.LinAlg.svd(Nx.tensor([[2, 0, 0], [0, 3, 0], [0, 0, -1], [0, 0, 0]]))

      assert_close(u, [
        [0.0, 0.99999994, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, -1.0, 0.0],
        [0.0, 0.0, 0.0, 1.0]
      ])

      assert_close(s, [3.0, 1.9999999, 1.0])
      assert_close(vt, [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    end

    test "triangular_solve of a singular matrix" do
      a = Nx.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
      x = Nx.LinAlg.triangular_solve(a, Nx.tensor([4, 2, 4, 2]))
      assert_raise Moat.Error, ~r/triangular inversion failed/, fn -> Nx.to_binary(x) end
    end
  end

  defp assert_close(%Nx.Tensor{} = actual, expected) do
    Nx.with_default_backend(Nx.BinaryBackend, fn ->
      expected = Nx.tensor(expected, type: actual.type)
      actual = Nx.backend_copy(actual, Nx.BinaryBackend)
      close = Nx.all_close(actual, expected, rtol: 1.0e-4, atol: 1.0e-5) |> Nx.to_number()
      assert close == 1, "#{inspect(actual)}\nis not close to\n#{inspect(expected)}"
    end)
  end
end

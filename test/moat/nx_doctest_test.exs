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
    # f8 and f8_e4m3fn tensors: MLX has no such types (Moat raises ArgumentError).
    "Nx.tensor/2 (42)",
    "Nx.tensor/2 (43)",
    "Nx.tensor/2 (44)",
    # A u2 tensor: MLX has no 2-bit integers (Moat raises ArgumentError).
    "Nx.bit_size/1 (254)",
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

  @moduletag :nx_doctest
  doctest_examples(Nx, except_examples: @excluded_elementwise ++ @excluded_indexing)
end

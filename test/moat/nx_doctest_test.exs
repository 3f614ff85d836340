defmodule Moat.NxDoctestTest do
  # Nx's own doctests with Moat.Backend as the default backend. Every
  # exclusion carries a one-line reason.
  use ExUnit.Case, async: false

  setup do
    Nx.default_backend(Moat.Backend)
    # Nx's expected output has no backend signature line.
    Application.put_env(:moat, :inspect_backend, false)
    on_exit(fn -> Application.delete_env(:moat, :inspect_backend) end)
    :ok
  end

  # Element-wise, shape, reductions, sorting, creation.
  @excluded_elementwise [
    # Examples build f8, f8_e4m3fn and u2 tensors, which MLX cannot hold (Moat raises).
    tensor: 2,
    # One example builds a u2 tensor, which MLX cannot hold.
    bit_size: 1,
    # Nx's f64 erf_inv is an approximation good to ~3e-8; Moat's is within an ulp of
    # the true value (erf_inv(0.1) = 0.0888559904942577, Nx shows 0.08885598780483887).
    erf_inv: 1,
    # f64 erfc(2) is 1 ulp away: 0.004677734981047266 against Erlang's ...265.
    erfc: 1,
    # f64 log1p(2) is 1 ulp away: libm's log1p (MLX) against Nx's log(1 + x).
    log1p: 1
  ]

  # Indexing, dot/conv, linear algebra, windows, FFT.
  @excluded_indexing []

  @moduletag :nx_doctest
  doctest Nx, except: @excluded_elementwise ++ @excluded_indexing
end

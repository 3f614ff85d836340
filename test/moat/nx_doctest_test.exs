defmodule Moat.NxDoctestTest do
  # Nx's own doctests with Moat.Backend as the default backend. Every
  # exclusion carries a one-line reason.
  use ExUnit.Case, async: false

  setup do
    Nx.default_backend(Moat.Backend)
    :ok
  end

  # Element-wise, shape, reductions, sorting, creation.
  @excluded_elementwise []

  # Indexing, dot/conv, linear algebra, windows, FFT.
  @excluded_indexing []

  # Nx.LinAlg.
  @excluded_linalg []

  @moduletag :nx_doctest
  doctest Nx, except: @excluded_elementwise ++ @excluded_indexing
  doctest Nx.LinAlg, except: @excluded_linalg
end

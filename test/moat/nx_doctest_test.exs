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
  @excluded_elementwise []

  # Indexing, dot/conv, linear algebra, windows, FFT.
  @excluded_indexing []

  @moduletag :nx_doctest
  doctest Nx, except: @excluded_elementwise ++ @excluded_indexing
end

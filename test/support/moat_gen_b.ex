defmodule Moat.GenB do
  @moduledoc false
  # A small seeded generator for the property tests of indexing, dot/conv,
  # linear algebra, windows, FFT and integer division: every run reseeds
  # `:rand` (exsss) so a failure is reproduced by its seed alone.

  import ExUnit.Assertions

  @int_types [{:u, 8}, {:u, 16}, {:u, 32}, {:u, 64}, {:s, 8}, {:s, 16}, {:s, 32}, {:s, 64}]
  @float_types [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}]

  def int_types, do: @int_types
  def float_types, do: @float_types
  def real_types, do: @int_types ++ @float_types
  def all_types, do: real_types() ++ [{:c, 64}]

  @doc """
  Runs `fun` `runs` times, each after seeding `:rand` with the next seed
  from `MOAT_SEED` (default `base`). A failure names its seed.
  """
  def check(name, runs, base, fun) do
    first = String.to_integer(System.get_env("MOAT_SEED", "#{base}"))

    for seed <- first..(first + runs - 1) do
      :rand.seed(:exsss, seed)

      try do
        fun.()
      rescue
        e ->
          reraise ExUnit.AssertionError,
                  [message: "#{name} failed with MOAT_SEED=#{seed}:\n" <> Exception.message(e)],
                  __STACKTRACE__
      end
    end

    :ok
  end

  @doc "An integer in lo..hi."
  def int(lo, hi), do: lo + :rand.uniform(hi - lo + 1) - 1

  def pick(list), do: Enum.at(list, :rand.uniform(length(list)) - 1)

  def bool, do: :rand.uniform(2) == 1

  @doc "A shape of `rank` dimensions in `lo..hi`."
  def shape(rank, lo \\ 1, hi \\ 4), do: List.to_tuple(for _ <- 1..rank//1, do: int(lo, hi))

  @doc "A random subset of `list`, in order."
  def subset(list), do: Enum.filter(list, fn _ -> bool() end)

  @doc """
  A tensor on Nx.BinaryBackend. Integers cover the type's whole range when
  `:full` is true (wrapping arithmetic), else small values; floats are
  small integers and halves (exact in every float type) or normal values.
  """
  def tensor(shape, type, opts \\ [])

  def tensor(shape, {:c, 64}, opts),
    do: Nx.complex(tensor(shape, {:f, 32}, opts), tensor(shape, {:f, 32}, opts))

  def tensor(shape, type, opts) do
    n = Tuple.product(shape)
    values = for _ <- 1..n//1, do: value(type, opts)
    Nx.tensor(values, type: type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
  end

  defp value({:u, bits}, opts), do: if(opts[:full], do: int(0, 2 ** bits - 1), else: int(0, 9))

  defp value({:s, bits}, opts) do
    if opts[:full], do: int(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1), else: int(-9, 9)
  end

  defp value(_float, opts) do
    if opts[:exact] == false, do: :rand.normal(), else: int(-16, 16) / 2
  end

  @doc "Integer indices in 0..(dim - 1) of `shape`, of a random integer type."
  def indices(shape, dim) do
    type = pick([{:s, 32}, {:s, 64}, {:u, 8}, {:u, 32}, {:u, 64}])
    dim = min(dim, if(type == {:u, 8}, do: 256, else: dim))
    values = for _ <- 1..Tuple.product(shape)//1, do: int(0, dim - 1)
    Nx.tensor(values, type: type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
  end

  @doc "The same tensor on Moat.Backend."
  def moat(%Nx.Tensor{} = t), do: Nx.backend_copy(t, Moat.Backend)

  @doc "Reads a Moat result back onto Nx.BinaryBackend."
  def back(tuple) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> Enum.map(&back/1) |> List.to_tuple()
  def back(%Nx.Tensor{} = t), do: Nx.backend_transfer(t, Nx.BinaryBackend)

  @doc """
  Asserts that two BinaryBackend tensors agree: same shape and type, equal
  integers, floats within `rtol`/`atol` (NaN matching NaN).
  """
  def assert_same(actual, expected, opts \\ []) do
    assert actual.shape == expected.shape, "shape #{inspect(actual.shape)} != #{inspect(expected.shape)}"
    assert actual.type == expected.type, "type #{inspect(actual.type)} != #{inspect(expected.type)}"

    cond do
      Nx.size(actual) == 0 ->
        :ok

      Nx.Type.float?(actual.type) or Nx.Type.complex?(actual.type) ->
        {rtol, atol} = tolerance(actual.type, opts)
        close = Nx.all_close(actual, expected, rtol: rtol, atol: atol, equal_nan: true) |> Nx.to_number()
        assert close == 1, "not close (rtol #{rtol}, atol #{atol}):\n#{inspect(actual)}\n#{inspect(expected)}"

      true ->
        assert Nx.to_binary(actual) == Nx.to_binary(expected), "#{inspect(actual)}\n!=\n#{inspect(expected)}"
    end
  end

  # Half floats keep their own (looser) tolerance; `opts` apply to wider types.
  defp tolerance({:f, 16}, _opts), do: {1.0e-2, 1.0e-2}
  defp tolerance({:bf, 16}, _opts), do: {3.0e-2, 3.0e-2}
  defp tolerance({:f, 64}, opts), do: {Keyword.get(opts, :rtol, 1.0e-12), Keyword.get(opts, :atol, 1.0e-12)}
  defp tolerance(_type, opts), do: {Keyword.get(opts, :rtol, 1.0e-5), Keyword.get(opts, :atol, 1.0e-5)}
end

defmodule Moat.Gen do
  @moduledoc false
  # A small seeded generator of shapes, types and tensors for property tests
  # (no StreamData here). Every case runs under its own seed, derived from
  # the base seed (MOAT_PROP_SEED, else ExUnit's --seed), the property's
  # name and the case number; a failure names the seed that replays it.

  import ExUnit.Assertions

  @ints [{:u, 8}, {:u, 16}, {:u, 32}, {:u, 64}, {:s, 8}, {:s, 16}, {:s, 32}, {:s, 64}]
  @floats [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}]

  def int_types, do: @ints
  def float_types, do: @floats
  def real_types, do: @ints ++ @floats
  def all_types, do: @ints ++ @floats ++ [{:c, 64}]

  def base_seed do
    case System.get_env("MOAT_PROP_SEED") do
      nil -> ExUnit.configuration()[:seed] || 0
      seed -> String.to_integer(seed)
    end
  end

  @doc """
  Runs `fun` `cases` times, each under a fresh seed. A failing case is
  re-raised with the seed and how to replay it.
  """
  def check(name, cases, fun) do
    base = base_seed()

    for i <- 1..cases do
      seed = :erlang.phash2({base, name, i})
      :rand.seed(:exsss, seed)

      try do
        fun.()
      rescue
        e in [ExUnit.AssertionError] ->
          message =
            "#{name}, case #{i} (MOAT_PROP_SEED=#{base}, case seed #{seed}):\n" <>
              Exception.message(e)

          reraise ExUnit.AssertionError, [message: message], __STACKTRACE__
      end
    end

    :ok
  end

  def one_of(list), do: Enum.at(list, :rand.uniform(length(list)) - 1)

  def int(min, max), do: min + :rand.uniform(max - min + 1) - 1

  def chance(p), do: :rand.uniform() < p

  @doc "A shape of rank `0..max_rank` with dims `1..max_dim`."
  def shape(max_rank \\ 3, max_dim \\ 4, min_rank \\ 0) do
    rank = int(min_rank, max_rank)
    List.to_tuple(for _ <- 1..rank//1, do: int(1, max_dim))
  end

  @doc """
  A tensor on Nx.BinaryBackend. Options:

    * `:range` - `{min, max}` for the values (clamped to the type)
    * `:specials` - the chance of NaN/inf/-inf/-0.0 per float (default 0.1)
  """
  def tensor(shape, type, opts \\ []) do
    n = Tuple.product(shape)
    values = for _ <- 1..n//1, do: value(type, opts)
    Nx.tensor(values, type: type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
  end

  def value({:c, _}, opts) do
    Complex.new(value({:f, 32}, opts), value({:f, 32}, opts))
  end

  def value({kind, bits} = type, opts) when kind in [:s, :u] do
    {tmin, tmax} = bounds(type)

    {min, max} =
      case opts[:range] do
        {a, b} -> {max(a, tmin), min(b, tmax)}
        nil -> if chance(0.5), do: {max(-20, tmin), min(20, tmax)}, else: {tmin, tmax}
      end

    _ = bits
    int(trunc(min), trunc(max))
  end

  def value(_float, opts) do
    specials = Keyword.get(opts, :specials, 0.1)

    if chance(specials) do
      one_of([:nan, :infinity, :neg_infinity, -0.0, 0.0])
    else
      {min, max} = opts[:range] || {-10.0, 10.0}
      x = min + :rand.uniform() * (max - min)
      # Some exact integers and halves, where rounding rules show.
      # (+ 0.0 turns -0.0 into 0.0: signed zeros have their own cases.)
      half = Float.round(x * 2) / 2 + 0.0
      if chance(0.2) and half >= min and half <= max, do: half, else: x
    end
  end

  def bounds({:u, bits}), do: {0, Integer.pow(2, bits) - 1}
  def bounds({:s, bits}), do: {-Integer.pow(2, bits - 1), Integer.pow(2, bits - 1) - 1}

  @doc "The tolerance `{rtol, atol}` for comparing results of a float type."
  def tolerance({:f, 16}), do: {2.0e-3, 1.0e-3}
  def tolerance({:bf, 16}), do: {1.6e-2, 1.0e-2}
  def tolerance({:f, 32}), do: {2.0e-6, 1.0e-6}
  def tolerance({:f, 64}), do: {1.0e-13, 1.0e-14}
  def tolerance({:c, 64}), do: {2.0e-6, 1.0e-6}
  def tolerance(_int), do: {0, 0}

  @doc """
  Asserts that `actual` (on Moat) matches `expected` (on Nx.BinaryBackend):
  same shape and type, integers exact, floats within `tolerance` (NaN
  matches NaN, infinities match exactly).
  """
  def assert_close(expected, actual, context, opts \\ []) do
    assert actual.shape == expected.shape, "shape #{inspect(actual.shape)} != #{inspect(expected.shape)}\n#{context}"
    assert actual.type == expected.type, "type #{inspect(actual.type)} != #{inspect(expected.type)}\n#{context}"

    {rtol, atol} = Keyword.get(opts, :tolerance, tolerance(expected.type))
    exp_list = Nx.to_flat_list(expected)
    act_list = Nx.to_flat_list(Nx.backend_copy(actual, Nx.BinaryBackend))

    mismatches =
      Enum.zip([exp_list, act_list, 0..(length(exp_list) - 1)//1])
      |> Enum.reject(fn {e, a, _} -> close?(e, a, rtol, atol) end)

    assert mismatches == [],
           "#{length(mismatches)} of #{length(exp_list)} elements differ " <>
             "(index, expected, actual): #{inspect(Enum.take(Enum.map(mismatches, fn {e, a, i} -> {i, e, a} end), 8))}\n" <>
             context
  end

  defp close?(%Complex{re: er, im: ei}, %Complex{re: ar, im: ai}, rtol, atol),
    do: close?(er, ar, rtol, atol) and close?(ei, ai, rtol, atol)

  defp close?(e, e, _, _), do: true
  defp close?(e, a, _, _) when is_atom(e) or is_atom(a), do: false
  defp close?(e, a, _, _) when is_integer(e) and is_integer(a), do: false
  defp close?(e, a, rtol, atol), do: abs(e - a) <= atol + rtol * abs(e)

  @doc "Describes inputs for a failure message."
  def describe(inputs) do
    inputs
    |> Enum.map(fn
      %Nx.Tensor{} = t -> "#{inspect(t.type)} #{inspect(t.shape)}: #{inspect(Nx.to_flat_list(t), limit: 40)}"
      list when is_list(list) -> describe(list)
      other -> inspect(other)
    end)
    |> Enum.join("\n")
  end
end

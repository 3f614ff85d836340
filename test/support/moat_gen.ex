defmodule Moat.Gen do
  @moduledoc false
  # A small seeded generator of shapes, types and tensors for the property
  # tests (no StreamData here), and the comparison of Moat's results with
  # Nx.BinaryBackend's. Every case runs under its own seed, derived from the
  # base seed (MOAT_PROP_SEED, else ExUnit's --seed), the property's name
  # and the case number; a failure prints the command that replays it.

  import ExUnit.Assertions

  @ints [{:u, 8}, {:u, 16}, {:u, 32}, {:u, 64}, {:s, 8}, {:s, 16}, {:s, 32}, {:s, 64}]
  @floats [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}]

  def int_types, do: @ints
  def real_types, do: @ints ++ float_types()
  def all_types, do: @ints ++ float_types() ++ [{:c, 64}]

  # A GPU worker refuses f64 with an ArgumentError (test/moat/gpu_test.exs):
  # there the properties draw the float types it has.
  def float_types do
    if Map.get(Moat.Worker.info(), :device) == :gpu, do: @floats -- [{:f, 64}], else: @floats
  end

  @doc "f32 and, where the worker has it (not on a GPU), f64."
  def wide_floats, do: float_types() -- [{:f, 16}, {:bf, 16}]

  # Held in a storage type by Moat.Backend (Moat.Types): MLX has none of them.
  @small_ints [{:s, 2}, {:s, 4}, {:u, 2}, {:u, 4}]
  @f8 [{:f, 8}, {:f8_e4m3fn, 8}]
  def small_int_types, do: @small_ints
  def f8_types, do: @f8
  def emulated_types, do: @small_ints ++ @f8 ++ [{:c, 128}]

  @doc """
  Runs `fun` `cases` times, each under a fresh seed. A failing case (a
  failed assertion or any exception) fails the test with the command that
  replays it: the base seed and the location of the `check`.
  """
  defmacro check(name, cases, fun) do
    location = {__CALLER__.file, __CALLER__.line}

    quote do
      Moat.Gen.run_check(unquote(name), unquote(cases), unquote(location), unquote(fun))
    end
  end

  @doc false
  def run_check(name, cases, {file, line}, fun) do
    base = base_seed()

    for i <- 1..cases do
      :rand.seed(:exsss, :erlang.phash2({base, name, i}))

      try do
        fun.()
      rescue
        e ->
          replay =
            "property #{inspect(name)} failed on case #{i} of #{cases}; replay it with\n" <>
              "    MOAT_PROP_SEED=#{base} mix test #{Path.relative_to_cwd(file)}:#{line}\n"

          reraise failure(e, replay), __STACKTRACE__
      end
    end

    :ok
  end

  defp base_seed do
    case System.get_env("MOAT_PROP_SEED") do
      nil -> ExUnit.configuration()[:seed] || 0
      seed -> String.to_integer(seed)
    end
  end

  # An assertion keeps its expression and values; anything else becomes one.
  defp failure(%ExUnit.AssertionError{} = e, replay), do: %{e | message: replay <> e.message}
  defp failure(e, replay), do: %ExUnit.AssertionError{message: replay <> Exception.format_banner(:error, e)}

  def one_of(list), do: Enum.at(list, :rand.uniform(length(list)) - 1)

  def int(min, max), do: min + :rand.uniform(max - min + 1) - 1

  def chance(p), do: :rand.uniform() < p

  @doc "A random sub-list of `list`, in order."
  def subset(list), do: Enum.filter(list, fn _ -> chance(0.5) end)

  @doc """
  A shape. Options (an integer or a range each):

    * `:rank` - the number of dimensions (default `0..3`)
    * `:dims` - each dimension (default `1..4`)
  """
  def shape(opts \\ []) do
    rank = pick_in(Keyword.get(opts, :rank, 0..3))
    dims = Keyword.get(opts, :dims, 1..4)
    List.to_tuple(for _ <- 1..rank//1, do: pick_in(dims))
  end

  defp pick_in(n) when is_integer(n), do: n
  defp pick_in(min..max//1), do: int(min, max)

  @doc """
  A tensor on Nx.BinaryBackend. Options:

    * `:range` - `{min, max}` for the values (clamped to the type), or
      `:full` for an integer type's whole range. By default integers are
      small (within +-20) or anywhere in the type, even odds per element;
      floats are within +-10.
    * `:specials` - the chance of NaN/inf/-inf/-0.0/0.0 per float (default 0.1)
    * `:halves` - the chance that a float is a multiple of 0.5, where
      rounding rules show (default 0.2); with 1.0 and a small range every
      value is exact in every float type, so sums of them are too
  """
  def tensor(shape, type, opts \\ []) do
    n = Tuple.product(shape)
    values = for _ <- 1..n//1, do: value(type, opts)
    Nx.tensor(values, type: type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
  end

  defp value({:c, _}, opts) do
    Complex.new(value({:f, 32}, opts), value({:f, 32}, opts))
  end

  defp value({kind, _} = type, opts) when kind in [:s, :u] do
    {tmin, tmax} = bounds(type)

    {min, max} =
      case opts[:range] do
        {a, b} -> {max(trunc(a), tmin), min(trunc(b), tmax)}
        :full -> {tmin, tmax}
        nil -> if chance(0.5), do: {max(-20, tmin), min(20, tmax)}, else: {tmin, tmax}
      end

    int(min, max)
  end

  defp value(_float, opts) do
    if chance(Keyword.get(opts, :specials, 0.1)) do
      one_of([:nan, :infinity, :neg_infinity, -0.0, 0.0])
    else
      {min, max} = opts[:range] || {-10.0, 10.0}
      x = min + :rand.uniform() * (max - min)
      # (+ 0.0 turns -0.0 into 0.0: signed zeros come with the specials.)
      half = Float.round(x * 2) / 2 + 0.0
      if chance(Keyword.get(opts, :halves, 0.2)) and half >= min and half <= max, do: half, else: x
    end
  end

  defp bounds({:u, bits}), do: {0, Integer.pow(2, bits) - 1}
  defp bounds({:s, bits}), do: {-Integer.pow(2, bits - 1), Integer.pow(2, bits - 1) - 1}

  @doc "Integer indices in `0..(dim - 1)` of `shape`, of a random integer type."
  def indices(shape, dim) do
    type = one_of([{:s, 32}, {:s, 64}, {:u, 8}, {:u, 32}, {:u, 64}])
    dim = if type == {:u, 8}, do: min(dim, 256), else: dim
    values = for _ <- 1..Tuple.product(shape)//1, do: int(0, dim - 1)
    Nx.tensor(values, type: type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
  end

  @doc "`t` with its zeros replaced by ones (divisors: Nx.BinaryBackend raises on zero)."
  def nonzero(t), do: Nx.select(Nx.equal(t, 0), Nx.tensor(1, type: t.type, backend: Nx.BinaryBackend), t)

  @doc "The same tensors (in lists too) on Moat.Backend; anything else as it is."
  def moat(%Nx.Tensor{} = t), do: Nx.backend_copy(t, Moat.Backend)
  def moat(list) when is_list(list), do: Enum.map(list, &moat/1)
  def moat(other), do: other

  @doc """
  Runs `fun` on `inputs` on Nx.BinaryBackend and on Moat.Backend (the
  inputs copied there) and asserts that Moat's results are Moat tensors
  close to Nx.BinaryBackend's (see `assert_close/3`; `:label` names the
  case in a failure).
  """
  def same(inputs, fun, opts \\ []) do
    expected = on(Nx.BinaryBackend, fn -> apply(fun, inputs) end)
    actual = on(Moat.Backend, fn -> apply(fun, moat(inputs)) end)
    context = "#{opts[:label]} inputs:\n" <> describe(inputs)
    assert_on_moat(actual, context)
    assert_close(expected, actual, Keyword.put(opts, :context, context))
  end

  defp assert_on_moat(%Nx.Tensor{} = t, context),
    do: assert(%Moat.Backend{} = t.data, "result is not on Moat.Backend\n#{context}")

  defp assert_on_moat(tuple, context) when is_tuple(tuple), do: assert_on_moat(Tuple.to_list(tuple), context)
  defp assert_on_moat(list, context) when is_list(list), do: Enum.each(list, &assert_on_moat(&1, context))

  defp on(backend, fun) do
    previous = Nx.default_backend(backend)

    try do
      fun.()
    after
      Nx.default_backend(previous)
    end
  end

  @doc "The tolerance `{rtol, atol}` for results of a type after one rounding."
  def tolerance({:f, 16}), do: {2.0e-3, 1.0e-3}
  def tolerance({:bf, 16}), do: {1.6e-2, 1.0e-2}
  def tolerance({:f, 32}), do: {2.0e-6, 1.0e-6}
  def tolerance({:f, 64}), do: {1.0e-13, 1.0e-14}
  def tolerance({:c, 64}), do: {2.0e-6, 1.0e-6}
  def tolerance(_int), do: {0, 0}

  @doc """
  Asserts that `actual` (on any backend) matches `expected` (on
  Nx.BinaryBackend), tensors or tuples or lists of them: same shapes and
  types, integers exact, floats within the tolerance (NaN matches NaN,
  infinities match exactly; complex numbers part by part). Options:

    * `:tolerance` - `{rtol, atol}`, or a function of the result's type
      returning one (default `tolerance/1`)
    * `:context` - what the failure message adds
  """
  def assert_close(expected, actual, opts \\ [])

  def assert_close(%Nx.Tensor{} = expected, %Nx.Tensor{} = actual, opts) do
    context = Keyword.get(opts, :context, "")
    assert actual.shape == expected.shape, "shape #{inspect(actual.shape)} != #{inspect(expected.shape)}\n#{context}"
    assert actual.type == expected.type, "type #{inspect(actual.type)} != #{inspect(expected.type)}\n#{context}"

    {rtol, atol} =
      case Keyword.get(opts, :tolerance, &tolerance/1) do
        fun when is_function(fun, 1) -> fun.(expected.type)
        tolerance -> tolerance
      end

    exp_list = Nx.to_flat_list(expected)
    act_list = Nx.to_flat_list(Nx.backend_copy(actual, Nx.BinaryBackend))

    mismatches =
      Enum.zip([exp_list, act_list, 0..(length(exp_list) - 1)//1])
      |> Enum.reject(fn {e, a, _} -> close?(e, a, rtol, atol) end)

    assert mismatches == [],
           "#{length(mismatches)} of #{length(exp_list)} elements differ (rtol #{rtol}, atol #{atol}) " <>
             "(index, expected, actual): #{inspect(Enum.take(Enum.map(mismatches, fn {e, a, i} -> {i, e, a} end), 8))}\n" <>
             context
  end

  def assert_close(expected, actual, opts) when is_tuple(expected) and is_tuple(actual),
    do: assert_close(Tuple.to_list(expected), Tuple.to_list(actual), opts)

  def assert_close(expected, actual, opts) when is_list(expected) and is_list(actual) do
    assert length(actual) == length(expected),
           "#{length(actual)} results, expected #{length(expected)}\n#{opts[:context]}"

    Enum.zip(expected, actual) |> Enum.each(fn {e, a} -> assert_close(e, a, opts) end)
  end

  defp close?(%Complex{re: er, im: ei}, %Complex{re: ar, im: ai}, rtol, atol),
    do: close?(er, ar, rtol, atol) and close?(ei, ai, rtol, atol)

  defp close?(e, e, _, _), do: true
  defp close?(e, a, _, _) when is_atom(e) or is_atom(a), do: false
  defp close?(e, a, _, _) when is_integer(e) and is_integer(a), do: false
  defp close?(e, a, rtol, atol), do: abs(e - a) <= atol + rtol * abs(e)

  # Inputs, for a failure message.
  defp describe(inputs) do
    inputs
    |> Enum.map(fn
      %Nx.Tensor{} = t -> "#{inspect(t.type)} #{inspect(t.shape)}: #{inspect(Nx.to_flat_list(t), limit: 40)}"
      list when is_list(list) -> describe(list)
      other -> inspect(other)
    end)
    |> Enum.join("\n")
  end
end

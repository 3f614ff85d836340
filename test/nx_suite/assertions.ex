defmodule NxSuite.Assertions do
  @moduledoc false
  # Part of bin/nx-suite (Nx's own ExUnit suite run on Moat). Nx's tests
  # compare tensors with `assert a == b`, which on Nx.BinaryBackend compares
  # their data. A Moat tensor holds a handle, so two equal tensors are not
  # `==`. Every `==`/`!=` directly under `assert`/`refute` compares
  # Nx.BinaryBackend copies of both sides instead: values (and shape, type,
  # names), nothing else. Every other assertion is ExUnit's own.

  defmacro assert({op, meta, [left, right]}) when op in [:==, :!=] do
    quote do: ExUnit.Assertions.assert(unquote({op, meta, [host(left), host(right)]}))
  end

  defmacro assert(expr), do: quote(do: ExUnit.Assertions.assert(unquote(expr)))

  defmacro refute({op, meta, [left, right]}) when op in [:==, :!=] do
    quote do: ExUnit.Assertions.refute(unquote({op, meta, [host(left), host(right)]}))
  end

  defmacro refute(expr), do: quote(do: ExUnit.Assertions.refute(unquote(expr)))

  defp host(ast), do: quote(do: NxSuite.Assertions.to_host(unquote(ast)))

  @doc false
  # Nx.Helpers (test/support/helpers.ex) checks `Nx.all_close(...) ==
  # Nx.tensor(1, type: {:u, 8})` outside any assert; bin/nx-suite points it
  # here and makes the right side an Nx.BinaryBackend tensor.
  def host_all_close(a, b, opts), do: to_host(Nx.all_close(a, b, opts))

  @doc false
  # Copies every tensor of another backend in a term to Nx.BinaryBackend.
  def to_host(%Nx.Tensor{data: %Nx.BinaryBackend{}} = t), do: t
  def to_host(%Nx.Tensor{data: %Nx.Defn.Expr{}} = t), do: t
  def to_host(%Nx.Tensor{data: %Nx.TemplateBackend{}} = t), do: t
  def to_host(%Nx.Tensor{data: %Moat.Backend{}} = t), do: Nx.backend_copy(t, Nx.BinaryBackend)
  def to_host(%Nx.Tensor{} = t), do: t
  def to_host(tuple) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> Enum.map(&to_host/1) |> List.to_tuple()
  def to_host([head | tail]), do: [to_host(head) | to_host(tail)]
  def to_host(%{__struct__: _} = struct), do: Map.merge(struct, to_host(Map.from_struct(struct)))
  def to_host(%{} = map), do: Map.new(map, fn {k, v} -> {k, to_host(v)} end)
  def to_host(other), do: other
end

defmodule NxSuite.DocTest do
  @moduledoc false
  # A doctest whose expected value is an expression (`Nx.tensor(...)`, a
  # struct holding tensors) is compared by ExUnit with a pin (`^expected`),
  # structurally: two equal Moat tensors hold different handles. This
  # `doctest` is ExUnit's, with both sides of that comparison copied to
  # Nx.BinaryBackend first (as `assert a == b` above); `#Nx.Tensor<...>`
  # expectations (compared by `inspect`) are unchanged.
  defmacro doctest(module, opts \\ []) do
    quote bind_quoted: [module: module, opts: opts, env_line: __CALLER__.line, env_file: __CALLER__.file] do
      require ExUnit.DocTest
      file = ExUnit.DocTest.__file__(module)

      for {name, test, tags} <- ExUnit.DocTest.__doctests__(module, opts) do
        @file file
        doc = ExUnit.Case.register_test(__MODULE__, env_file, env_line, :doctest, name, tags)
        def unquote(doc)(_), do: unquote(NxSuite.DocTest.host_values(test))
      end
    end
  end

  @doc false
  def host_values(test) do
    Macro.prewalk(test, fn
      {{:., m1, [{:__aliases__, _, [:ExUnit, :DocTest]}, :__test__]}, m2, [value, expected | rest]} ->
        {{:., m1, [ExUnit.DocTest, :__test__]}, m2,
         [
           quote(do: NxSuite.Assertions.to_host(unquote(value))),
           quote(do: NxSuite.Assertions.to_host(unquote(expected))) | rest
         ]}

      other ->
        other
    end)
  end
end

defmodule NxSuite.Swap do
  @moduledoc false
  # `use NxSuite.Swap` after `use ExUnit.Case`/`use Nx.Case` puts
  # NxSuite.Assertions' assert/refute in place of ExUnit's and makes Moat
  # the default backend of every test process (the process default, not the
  # global one: test files are compiled while earlier ones already run, and
  # their module attributes, such as `@t Nx.tensor(...)`, must stay
  # escapable Nx.BinaryBackend tensors).
  defmacro __using__(_opts) do
    quote do
      import ExUnit.Assertions, except: [assert: 1, refute: 1]
      import NxSuite.Assertions, only: [assert: 1, refute: 1]
      import ExUnit.DocTest, only: [doctest_file: 1, doctest_file: 2]
      import NxSuite.DocTest, only: [doctest: 1, doctest: 2]

      if System.get_env("NX_SUITE_BACKEND") != "binary" do
        setup do
          Nx.default_backend(Moat.Backend)
          :ok
        end
      end

      # bin/nx-suite --compiler: Moat.Compiler is the defn compiler.
      if System.get_env("NX_SUITE_COMPILER") == "moat" do
        setup do
          Nx.Defn.default_options(compiler: Moat.Compiler)
          :ok
        end
      end
    end
  end
end

defmodule Moat.DocTests do
  @moduledoc false
  # ExUnit's `doctest/2`, with exclusions that name single examples
  # ("Nx.tensor/2 (5)", as ExUnit names them) besides whole functions, so one
  # example that cannot pass does not take its passing neighbours with it.
  # It expands the way ExUnit's own macro does (ExUnit.DocTest.__doctests__/2).

  defmacro doctest_examples(module, opts) do
    quote bind_quoted: [module: module, opts: opts, env_line: __CALLER__.line, env_file: __CALLER__.file] do
      file = ExUnit.DocTest.__file__(module)
      except_examples = Keyword.get(opts, :except_examples, [])
      doctests = ExUnit.DocTest.__doctests__(module, Keyword.take(opts, [:except]))
      names = for {name, _, _} <- doctests, do: name

      case except_examples -- names do
        [] -> :ok
        stale -> raise ArgumentError, "excluded doctests that do not exist: #{inspect(stale)}"
      end

      for {name, test, tags} <- doctests, name not in except_examples do
        @file file
        doc = ExUnit.Case.register_test(__MODULE__, env_file, env_line, :doctest, name, tags)
        def unquote(doc)(_), do: unquote(test)
      end
    end
  end
end

defmodule Moat.NotebookRunner do
  @moduledoc false
  # Runs a Livebook notebook (.livemd) the way Livebook's default runtime
  # does: a fresh VM, then every ```elixir cell in order, each evaluated
  # with the binding and the environment (aliases, imports, requires) the
  # cells before it left; the first cell is the notebook's Mix.install.
  #
  #   elixir test/support/run_notebook.exs --run NOTEBOOK
  #
  # (--run: the test that requires this file runs under `mix test ARGS`,
  # whose arguments System.argv/0 returns too.)

  @doc "The notebook's elixir cells, in order."
  @spec cells(Path.t()) :: [String.t()]
  def cells(path) do
    ~r/^```elixir\n(.*?)^```$/ms
    |> Regex.scan(File.read!(path), capture: :all_but_first)
    |> Enum.map(fn [code] -> code end)
  end

  @doc """
  Runs the notebook at `path`; prints each cell's number as it starts and
  halts with status 1, naming the cell, at the first one that raises.
  """
  @spec run!(Path.t()) :: no_return()
  def run!(path) do
    path = Path.expand(path)
    cells = cells(path)
    env = Code.env_for_eval(file: path)

    Enum.reduce(Enum.with_index(cells, 1), {[], env}, fn {code, n}, {binding, env} ->
      IO.puts("--- cell #{n}")

      try do
        quoted = Code.string_to_quoted!(code, file: path, line: 1)
        {_value, binding, env} = Code.eval_quoted_with_env(quoted, binding, env)
        {binding, env}
      rescue
        e -> fail(path, n, Exception.format(:error, e, __STACKTRACE__))
      catch
        kind, reason -> fail(path, n, Exception.format(kind, reason, __STACKTRACE__))
      end
    end)

    IO.puts("--- #{length(cells)} cells ran")
    System.halt(0)
  end

  defp fail(path, n, why) do
    IO.puts("--- cell #{n} of #{path} failed:\n#{why}")
    System.halt(1)
  end
end

case System.argv() do
  ["--run", notebook] -> Moat.NotebookRunner.run!(notebook)
  _ -> :ok
end

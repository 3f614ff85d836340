defmodule Moat.Notebook do
  @moduledoc false
  # Runs a Livebook notebook (.livemd) the way Livebook's default runtime
  # does: every ```elixir cell in order, each evaluated with the binding and
  # the environment (aliases, imports, requires) the cells before it left.
  # The first cell is the notebook's `Mix.install` setup cell; here Moat is
  # already compiled and on the code path, so that cell is checked, not
  # run, and Moat is started as Mix.install would start it.

  @doc "The notebook's elixir cells, in order."
  @spec cells(Path.t()) :: [String.t()]
  def cells(path) do
    ~r/^```elixir\n(.*?)^```$/ms
    |> Regex.scan(File.read!(path), capture: :all_but_first)
    |> Enum.map(fn [code] -> code end)
  end

  @doc """
  Runs the notebook at `path`; prints each cell's number as it starts and
  halts with status 1, naming the cell, on the first one that raises.
  """
  @spec run!(Path.t()) :: no_return()
  def run!(path) do
    [setup | cells] = cells(path)

    if not (setup =~ "Mix.install(" and setup =~ "{:moat,") do
      fail(path, 1, "the first cell is not the Mix.install setup cell:\n#{setup}")
    end

    {:ok, _} = Application.ensure_all_started(:moat)
    env = Code.env_for_eval(file: Path.expand(path))

    Enum.reduce(Enum.with_index(cells, 2), {[], env}, fn {code, n}, {binding, env} ->
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

    IO.puts("--- #{length(cells) + 1} cells ran")
    System.halt(0)
  end

  defp fail(path, n, why) do
    IO.puts("--- cell #{n} of #{path} failed:\n#{why}")
    System.halt(1)
  end
end

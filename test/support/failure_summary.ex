defmodule Moat.FailureSummary do
  @moduledoc """
  An ExUnit formatter beside the CLI one: when the suite ends it prints one
  line per failed test (file:line and name), so the last lines of a long
  run's output say which tests failed, whatever else was printed between
  the failure and the end.
  """
  use GenServer

  @impl true
  def init(_opts) do
    # Printed when ExUnit stops its formatters, after the CLI formatter's
    # own last lines.
    Process.flag(:trap_exit, true)
    {:ok, []}
  end

  @impl true
  def handle_cast({:test_finished, %ExUnit.Test{state: {state, _}} = test}, failed)
      when state in [:failed, :invalid] do
    {:noreply, [test | failed]}
  end

  def handle_cast(_event, failed), do: {:noreply, failed}

  @impl true
  def terminate(_reason, []), do: :ok

  def terminate(_reason, failed) do
    IO.puts("\nFailed (#{length(failed)}):")

    for test <- Enum.reverse(failed) do
      file = Path.relative_to_cwd(test.tags[:file] || "?")
      IO.puts("  #{file}:#{test.tags[:line]} #{inspect(test.module)} #{test.name}")
    end
  end
end

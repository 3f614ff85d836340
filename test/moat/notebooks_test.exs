defmodule Moat.NotebooksTest do
  # Every notebook under notebooks/ runs, cell by cell in order, in a fresh
  # VM of its own, as Livebook runs it: its first cell Mix.installs Moat
  # from this checkout (the worker cargo built here comes in through
  # MOAT_WORKER, sparing a second cargo build), the others compute. A
  # notebook that no longer runs fails here. The tests of this module run
  # one after another, so the first one's install is the others' cache.
  use ExUnit.Case, async: true

  @moduletag timeout: 600_000

  @root Path.expand("../..", __DIR__)
  @runner Path.join(@root, "test/support/run_notebook.exs")
  @notebooks Path.wildcard(Path.join(@root, "notebooks/*.livemd"))

  Code.require_file(@runner)

  setup_all do
    tmp = Path.join(System.tmp_dir!(), "moat-notebooks-#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)
    on_exit(fn -> File.rm_rf!(tmp) end)
    %{tmp: tmp}
  end

  test "there are notebooks, each starting with the Mix.install of this checkout" do
    assert length(@notebooks) >= 4

    for notebook <- @notebooks do
      assert [setup | [_ | _]] = Moat.NotebookRunner.cells(notebook)
      assert setup =~ ~s|Mix.install([{:moat, path: Path.expand("..", __DIR__)}])|, notebook
    end
  end

  for notebook <- @notebooks do
    test "notebooks/#{Path.basename(notebook)} runs every cell", %{tmp: tmp} do
      {out, status} = run(unquote(notebook), tmp)
      assert status == 0, out
      assert out =~ ~r/--- \d+ cells ran/
    end
  end

  test "a cell that raises fails the notebook, naming the cell", %{tmp: tmp} do
    notebook = Path.join(tmp, "broken.livemd")

    File.write!(notebook, """
    # Broken

    ```elixir
    Mix.install([{:moat, path: #{inspect(@root)}}])
    ```

    ```elixir
    t = Nx.tensor([1, 2])
    ```

    ```elixir
    [3] = Nx.to_flat_list(t)
    ```
    """)

    {out, status} = run(notebook, tmp)
    assert status == 1
    assert out =~ "--- cell 3 of #{notebook} failed"
    assert out =~ "MatchError"
  end

  defp run(notebook, tmp) do
    env = [
      {"MIX_ENV", nil},
      {"MIX_INSTALL_DIR", Path.join(tmp, "mix-install")},
      {"MOAT_WORKER", Path.join(:code.priv_dir(:moat), "moat_port")}
    ]

    System.cmd("elixir", [@runner, "--run", notebook], cd: tmp, stderr_to_stdout: true, env: env)
  end
end

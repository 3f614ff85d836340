defmodule Moat.NotebooksTest do
  # Every notebook under notebooks/ runs, cell by cell in order, in a VM of
  # its own (as Livebook gives each notebook its own runtime), against this
  # build of Moat: a notebook that no longer runs fails here.
  use ExUnit.Case, async: true

  @root Path.expand("../..", __DIR__)
  @notebooks Path.wildcard(Path.join(@root, "notebooks/*.livemd"))

  test "there are notebooks, each starting with its setup cell" do
    assert length(@notebooks) >= 4

    for notebook <- @notebooks do
      assert [setup | [_ | _]] = Moat.Notebook.cells(notebook)
      assert setup =~ "Mix.install(", notebook
    end
  end

  for notebook <- @notebooks do
    @tag timeout: 300_000
    test "notebooks/#{Path.basename(notebook)} runs every cell" do
      {out, status} = run(unquote(notebook))
      assert status == 0, out
      assert out =~ ~r/--- \d+ cells ran/
    end
  end

  test "a cell that raises fails the notebook, naming the cell" do
    notebook = Path.join(System.tmp_dir!(), "moat-broken-#{System.unique_integer([:positive])}.livemd")
    on_exit(fn -> File.rm(notebook) end)

    File.write!(notebook, """
    # Broken

    ```elixir
    Mix.install([{:moat, path: ".."}])
    ```

    ```elixir
    t = Nx.tensor([1, 2], backend: Moat.Backend)
    ```

    ```elixir
    [3] = Nx.to_flat_list(t)
    ```
    """)

    {out, status} = run(notebook)
    assert status == 1
    assert out =~ "--- cell 3 of #{notebook} failed"
    assert out =~ "MatchError"
  end

  defp run(notebook) do
    paths = Enum.flat_map(:code.get_path(), &["-pa", to_string(&1)])
    code = "Moat.Notebook.run!(#{inspect(notebook)})"
    System.cmd("elixir", paths ++ ["-e", code], cd: @root, stderr_to_stdout: true, env: [{"MIX_ENV", nil}])
  end
end

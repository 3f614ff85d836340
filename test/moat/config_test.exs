defmodule Moat.ConfigTest do
  use ExUnit.Case, async: false

  import Moat.Case

  @root Path.expand("../..", __DIR__)
  @mib 1024 * 1024

  test "README's configuration table is Moat.Config.table/0" do
    readme = File.read!(Path.join(@root, "README.md"))
    [_, table] = Regex.run(~r/<!-- config table: Moat.Config.table\/0 -->\n(.*?)<!-- end config table -->/s, readme)
    assert table == Moat.Config.table(), "regenerate it: mix run -e 'IO.write(Moat.Config.table())'"
  end

  test "only Moat.Config reads :moat's application environment, so every key has its default there" do
    readers =
      for path <- Path.wildcard(Path.join(@root, "elixir/**/*.ex")),
          Path.basename(path) != "config.ex",
          File.read!(path) =~ ~r/(get_env|fetch_env!?|get_all_env)\(:moat\b/,
          do: Path.relative_to(path, @root)

    assert readers == []
  end

  test "the build's default MLX flavour is Moat.Config's" do
    saved = System.get_env("MOAT_MLX")
    System.delete_env("MOAT_MLX")

    try do
      assert Moat.Build.flavour() == to_string(Moat.Config.get(:mlx))
    after
      if saved, do: System.put_env("MOAT_MLX", saved)
    end
  end

  test "memory_limit applies to every worker it starts, from config or from the worker's options" do
    start_worker(:limit_by_option, memory_limit: 64 * @mib)
    assert Moat.memory_info(:limit_by_option).limit == 64 * @mib

    Application.put_env(:moat, :memory_limit, 96 * @mib)

    try do
      start_worker(:limit_by_config)
      assert Moat.memory_info(:limit_by_config).limit == 96 * @mib
      # A restart keeps it.
      kill(os_pid(:limit_by_config))

      eventually(fn ->
        try do
          Moat.Worker.info(:limit_by_config).generation == 2
        rescue
          Moat.Error -> false
        end
      end)

      assert Moat.memory_info(:limit_by_config).limit == 96 * @mib
    after
      Application.delete_env(:moat, :memory_limit)
    end
  end

  test "device is read when a worker starts" do
    Application.put_env(:moat, :device, :gpu)

    try do
      if :gpu in Moat.Worker.info().devices do
        assert {:ok, _} = start_supervised({Moat.Worker, name: :device_by_config})
        assert Moat.Worker.info(:device_by_config).device == :gpu
      else
        assert {:error, reason} = start_supervised({Moat.Worker, name: :device_by_config})
        assert inspect(reason) =~ "device :gpu is not available"
      end
    after
      Application.delete_env(:moat, :device)
    end

    assert Nx.tensor(1.0, backend: Moat.Backend) |> Nx.to_number() == 1.0
  end
end

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

  # The worker's mappings of its buffer files (port/shim/alloc.cpp).
  defp buffer_files_mapped?(worker), do: File.read!("/proc/#{os_pid(worker)}/maps") =~ "memfd:moat-buffer"

  # A computed 8 MiB result (a buffer of MLX's own), its readback, and
  # whether the worker mapped a buffer file while it held the result (once
  # the handle is dropped, a collection may free it at any time).
  defp computed_readback(worker) do
    data = :crypto.strong_rand_bytes(4 * @mib)
    x = Nx.from_binary(data, :u8, backend: {Moat.Backend, worker: worker})
    y = Nx.concatenate([x, x])
    %Nx.Tensor{data: %Moat.Backend{ref: ref}} = y
    :ok = Moat.eval(ref)
    mapped? = buffer_files_mapped?(worker)
    {data <> data, read_back(ref), mapped?}
  end

  # A GPU worker's buffers are CUDA memory: the option changes nothing there.
  @tag :cpu_only
  test "buffer_files: false keeps MLX's buffers out of memory files; large readbacks stay right" do
    off = start_worker(:buffer_files_off, buffer_files: false)
    {expected, {transfer, got}, mapped?} = computed_readback(off)
    assert got == expected
    assert transfer == :shared_memory, "still read from the worker's memory, by a copy"
    refute mapped?

    # Many results, freed and made again, read back right.
    for _ <- 1..5 do
      {expected, {_, got}, mapped?} = computed_readback(off)
      assert got == expected
      refute mapped?
    end

    on = start_worker(:buffer_files_on, buffer_files: true)
    {expected, {:shared_memory, got}, mapped?} = computed_readback(on)
    assert got == expected
    assert mapped?
  end

  # As above: CPU workers only.
  @tag :cpu_only
  test "buffer_files from config, and nil leaves it to $MOAT_BUFFER_FILES" do
    Application.put_env(:moat, :buffer_files, false)

    try do
      start_worker(:buffer_files_by_config)
      {expected, {_, got}, mapped?} = computed_readback(:buffer_files_by_config)
      assert got == expected
      refute mapped?
    after
      Application.delete_env(:moat, :buffer_files)
    end

    saved = System.get_env("MOAT_BUFFER_FILES")
    System.put_env("MOAT_BUFFER_FILES", "0")

    try do
      start_worker(:buffer_files_by_env)
      {expected, {_, got}, mapped?} = computed_readback(:buffer_files_by_env)
      assert got == expected
      refute mapped?
      # The option overrides the environment.
      start_worker(:buffer_files_over_env, buffer_files: true)
      {expected, {_, got}, mapped?} = computed_readback(:buffer_files_over_env)
      assert got == expected
      assert mapped?
    after
      if saved, do: System.put_env("MOAT_BUFFER_FILES", saved), else: System.delete_env("MOAT_BUFFER_FILES")
    end
  end

  test "a bad buffer_files fails the start, naming the option" do
    assert {:error, {{%ArgumentError{message: message}, _}, _}} =
             start_supervised({Moat.Worker, name: :buffer_files_bad, buffer_files: "0"})

    assert message == ~s(Moat.Worker: :buffer_files must be true, false or nil, got "0")
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

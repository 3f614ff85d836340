defmodule Moat.PackagingTest do
  # Moat as someone else's dependency: a fresh Mix project in a temporary
  # folder depends on this checkout, compiles it (reusing the worker cargo
  # has built, and the compiled Nx of this checkout's build, which it would
  # build identically), computes, builds a `mix release`, and the release,
  # moved to another folder with MOAT_CACHE pointing at an empty one,
  # computes, survives a worker crash and reads config/runtime.exs.
  use ExUnit.Case, async: false

  @moduletag :packaging
  # Needs cargo and this checkout's CPU build, which bin/gpu does not carry.
  @moduletag :cpu_only
  @moduletag timeout: 900_000

  @root Path.expand("../..", __DIR__)
  @limit 256 * 1024 * 1024

  setup do
    tmp = Path.join(System.tmp_dir!(), "moat-packaging-#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)
    on_exit(fn -> File.rm_rf!(tmp) end)
    %{tmp: tmp}
  end

  test "a fresh project compiles Moat, computes, and its release computes wherever it is moved", %{tmp: tmp} do
    app = Path.join(tmp, "moat_consumer")
    write_project(app)
    reuse_compiled_deps(app)

    mix!(app, ["deps.get"])
    mix!(app, ["compile"])
    assert File.exists?(Path.join(app, "_build/prod/lib/moat/priv/moat_port"))
    assert File.exists?(Path.join(app, "_build/prod/lib/moat/priv/moat_finalizer.so"))

    out = mix!(app, ["run", "-e", "MoatConsumer.run()"])
    assert out =~ "moat_consumer: 54.0 then 54.0, generation 1 -> 2"

    mix!(app, ["release", "--quiet"])
    moved = Path.join(tmp, "elsewhere/moat_consumer")
    File.mkdir_p!(Path.dirname(moved))
    File.rename!(Path.join(app, "_build/prod/rel/moat_consumer"), moved)
    File.rm_rf!(app)

    [priv] = Path.wildcard(Path.join(moved, "lib/moat-*/priv"))
    # The release carries the libraries themselves, not links into the cache.
    assert {:ok, %File.Stat{type: :regular}} = File.lstat(Path.join(priv, "lib/libmlx.so"))

    empty = Path.join(tmp, "empty-cache")
    File.mkdir_p!(empty)
    env = [{"MOAT_CACHE", empty}, {"MOAT_MLX_DIR", nil}, {"MOAT_WORKER", nil}, {"MIX_ENV", nil}]

    {out, status} =
      System.cmd(
        Path.join(moved, "bin/moat_consumer"),
        ["eval", "MoatConsumer.run(); Moat.Doctor.main(self_test: false)"],
        env: env,
        stderr_to_stdout: true
      )

    assert status == 0, out
    assert out =~ "moat_consumer: 54.0 then 54.0, generation 1 -> 2, memory limit #{@limit}"
    # The worker loaded MLX from inside the moved release.
    assert [_, mlx] = Regex.run(~r/libmlx from (\S+)/, out)
    assert String.starts_with?(mlx, priv), out
    # And the doctor, run inside the release, finds MLX there.
    assert out =~ ~r"OK +MLX +0\.32\.4, flavour cpu \(mlx-cpu\), loaded from #{Regex.escape(priv)}/lib/libmlx\.so"
  end

  # Everything tracked is in the package except what only this checkout's
  # development uses; the tagged test below compiles the package.
  @not_packaged ~w(.ci/ .gitignore bench/ bin/ examples/ rustfmt.toml test/)

  test "mix hex.build packs exactly what a project needs to build Moat", %{tmp: tmp} do
    packaged = unpack_package(tmp)
    {tracked, 0} = System.cmd("git", ~w(ls-files --cached --others --exclude-standard), cd: @root)
    tracked = String.split(tracked, "\n", trim: true)

    assert packaged -- tracked == ["hex_metadata.config"]
    left_out = tracked -- packaged
    assert Enum.reject(left_out, fn file -> Enum.any?(@not_packaged, &String.starts_with?(file, &1)) end) == []

    metadata = File.read!(Path.join(tmp, "moat/hex_metadata.config"))
    assert metadata =~ ~s({<<"name">>,<<"nx">>})
    assert metadata =~ ~s(<<"Apache-2.0">>)
  end

  # Builds the worker from scratch in the unpacked package (minutes):
  # mix test --only hex_tarball.
  @tag :hex_tarball
  test "the unpacked package compiles and computes in a fresh project", %{tmp: tmp} do
    unpack_package(tmp)
    app = Path.join(tmp, "consumer")
    File.mkdir_p!(Path.join(app, "lib"))

    File.write!(Path.join(app, "mix.exs"), """
    defmodule Consumer.MixProject do
      use Mix.Project
      def project, do: [app: :consumer, version: "0.1.0", deps: [{:moat, path: #{inspect(Path.join(tmp, "moat"))}}]]
    end
    """)

    reuse_compiled_deps(app)
    mix!(app, ["deps.get"])
    mix!(app, ["compile"])
    out = mix!(app, ["run", "-e", "IO.puts(Nx.to_number(Nx.sum(Nx.tensor([1.5, 2.5], backend: Moat.Backend))))"])
    assert out =~ "4.0"
  end

  defp unpack_package(tmp) do
    dest = Path.join(tmp, "moat")
    env = [{"MOAT_DEPS_DIR", "none"}, {"HEX_OFFLINE", "1"}, {"MIX_ENV", "dev"}]

    {out, status} =
      System.cmd("mix", ["hex.build", "--unpack", "-o", dest], cd: @root, env: env, stderr_to_stdout: true)

    assert status == 0, out

    for file <- Path.wildcard(Path.join(dest, "**"), match_dot: true),
        File.regular?(file),
        do: Path.relative_to(file, dest)
  end

  defp write_project(app) do
    File.mkdir_p!(Path.join(app, "lib"))
    File.mkdir_p!(Path.join(app, "config"))

    File.write!(Path.join(app, "mix.exs"), """
    defmodule MoatConsumer.MixProject do
      use Mix.Project

      def project do
        [app: :moat_consumer, version: "0.1.0", elixir: "~> 1.17", deps: [{:moat, path: #{inspect(@root)}}]]
      end

      def application, do: [extra_applications: [:logger]]
    end
    """)

    File.write!(Path.join(app, "config/runtime.exs"), """
    import Config
    config :moat, memory_limit: #{@limit}, worker_log_level: :error
    """)

    File.write!(Path.join(app, "lib/moat_consumer.ex"), ~S'''
    defmodule MoatConsumer do
      def run do
        {:ok, _} = Application.ensure_all_started(:moat)
        first = compute()
        %{os_pid: pid, generation: generation} = Moat.Worker.info()
        {_, 0} = System.cmd("kill", ["-KILL", "#{pid}"])
        %{os_pid: new_pid, generation: restarted} = await_restart(generation)
        again = compute()
        [libmlx] = for line <- File.stream!("/proc/#{new_pid}/maps"), line =~ "libmlx.so", uniq: true,
                       do: line |> String.split() |> List.last()
        limit = Moat.memory_info().limit

        IO.puts("moat_consumer: #{first} then #{again}, generation #{generation} -> #{restarted}, " <>
                "memory limit #{limit}, libmlx from #{libmlx}")
      end

      defp compute do
        a = Nx.tensor([[1.0, 2.0], [3.0, 4.0]], backend: Moat.Backend)
        a |> Nx.dot(a) |> Nx.sum() |> Nx.to_number()
      end

      defp await_restart(generation) do
        info = try do: Moat.Worker.info(), rescue: (_ -> nil)
        if info && info.generation > generation, do: info, else: (Process.sleep(10); await_restart(generation))
      end
    end
    ''')
  end

  # Nx is compiled as a dependency (in its :prod environment) the same way
  # for any project; this checkout's copy spares the fresh project minutes.
  defp reuse_compiled_deps(app) do
    # Not telemetry: Mix's Erlang compiler keeps absolute paths of its .beam
    # files in its manifest, so the consumer's build would delete this
    # checkout's when it recompiles the copy (cheap to compile anyway).
    for dep <- ~w(nx complex), from = Path.join(@root, "_build/test/lib/#{dep}"), File.dir?(from) do
      File.mkdir_p!(Path.join(app, "_build/prod/lib"))
      File.cp_r!(from, Path.join(app, "_build/prod/lib/#{dep}"))
    end
  end

  defp mix!(app, args) do
    env = [{"MIX_ENV", "prod"}, {"HEX_OFFLINE", "1"}, {"MOAT_WORKER", nil}]
    {out, status} = System.cmd("mix", args, cd: app, env: env, stderr_to_stdout: true)
    assert status == 0, "mix #{Enum.join(args, " ")} failed (#{status}):\n#{out}"
    out
  end
end

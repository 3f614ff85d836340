defmodule Moat.MixProject do
  use Mix.Project

  @version "0.1.0"

  def project do
    [
      app: :moat,
      version: @version,
      elixir: "~> 1.17",
      elixirc_paths: elixirc_paths(Mix.env()),
      test_paths: ["test"],
      test_pattern: "*_test.exs",
      compilers: [:moat_port, :moat_finalizer | Mix.compilers()],
      deps: deps(),
      name: "Moat",
      description: "An Nx backend on Apple's MLX, run in a supervised, crash-isolated worker process"
    ]
  end

  defp elixirc_paths(:test), do: ["elixir", "test/support"]
  defp elixirc_paths(_), do: ["elixir"]

  def application do
    [
      extra_applications: [:logger],
      mod: {Moat.Application, []},
      env: [
        worker_log_level: :warning,
        fallback: :silent,
        window: 1024,
        gc_nudge: 1_000,
        chunk_bytes: 64 * 1024 * 1024,
        max_frame_bytes: 320 * 1024 * 1024
      ]
    ]
  end

  # Nx, complex and telemetry come from Hex. Where hex.pm is out of reach,
  # put source checkouts in MOAT_DEPS_DIR (default ~/.cache/moat/deps):
  # nx/ (elixir-nx/nx at v0.13.1), complex/ and telemetry/ (v1.3.0).
  defp deps do
    dir = System.get_env("MOAT_DEPS_DIR") || Path.expand("~/.cache/moat/deps")

    if File.dir?(Path.join(dir, "nx/nx")) do
      [
        {:nx, path: Path.join(dir, "nx/nx"), override: true},
        {:complex, path: Path.join(dir, "complex"), override: true},
        {:telemetry, path: Path.join(dir, "telemetry"), override: true}
      ]
    else
      [{:nx, "~> 0.13"}, {:telemetry, "~> 1.0"}]
    end
  end
end

defmodule Mix.Tasks.Compile.MoatPort do
  @shortdoc "Builds the moat_port worker with cargo and puts it in priv/"
  @moduledoc false
  use Mix.Task.Compiler

  @impl true
  def run(_args) do
    # A prebuilt worker (bin/gpu, on a machine without cargo) is used as is.
    if System.get_env("MOAT_WORKER"), do: {:noop, []}, else: build()
  end

  defp build do
    root = Path.dirname(__ENV__.file)
    built = Path.join(root, "target/release/moat_port")
    dest = Path.join(Mix.Project.app_path(), "priv/moat_port")

    case System.cmd("cargo", ["build", "--release", "--quiet", "-p", "moat_port"],
           cd: root,
           stderr_to_stdout: true
         ) do
      {_, 0} ->
        File.mkdir_p!(Path.dirname(dest))

        unless File.exists?(dest) and File.read!(dest) == File.read!(built) do
          File.cp!(built, dest)
        end

        {:ok, []}

      {output, status} ->
        Mix.shell().error("cargo build of moat_port failed (exit #{status}):\n" <> output)
        {:error, []}
    end
  end
end

defmodule Mix.Tasks.Compile.MoatFinalizer do
  @shortdoc "Builds the tensor finalizer NIF (nif/moat_finalizer.c, no MLX) into priv/"
  @moduledoc false
  use Mix.Task.Compiler

  # Without a C compiler the build goes on: Moat then runs without automatic
  # release (see Moat's moduledoc).
  @impl true
  def run(_args) do
    root = Path.dirname(__ENV__.file)
    source = Path.join(root, "nif/moat_finalizer.c")
    dest = Path.join(Mix.Project.app_path(), "priv/moat_finalizer.so")

    if File.exists?(dest) and mtime(dest) >= mtime(source) do
      {:noop, []}
    else
      build(source, dest)
    end
  end

  defp build(source, dest) do
    cc = System.get_env("CC") || System.find_executable("cc") || System.find_executable("gcc")
    include = Path.join([to_string(:code.root_dir()), "erts-#{:erlang.system_info(:version)}", "include"])
    File.mkdir_p!(Path.dirname(dest))
    args = ["-O2", "-fPIC", "-shared", "-std=c11", "-Wall", "-Wextra", "-I", include, "-o", dest, source]

    case cc && System.cmd(cc, args, stderr_to_stdout: true) do
      {_, 0} ->
        {:ok, []}

      failure ->
        why = if failure, do: elem(failure, 0), else: "no C compiler found (set CC)"

        Mix.shell().info(
          "moat: the finalizer NIF was not built; tensors are released only " <>
            "explicitly, by Moat.scope/1 or by a worker restart:\n" <> why
        )

        {:ok, []}
    end
  end

  defp mtime(path), do: File.stat!(path, time: :posix).mtime
end

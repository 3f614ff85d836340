defmodule Moat.Build do
  @moduledoc false
  # Build-time logic for mix.exs's compilers and `mix moat.setup`: the MLX
  # pins (port/mlx.pins), installing a wheel into the cache, building the
  # worker and linking it, with the libraries it loads, into priv/. mix.exs
  # loads this file, so it works before Moat is compiled, and in projects that
  # depend on Moat. Nothing here downloads anything except `install_mlx/2`,
  # which only `mix moat.setup` calls.

  @root Path.expand("..", __DIR__)
  @pins Path.join(@root, "port/mlx.pins")

  @type pin :: %{
          flavour: String.t(),
          package: String.t(),
          version: String.t(),
          platform: String.t(),
          sha256: String.t()
        }

  def root, do: @root

  @doc "The lines of port/mlx.pins."
  @spec pins() :: [pin()]
  def pins do
    for line <- String.split(File.read!(@pins), "\n"),
        not String.starts_with?(String.trim_leading(line), "#"),
        [flavour, package, version, platform, sha256] <- [String.split(line)] do
      %{flavour: flavour, package: package, version: version, platform: platform, sha256: sha256}
    end
  end

  @doc "The pin of `flavour`; raises naming the known ones."
  @spec pin!(String.t()) :: pin()
  def pin!(flavour) do
    Enum.find(pins(), &(&1.flavour == flavour)) ||
      Mix.raise(
        "moat: unknown MLX flavour #{inspect(flavour)}; port/mlx.pins has #{Enum.map_join(pins(), ", ", & &1.flavour)}"
      )
  end

  @doc """
  The flavour the worker is built against: $MOAT_MLX, else `config :moat,
  mlx: :cuda13` of the project, else `cpu`.
  """
  @spec flavour() :: String.t()
  def flavour, do: System.get_env("MOAT_MLX") || to_string(Application.get_env(:moat, :mlx, :cpu))

  @spec cache() :: Path.t()
  def cache, do: System.get_env("MOAT_CACHE") || Path.expand("~/.cache/moat")

  @doc "Where `mix moat.setup` unpacks the wheel of `pin` (build.rs looks there)."
  @spec install_dir(pin()) :: Path.t()
  def install_dir(pin), do: Path.join(cache(), "#{pin.package}-#{pin.version}")

  defp wheel_name(pin), do: "#{String.replace(pin.package, "-", "_")}-#{pin.version}-py3-none-#{pin.platform}.whl"

  @doc """
  Downloads the pinned wheel with pip (which checks its sha256; so does this)
  and unpacks it into `install_dir/1`. `find_links:` a folder to take it from
  instead of PyPI. Returns `{:ok, dir}` or `{:error, message}`.
  """
  @spec install_mlx(pin(), keyword()) :: {:ok, Path.t()} | {:error, String.t()}
  def install_mlx(pin, opts \\ []) do
    dest = install_dir(pin)
    downloads = Path.join(cache(), "src/wheels")
    wheel = Path.join(downloads, wheel_name(pin))

    with :ok <- download(pin, downloads, opts[:find_links]),
         :ok <- check_sha256(wheel, pin.sha256) do
      part = dest <> ".part"
      File.rm_rf!(part)
      File.mkdir_p!(part)
      {:ok, _} = :zip.extract(String.to_charlist(wheel), cwd: String.to_charlist(part))
      File.rm_rf!(dest)
      File.rename!(part, dest)
      {:ok, dest}
    end
  end

  defp download(pin, downloads, find_links) do
    File.mkdir_p!(downloads)
    requirements = Path.join(downloads, "requirements-#{pin.package}.txt")
    File.write!(requirements, "#{pin.package}==#{pin.version} --hash=sha256:#{pin.sha256}\n")
    index = if find_links, do: ["--no-index", "--find-links", Path.expand(find_links)], else: []

    args =
      ~w(-m pip download -q --no-deps --only-binary=:all: --require-hashes --platform) ++
        [pin.platform, "-r", requirements, "-d", downloads] ++ index

    case System.find_executable("python3") do
      nil ->
        {:error,
         "python3 (with pip) is needed to download #{wheel_name(pin)}: apt-get install python3-pip, " <>
           "or download the wheel yourself and pass --find-links FOLDER"}

      python ->
        case System.cmd(python, args, stderr_to_stdout: true) do
          {_, 0} -> :ok
          {out, status} -> {:error, "pip download of #{pin.package}==#{pin.version} failed (exit #{status}):\n#{out}"}
        end
    end
  end

  defp check_sha256(path, expected) do
    actual = :crypto.hash(:sha256, File.read!(path)) |> Base.encode16(case: :lower)
    if actual == expected, do: :ok, else: {:error, "#{path}: sha256 #{actual}, expected #{expected} (port/mlx.pins)"}
  end

  ## The worker

  defp target_dir, do: Path.expand(System.get_env("CARGO_TARGET_DIR") || "target", @root)

  @doc """
  Builds the worker with cargo and links it, and the libraries it loads, into
  `priv` (`priv/moat_port`, `priv/lib/`). Returns `:ok`, `{:missing_mlx,
  message}` or `{:error, message}`.
  """
  @spec build_worker(Path.t()) :: {:ok, [String.t()]} | {:missing_mlx, String.t()} | {:error, String.t()}
  def build_worker(priv) do
    with {:ok, warnings} <- cargo_build(),
         :ok <- install_worker(priv),
         do: {:ok, warnings}
  end

  defp cargo_build do
    cargo = System.find_executable("cargo") || Enum.find([Path.expand("~/.cargo/bin/cargo")], &File.exists?/1)
    # A flavour set only in config reaches build.rs this way ($MOAT_MLX is
    # inherited; cpu is build.rs's default).
    env = if System.get_env("MOAT_MLX") || flavour() == "cpu", do: [], else: [{"MOAT_MLX", flavour()}]

    case cargo &&
           System.cmd(cargo, ~w(build --release -p moat_port), cd: @root, env: env, stderr_to_stdout: true) do
      nil ->
        {:error,
         "moat: cargo (Rust) is needed to build the worker: install it from https://rustup.rs and compile again"}

      # Cargo replays a fresh build's warnings, so they are seen every time.
      {out, 0} ->
        {:ok, for("warning" <> _ = line <- String.split(out, "\n"), do: line)}

      {out, status} ->
        case :binary.match(out, "moat: MLX") do
          {at, _} ->
            # build.rs's message, as cargo indents it under "--- stderr".
            message = out |> binary_part(at, byte_size(out) - at) |> String.replace(~r/^  /m, "")
            {:missing_mlx, String.trim_trailing(message)}

          :nomatch ->
            {:error, "moat: cargo build of the worker failed (exit #{status}):\n" <> out}
        end
    end
  end

  defp install_worker(priv) do
    release = Path.join(target_dir(), "release")
    File.mkdir_p!(priv)
    copy_if_changed(Path.join(release, "moat_port"), Path.join(priv, "moat_port"))
    libs = release |> Path.join("lib") |> File.ls!() |> Enum.sort()
    lib = Path.join(priv, "lib")

    # Links, like cargo's lib/: `mix release` copies what they point to.
    unless File.dir?(lib) and Enum.sort(File.ls!(lib)) == libs and
             Enum.all?(libs, &(File.read_link(Path.join(lib, &1)) == File.read_link(Path.join([release, "lib", &1])))) do
      File.rm_rf!(lib)
      File.mkdir_p!(lib)

      for name <- libs do
        {:ok, target} = File.read_link(Path.join([release, "lib", name]))
        File.ln_s!(target, Path.join(lib, name))
      end
    end

    File.write!(Path.join(priv, "mlx.txt"), describe_mlx(Path.join([release, "lib", "libmlx.so"])) <> "\n")

    case missing_libs(Path.join(priv, "moat_port")) do
      [] -> :ok
      missing -> {:error, "moat: the worker in #{priv} cannot find #{Enum.join(missing, ", ")} (ldd)"}
    end
  end

  # "MLX 0.32.4, flavour cpu (mlx-cpu)", from the wheel's metadata beside
  # the MLX folder that `libmlx` links into, for `mix moat.doctor`.
  defp describe_mlx(libmlx) do
    with {:ok, target} <- File.read_link(libmlx),
         mlx = target |> Path.dirname() |> Path.dirname(),
         [metadata | _] <- Path.wildcard(Path.join(Path.dirname(mlx), "mlx*.dist-info/METADATA")),
         text = File.read!(metadata),
         [_, package] <- Regex.run(~r/^Name: (\S+)/m, text),
         [_, version] <- Regex.run(~r/^Version: (\S+)/m, text) do
      flavour = Enum.find_value(pins(), "unknown", &(&1.package == package && &1.flavour))
      "#{version}, flavour #{flavour} (#{package})"
    else
      _ -> "MLX of #{libmlx} (no wheel metadata beside it)"
    end
  end

  defp copy_if_changed(from, to) do
    unless File.exists?(to) and File.read!(to) == File.read!(from), do: File.cp!(from, to)
  end

  @doc "The libraries `binary` needs that the loader cannot find (ldd), [] without ldd."
  @spec missing_libs(Path.t()) :: [String.t()]
  def missing_libs(binary) do
    case System.find_executable("ldd") && System.cmd("ldd", [binary], stderr_to_stdout: true) do
      {out, _} -> for [_, name] <- Regex.scan(~r/^\s*(\S+) => not found/m, out), do: name
      nil -> []
    end
  end

  @doc """
  Whether this mix run is `mix moat.setup` or `mix moat.doctor`, which must
  run where MLX is missing: Mix compiles Moat (the project or the
  dependency) before it can find their task, so the worker's compiler lets
  them through.
  """
  @spec setup_or_doctor?() :: boolean()
  def setup_or_doctor?, do: Enum.any?(System.argv(), &(&1 in ["moat.setup", "moat.doctor"]))
end

defmodule Mix.Tasks.Compile.MoatPort do
  @shortdoc "Builds the moat_port worker with cargo and puts it, with its libraries, in priv/"
  @moduledoc false
  use Mix.Task.Compiler

  # Cargo's warnings are shown, and fail the build under
  # `mix compile --warnings-as-errors`.
  @impl true
  def run(args) do
    # A prebuilt worker (bin/gpu, on a machine without cargo) is used as is.
    if System.get_env("MOAT_WORKER"), do: {:noop, []}, else: build(args)
  end

  defp build(args) do
    {opts, _, _} = OptionParser.parse(args, switches: [warnings_as_errors: :boolean])

    case Moat.Build.build_worker(Path.join(Mix.Project.app_path(), "priv")) do
      {:ok, []} ->
        {:ok, []}

      {:ok, warnings} ->
        diagnostics =
          for line <- warnings do
            %Mix.Task.Compiler.Diagnostic{
              compiler_name: "moat_port",
              file: Path.join(Moat.Build.root(), "port"),
              message: line,
              position: 0,
              severity: :warning
            }
          end

        Mix.shell().info(Enum.join(warnings, "\n"))
        if opts[:warnings_as_errors], do: {:error, diagnostics}, else: {:ok, diagnostics}

      {:missing_mlx, message} ->
        if Moat.Build.setup_or_doctor?() do
          Mix.shell().info("moat: the worker is not built yet (MLX is not installed)")
          {:ok, []}
        else
          Mix.shell().error(message)
          {:error, []}
        end

      {:error, message} ->
        Mix.shell().error(message)
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
    source = Path.join(Moat.Build.root(), "nif/moat_finalizer.c")
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

defmodule Mix.Tasks.Moat.Setup do
  @shortdoc "Installs the pinned MLX wheel into Moat's cache and builds the worker"
  @moduledoc """
  Installs MLX for Moat, from inside any Mix project that depends on it (or
  from Moat's own checkout), then builds the worker against it.

      mix moat.setup [--mlx cpu|cuda13] [--find-links FOLDER] [--force] [--no-build]

  It downloads the PyPI wheel pinned in Moat's `port/mlx.pins` with
  `python3 -m pip download --require-hashes` (so pip checks its sha256; this
  task checks it again) and unpacks it into `$MOAT_CACHE/<package>-<version>`
  (`MOAT_CACHE` defaults to `~/.cache/moat`), where the worker's build looks
  for it. `mix compile` never downloads anything.

    * `--mlx` - the flavour (default: `$MOAT_MLX`, else `config :moat, mlx:`,
      else `cpu`). To build against `cuda13`, also set `MOAT_MLX=cuda13` or
      `config :moat, mlx: :cuda13` in `config/config.exs`.
    * `--find-links FOLDER` - take the wheel from FOLDER, not from PyPI
      (machines without access to PyPI)
    * `--force` - reinstall even if the folder is there
    * `--no-build` - only install MLX
  """
  use Mix.Task

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [mlx: :string, find_links: :string, force: :boolean, build: :boolean])
    pin = Moat.Build.pin!(opts[:mlx] || Moat.Build.flavour())
    dir = Moat.Build.install_dir(pin)

    if File.exists?(Path.join(dir, "mlx/lib/libmlx.so")) and not Keyword.get(opts, :force, false) do
      Mix.shell().info("MLX #{pin.version} (#{pin.package}) is installed in #{dir}")
    else
      Mix.shell().info("Installing MLX #{pin.version} (PyPI wheel #{pin.package}, sha256-checked) into #{dir}")

      case Moat.Build.install_mlx(pin, opts) do
        {:ok, _} -> :ok
        {:error, message} -> Mix.raise(message)
      end
    end

    cond do
      Keyword.get(opts, :build, true) == false ->
        :ok

      pin.flavour != Moat.Build.flavour() ->
        Mix.shell().info(
          "The worker builds against #{Moat.Build.flavour()}: set MOAT_MLX=#{pin.flavour} " <>
            "(or config :moat, mlx: :#{pin.flavour}) and run mix compile to use #{pin.flavour}"
        )

      true ->
        build()
    end
  end

  # Into the :moat application of this project's build, the project itself
  # or a dependency: the next `mix compile` finds it done.
  defp build do
    priv = Path.join([Mix.Project.build_path(), "lib", "moat", "priv"])
    Mix.shell().info("Building the worker into #{priv}")

    case Moat.Build.build_worker(priv) do
      {:ok, _warnings} -> Mix.shell().info("Done. `mix moat.doctor` checks the installation.")
      {_, message} -> Mix.raise(message)
    end
  end
end

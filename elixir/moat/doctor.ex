defmodule Moat.Doctor do
  @moduledoc """
  What Moat will use on this machine, what is missing, and how to fix each
  problem: `mix moat.doctor`, or `bin/APP eval "Moat.Doctor.main()"` in a
  release.

  It checks the worker binary and the libraries it loads (MLX, and OpenBLAS
  where it is linked), starts a worker of its own (not the application's)
  and reports MLX's version and flavour, the BLAS with a measured f32 matmul
  speed, the devices, the CPU kernel set it chose (the hello's `cpu`), shared
  memory and the memory limit; whether the
  finalizer NIF loaded, the C++ compiler MLX needs for fused kernels, the C
  library; and runs a self-test: compute, kill the worker with SIGKILL, see
  its supervisor restart it, compute again.
  """

  alias Moat.{Client, Finalizer}
  require Logger

  @type finding :: %{check: String.t(), status: :ok | :warn | :error, detail: String.t(), fix: String.t() | nil}

  @setup "mix moat.setup (in a release: build it where `mix moat.setup` has run)"

  @doc """
  Runs the checks. Options: `:priv` (the `:moat` application's priv folder,
  where the worker, its lib/ and the NIF are), `:self_test` (true).
  """
  @spec run(keyword()) :: [finding()]
  def run(opts \\ []) do
    priv = Keyword.get_lazy(opts, :priv, &priv/0)
    worker = Path.join(priv, "moat_port")
    {binary, missing} = binary_checks(priv, worker)

    live =
      if missing == [] and File.exists?(worker),
        do: live_checks(worker, Keyword.get(opts, :self_test, true)),
        else: [finding("Worker", :error, "not started: the checks above failed", nil)]

    binary ++ live ++ [finalizer(priv), cxx(), libc()]
  end

  @doc "Prints `run/1`'s findings; `:ok` when none is an error."
  @spec main(keyword()) :: :ok | :error
  def main(opts \\ []) do
    {:ok, _} = Application.ensure_all_started(:telemetry)
    Application.load(:moat)
    findings = run(opts)
    IO.write(format(findings))
    if Enum.any?(findings, &(&1.status == :error)), do: :error, else: :ok
  end

  @doc "The findings as one screen of text."
  @spec format([finding()]) :: String.t()
  def format(findings) do
    width = findings |> Enum.map(&String.length(&1.check)) |> Enum.max()

    lines =
      Enum.map(findings, fn f ->
        status = f.status |> to_string() |> String.upcase() |> String.pad_trailing(5)
        line = "#{status} #{String.pad_trailing(f.check, width)}  #{f.detail}\n"
        if f.fix, do: line <> String.duplicate(" ", width + 8) <> "fix: #{f.fix}\n", else: line
      end)

    problems = Enum.count(findings, &(&1.status != :ok))
    summary = if problems == 0, do: "No problems found.", else: "#{problems} problem(s), each with its fix above."
    IO.iodata_to_binary(["Moat #{version()} doctor\n", lines, summary, "\n"])
  end

  defp priv do
    case :code.priv_dir(:moat) do
      {:error, _} -> Path.expand("priv")
      dir -> to_string(dir)
    end
  end

  defp version do
    case Application.spec(:moat, :vsn) do
      nil -> "?"
      vsn -> to_string(vsn)
    end
  end

  defp finding(check, status, detail, fix), do: %{check: check, status: status, detail: detail, fix: fix}

  ## The worker binary and its libraries

  defp binary_checks(priv, worker) do
    if File.exists?(worker) do
      libs = ldd(worker)
      missing = for {name, :not_found} <- libs, do: name
      {[mlx(priv, libs, missing), blas_lib(libs) | other_missing(missing)], missing}
    else
      detail = "#{worker} is not built (MLX was not installed when Moat compiled)"
      {[finding("MLX", :error, detail, @setup)], [:worker]}
    end
  end

  defp mlx(priv, libs, missing) do
    built = Path.join(priv, "mlx.txt")

    flavour =
      case File.read(built) do
        {:ok, text} -> String.trim(text)
        _ -> "flavour unknown"
      end

    cond do
      "libmlx.so" in missing ->
        finding("MLX", :error, "libmlx.so not found by the worker (#{flavour})", @setup)

      path = libs["libmlx.so"] ->
        finding("MLX", :ok, "#{flavour}, loaded from #{path}", nil)

      true ->
        finding("MLX", :ok, flavour, nil)
    end
  end

  defp blas_lib(libs) do
    case libs["libopenblas.so.0"] do
      nil ->
        finding("BLAS library", :ok, "MLX's bundled reference BLAS (OpenBLAS not linked)", nil)

      :not_found ->
        finding("BLAS library", :error, "libopenblas.so.0 not found", "apt-get install libopenblas0-pthread")

      path ->
        finding("BLAS library", :ok, "OpenBLAS from #{path}", nil)
    end
  end

  defp other_missing(missing) do
    for name <- missing, name not in ["libmlx.so", "libopenblas.so.0"] do
      finding("Library", :error, "#{name} not found by the worker", "install the package that provides #{name}")
    end
  end

  # %{name => resolved path | :not_found}
  defp ldd(binary) do
    case System.find_executable("ldd") && System.cmd("ldd", [binary], stderr_to_stdout: true) do
      {out, _} ->
        for [_, name, where] <- Regex.scan(~r/^\s*(\S+) => (.+?)(?: \(0x[0-9a-f]+\))?$/m, out), into: %{} do
          {name, if(where == "not found", do: :not_found, else: resolve(where))}
        end

      nil ->
        %{}
    end
  end

  defp resolve(path) do
    case real(path) do
      ^path -> path
      target -> "#{path} -> #{target}"
    end
  end

  defp real(path) do
    case File.read_link(path) do
      {:ok, target} -> real(Path.expand(target, Path.dirname(path)))
      _ -> path
    end
  end

  ## A worker of the doctor's own

  defp live_checks(worker, self_test?) do
    name = :"Moat.Doctor.Worker#{System.unique_integer([:positive])}"
    child = Supervisor.child_spec({Moat.Worker, name: name, worker_path: worker}, id: name)

    # A worker that cannot start takes its supervisor down with it: trapped,
    # that is a finding rather than the doctor's own exit.
    trapping = Process.flag(:trap_exit, true)
    started = Supervisor.start_link([child], strategy: :one_for_one, max_restarts: 3, max_seconds: 5)
    Process.flag(:trap_exit, trapping)

    case started do
      {:ok, sup} ->
        try do
          info = Moat.Worker.info(name)
          conn = Client.conn(name)

          [
            finding("MLX runtime", :ok, "MLX #{info.mlx}, devices #{inspect(info.devices)}", nil),
            blas(name, info),
            cpu_kernels(info.cpu),
            shared(conn),
            memory(name)
          ] ++ if(self_test?, do: [self_test(name)], else: [])
        after
          Process.unlink(sup)
          Process.exit(sup, :shutdown)
        end

      {:error, reason} ->
        receive do
          {:EXIT, _, _} -> :ok
        after
          0 -> :ok
        end

        [finding("Worker", :error, "did not start: #{inspect(reason)}", @setup)]
    end
  end

  defp blas(name, info) do
    n = 512
    a = Nx.iota({n, n}, type: :f32, backend: {Moat.Backend, worker: name}) |> Nx.divide(n * n)
    Nx.to_binary(Nx.dot(a, a))

    micros =
      for(_ <- 1..5, do: :timer.tc(fn -> Nx.to_binary(Nx.dot(a, a)) end) |> elem(0)) |> Enum.sort() |> Enum.at(2)

    gflops = Float.round(2 * n ** 3 / micros / 1000, 1)
    measured = "#{gflops} GFLOP/s (f32 matmul, n = #{n}, median of 5)"

    case info.blas do
      :openblas ->
        finding("BLAS", :ok, "OpenBLAS, #{measured}", nil)

      other ->
        finding(
          "BLAS",
          :warn,
          "#{other} (MLX's bundled one, ~30x slower at matmul than OpenBLAS), #{measured}",
          "apt-get install libopenblas0-pthread, then rebuild Moat (mix deps.compile moat --force)"
        )
    end
  end

  # The kernel set the worker chose from cpuid (the hello's `cpu`).
  @cpu_kernels %{
    avx512: "AVX-512 (transcendentals; quantized products with AVX-512BW/VL, else AVX2)",
    avx2: "AVX2 + FMA",
    scalar: "scalar (no AVX2 found, or forced)",
    mlx: "MLX's own (forced)"
  }

  defp cpu_kernels(cpu) do
    detail = Map.get(@cpu_kernels, cpu, inspect(cpu))
    finding("CPU kernels", :ok, "#{detail}; MOAT_CPU_FEATURES forces a set", nil)
  end

  defp shared(%Client{shared: nil}) do
    finding(
      "Shared memory",
      :warn,
      "off: large tensors go through the pipe",
      "this VM must read the worker's memory: the same user, and kernel.yama.ptrace_scope <= 1"
    )
  end

  defp shared(%Client{shared: shared}),
    do:
      finding(
        "Shared memory",
        :ok,
        "on, for tensors of #{shared.threshold} bytes and more; #{readbacks(shared.via)}",
        nil
      )

  defp readbacks(:process_vm), do: "readbacks copied from the worker's memory (process_vm_readv)"
  defp readbacks(:sealed), do: "readbacks mapped from sealed files"
  defp readbacks(:proc_mem), do: "readbacks read from /proc/<pid>/mem (no finalizer NIF)"

  defp memory(name) do
    %{limit: limit} = Moat.memory_info(name)
    finding("Memory limit", :ok, "#{mib(limit)} of #{mib(total_ram())} RAM", nil)
  end

  defp self_test(name) do
    started = System.monotonic_time(:millisecond)
    %{os_pid: pid, generation: generation} = Moat.Worker.info(name)
    first = compute(name)
    # The kill is on purpose: the worker's error log would only be noise.
    Logger.put_module_level(Moat.Worker, :none)
    System.cmd("kill", ["-KILL", "#{pid}"])
    restarted = await_generation(name, generation + 1, started + 5_000)
    Logger.delete_module_level(Moat.Worker)
    again = restarted && compute(name)
    ms = System.monotonic_time(:millisecond) - started

    if first == 8.0 and again == 8.0 do
      detail = "computed, killed the worker (SIGKILL), generation #{generation + 1} computed again (#{ms} ms)"
      finding("Self-test", :ok, detail, nil)
    else
      detail = "computed #{inspect(first)}, after the kill #{inspect(again)} (8.0 expected), #{ms} ms"
      finding("Self-test", :error, detail, "run `mix test` in Moat's checkout and report the failure")
    end
  end

  defp compute(name) do
    t = Nx.tensor([1.0, 2.0, 3.0], backend: {Moat.Backend, worker: name})
    t |> Nx.multiply(2) |> Nx.sum() |> Nx.subtract(4) |> Nx.to_number()
  rescue
    e -> Exception.message(e)
  end

  defp await_generation(name, generation, deadline) do
    cond do
      current_generation(name) == generation -> true
      System.monotonic_time(:millisecond) > deadline -> false
      true -> Process.sleep(10) && await_generation(name, generation, deadline)
    end
  end

  defp current_generation(name) do
    Client.conn(name).generation
  rescue
    _ -> nil
  end

  ## The rest of the machine

  defp finalizer(priv) do
    nif = Path.join(priv, "moat_finalizer.so")

    cond do
      not File.exists?(nif) ->
        finding(
          "Finalizer NIF",
          :error,
          "#{nif} is not built: tensors are freed only by Moat.scope/1, Nx.backend_deallocate/1 or a restart",
          "install a C compiler (apt-get install gcc), then rebuild Moat (mix deps.compile moat --force)"
        )

      Finalizer.loaded?() ->
        finding("Finalizer NIF", :ok, "loaded: tensors are freed when their handles are garbage", nil)

      System.get_env("MOAT_FINALIZER") == "off" ->
        finding("Finalizer NIF", :warn, "disabled by MOAT_FINALIZER=off", "unset MOAT_FINALIZER")

      true ->
        finding(
          "Finalizer NIF",
          :error,
          "not loaded: #{inspect(Finalizer.load_error())}",
          "rebuild Moat (mix deps.compile moat --force)"
        )
    end
  end

  defp cxx do
    case Enum.find_value(["c++", "g++", "clang++"], &System.find_executable/1) do
      nil -> finding("C++ compiler", :warn, "none: MLX cannot compile fused CPU kernels", "apt-get install g++")
      path -> finding("C++ compiler", :ok, "#{path} (for MLX's fused CPU kernels)", nil)
    end
  end

  defp libc do
    case System.cmd("getconf", ["GNU_LIBC_VERSION"], stderr_to_stdout: true) do
      {"glibc " <> version, 0} ->
        version = String.trim(version)
        ok? = Version.compare(normalize(version), "2.35.0") != :lt
        status = if ok?, do: :ok, else: :error
        finding("C library", status, "glibc #{version} (MLX's wheel needs 2.35 or newer)", if(!ok?, do: "a newer OS"))

      _ ->
        finding("C library", :warn, "not glibc, or unknown: MLX's wheel needs glibc 2.35 or newer", nil)
    end
  rescue
    ErlangError -> finding("C library", :warn, "unknown (no getconf)", nil)
  end

  defp normalize(version) do
    case String.split(version, ".") do
      [major, minor] -> "#{major}.#{minor}.0"
      _ -> version
    end
  end

  defp total_ram do
    with {:ok, text} <- File.read("/proc/meminfo"),
         [_, kb] <- Regex.run(~r/MemTotal:\s+(\d+) kB/, text) do
      String.to_integer(kb) * 1024
    else
      _ -> 0
    end
  end

  defp mib(bytes), do: "#{Float.round(bytes / 1024 ** 3, 1)} GiB"
end

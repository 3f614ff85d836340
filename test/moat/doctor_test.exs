defmodule Moat.DoctorTest do
  use ExUnit.Case, async: false

  @root Path.expand("../..", __DIR__)

  setup do
    tmp = Path.join(System.tmp_dir!(), "moat-doctor-#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)
    on_exit(fn -> File.rm_rf!(tmp) end)
    %{tmp: tmp}
  end

  defp find(findings, check), do: Enum.find(findings, &(&1.check == check))

  # The :cpu_only tests check this checkout's CPU build: its priv/ worker and
  # MLX, its build script, the CPU wheel (bin/gpu carries none of them).
  @tag :cpu_only
  test "on this checkout's build everything is found and the self-test restarts a worker" do
    findings = Moat.Doctor.run()
    text = Moat.Doctor.format(findings)
    assert %{status: :ok, detail: "0.32.4, flavour cpu (mlx-cpu)" <> _} = find(findings, "MLX"), text
    assert %{status: :ok} = find(findings, "Finalizer NIF"), text
    assert %{status: :ok, detail: kernels} = find(findings, "CPU kernels"), text
    assert kernels =~ ~r/^(AVX-512|AVX2|scalar)/, text

    assert %{status: :ok, detail: "computed, killed the worker (SIGKILL), generation 2" <> _} =
             find(findings, "Self-test")

    assert text =~ ~r/BLAS +\S+, [\d.]+ GFLOP\/s/
  end

  @tag :cpu_only
  test "a worker without its MLX and a missing finalizer NIF are reported with their fixes", %{tmp: tmp} do
    # The worker binary as a build leaves it, but without the lib/ beside
    # it: what a project sees when MLX was never installed or was removed.
    File.cp!(Application.app_dir(:moat, "priv/moat_port"), Path.join(tmp, "moat_port"))
    findings = Moat.Doctor.run(priv: tmp)
    text = Moat.Doctor.format(findings)

    assert %{status: :error, detail: "libmlx.so not found by the worker" <> _, fix: "mix moat.setup" <> _} =
             find(findings, "MLX"),
           text

    assert %{status: :error, detail: "not started" <> _} = find(findings, "Worker")
    assert %{status: :error, fix: "install a C compiler" <> _} = find(findings, "Finalizer NIF"), text
    assert text =~ "fix: mix moat.setup"
    assert text =~ "problem(s), each with its fix above"
  end

  test "no worker at all (Moat compiled before MLX was installed)", %{tmp: tmp} do
    assert %{status: :error, detail: detail, fix: "mix moat.setup" <> _} = find(Moat.Doctor.run(priv: tmp), "MLX")
    assert detail =~ "is not built"
  end

  @tag :cpu_only
  test "build.rs says the one command that installs MLX when it finds none", %{tmp: tmp} do
    # The compiled build script of this checkout, run as cargo runs it, with
    # an empty cache and no python3 (so no pip-installed mlx either).
    script =
      Path.join(@root, "target/release/build/moat_port-*/build-script-build")
      |> Path.wildcard()
      |> Enum.max_by(&File.stat!(&1, time: :posix).mtime)

    env = [{"OUT_DIR", tmp}, {"MOAT_CACHE", tmp}, {"MOAT_MLX_DIR", nil}, {"MOAT_MLX", nil}, {"PATH", tmp}]
    {out, status} = System.cmd(script, [], cd: Path.join(@root, "port"), env: env, stderr_to_stdout: true)
    assert status == 1
    assert out =~ "moat: MLX 0.32.4 (mlx-cpu) not found. Install it with\n\n    mix moat.setup --mlx cpu\n"
  end

  @tag :cpu_only
  test "mix moat.setup installs the pinned wheel into an empty cache (offline, from a wheel folder)", %{tmp: tmp} do
    wheels = Path.join(System.get_env("MOAT_CACHE", Path.expand("~/.cache/moat")), "src/wheels")

    if not File.exists?(Path.join(wheels, "mlx_cpu-0.32.4-py3-none-manylinux_2_35_x86_64.whl")),
      do: flunk("no wheel in #{wheels}")

    env = [{"MOAT_CACHE", tmp}, {"MIX_ENV", "test"}]
    args = ~w(moat.setup --mlx cpu --no-build --find-links) ++ [wheels]
    {out, status} = System.cmd("mix", args, cd: @root, env: env, stderr_to_stdout: true)
    assert status == 0, out
    assert File.exists?(Path.join(tmp, "mlx-cpu-0.32.4/mlx/lib/libmlx.so"))
    assert File.exists?(Path.join(tmp, "mlx-cpu-0.32.4/mlx/include/mlx/mlx.h"))

    # A second run only checks.
    {out, 0} = System.cmd("mix", args, cd: @root, env: env, stderr_to_stdout: true)
    assert out =~ "is installed in #{tmp}/mlx-cpu-0.32.4"
  end
end

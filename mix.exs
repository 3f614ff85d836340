# The worker's and the finalizer's compilers and `mix moat.setup` live there,
# outside elixir/: they must run before Moat is compiled.
Code.require_file("mix/build.exs", __DIR__)

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
      description: "An Nx backend on Apple's MLX, run in a supervised, crash-isolated worker process",
      package: package(),
      docs: docs()
    ]
  end

  # Exactly what a project that depends on Moat needs to build it: the Rust
  # worker (with the C++ shim and the MLX pins), the finalizer NIF's source,
  # the Elixir sources and their build logic. Checked by test/moat/package_test.exs.
  defp package do
    [
      licenses: ["Apache-2.0"],
      links: %{"MLX" => "https://github.com/ml-explore/mlx", "Nx" => "https://github.com/elixir-nx/nx"},
      files: ~w(mix.exs mix/build.exs .formatter.exs Cargo.toml Cargo.lock port/Cargo.toml port/build.rs
        port/mlx.pins port/src port/shim port/tests nif/moat_finalizer.c elixir package protocol.md README.md
        ARCHITECTURE.md LICENSE docs notebooks)
    ]
  end

  defp docs do
    [
      main: "readme",
      extras: ["README.md", "protocol.md", "docs/reliability.md"],
      groups_for_extras: [Guides: ["README.md"], Reference: ["protocol.md", "docs/reliability.md"]]
    ]
  end

  defp elixirc_paths(:test), do: ["elixir", "test/support"]
  defp elixirc_paths(_), do: ["elixir"]

  def application do
    [
      extra_applications: [:logger, :crypto],
      mod: {Moat.Application, []}
    ]
  end

  # Nx, complex and telemetry come from Hex. Where hex.pm is out of reach,
  # put source checkouts in MOAT_DEPS_DIR (default ~/.cache/moat/deps):
  # nx/ (elixir-nx/nx at v0.13.1), complex/ and telemetry/ (v1.3.0). This
  # holds for projects that depend on Moat too. MOAT_DEPS_DIR=none uses Hex
  # regardless, as `mix hex.build` needs.
  defp deps do
    dir = System.get_env("MOAT_DEPS_DIR") || Path.expand("~/.cache/moat/deps")

    if dir not in ["", "none"] and File.dir?(Path.join(dir, "nx/nx")) do
      [
        {:nx, path: Path.join(dir, "nx/nx"), override: true},
        {:complex, path: Path.join(dir, "complex"), override: true},
        {:telemetry, path: Path.join(dir, "telemetry"), override: true}
      ]
    else
      [{:nx, "~> 0.13"}, {:telemetry, "~> 1.0"}, {:ex_doc, "~> 0.34", only: :dev, runtime: false}]
    end
  end
end

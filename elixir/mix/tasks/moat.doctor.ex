defmodule Mix.Tasks.Moat.Doctor do
  @shortdoc "Checks what Moat will use on this machine and how to fix what is missing"
  @moduledoc """
  Prints one screen: MLX's version and flavour, the BLAS and its measured
  speed, devices, shared memory, the memory limit, the finalizer NIF, the C++
  compiler and the C library, and a self-test that kills a worker and sees it
  restart. Each problem comes with its fix. Exits with status 1 when one is
  an error. See `Moat.Doctor` (in a release: `bin/APP eval "Moat.Doctor.main()"`).

      mix moat.doctor [--no-self-test]
  """
  use Mix.Task

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [self_test: :boolean])
    Mix.Task.run("app.config")
    # The doctor starts a worker of its own; the application's would fail to
    # start where MLX is missing.
    Application.put_env(:moat, :start_worker, false)
    {:ok, _} = Application.ensure_all_started(:moat)

    if Moat.Doctor.main(self_test: Keyword.get(opts, :self_test, true)) == :error do
      exit({:shutdown, 1})
    end
  end
end

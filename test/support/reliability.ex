defmodule Moat.Reliability do
  @moduledoc false
  # Helpers for the reliability suite (test/moat/reliability/): the
  # fault-injection build of the worker, fault requests, OS-level probes, and
  # the rows of docs/reliability.md.

  alias Moat.Client

  @root Path.expand("../..", __DIR__)

  @doc """
  The worker built with the `fault-injection` feature, into its own target
  dir (the production binary never has the `:fault` op). Builds it on first
  use; cargo makes that a no-op when it is up to date. `MOAT_FAULT_WORKER`
  names a prebuilt one instead (bin/gpu, where there is no cargo).
  """
  def fault_worker_path do
    case :persistent_term.get({__MODULE__, :fault_worker}, System.get_env("MOAT_FAULT_WORKER")) do
      nil ->
        args = ~w(build --release --quiet -p moat_port --features fault-injection --target-dir target/fault)

        case System.cmd("cargo", args, cd: @root, stderr_to_stdout: true) do
          {_, 0} -> :ok
          {out, status} -> raise "building the fault-injection worker failed (#{status}):\n#{out}"
        end

        # Injected panics are expected; their backtraces would only clutter the
        # test output (workers inherit the VM's environment).
        System.put_env("RUST_BACKTRACE", "0")
        path = Path.join(@root, "target/fault/release/moat_port")
        :persistent_term.put({__MODULE__, :fault_worker}, path)
        path

      path ->
        path
    end
  end

  @doc """
  Asks the fault-injection worker to crash: `kind` is `:sigsegv`, `:sigfpe`,
  `:sigabrt`, `:sigkill`, `:panic`, `{:exit, code}`, `{:sleep, ms}`,
  `{:spin, ms}`, `:hang` or `:device_write` (a CUDA fault; GPU only);
  `delay_ms` fires it from another thread, in the middle of whatever the
  worker is doing then.
  """
  def inject(worker, kind, opts \\ []) do
    attrs =
      case kind do
        {:exit, code} -> %{kind: :exit, code: code}
        {:sleep, ms} -> %{kind: :sleep, ms: ms}
        {:spin, ms} -> %{kind: :spin, ms: ms}
        kind -> %{kind: kind}
      end

    attrs = if d = opts[:delay_ms], do: Map.put(attrs, :delay_ms, d), else: attrs
    Client.cast(Client.conn(worker), :fault, [], [], attrs)
  end

  @doc "How each injected fault shows in `Moat.Worker`'s exit description."
  def cause(:sigsegv), do: "SIGSEGV"
  def cause(:sigfpe), do: "SIGFPE"
  def cause(:sigabrt), do: "SIGABRT"
  def cause(:sigkill), do: "SIGKILL"
  def cause(:panic), do: "status 101"
  def cause({:exit, code}), do: "status #{code}"

  @doc "A `/proc/<pid>/status` field, in bytes (`VmRSS`, `VmHWM`, `VmPeak`...)."
  def proc_status_bytes(os_pid, field) do
    "/proc/#{os_pid}/status"
    |> File.read!()
    |> String.split("\n")
    |> Enum.find_value(fn line ->
      case String.split(line) do
        [^field <> ":", kb, "kB"] -> String.to_integer(kb) * 1024
        _ -> nil
      end
    end)
  end

  @doc "The worker's open descriptors: `[{fd, target}]`."
  def open_fds(os_pid) do
    dir = "/proc/#{os_pid}/fd"

    dir
    |> File.ls!()
    |> Enum.map(fn fd -> {String.to_integer(fd), link(Path.join(dir, fd))} end)
    |> Enum.sort()
  end

  defp link(path) do
    case :file.read_link_all(String.to_charlist(path)) do
      {:ok, target} -> List.to_string(target)
      {:error, why} -> "(#{why})"
    end
  end

  @doc """
  Appends a row to the reliability log named by `MOAT_RELIABILITY_LOG`, if
  set: its group (`:crashes`, `:malformed`, `:load`, `:security`), the fault,
  how many were injected, how many the system survived, how many results were
  lost or wrong, and a note. `bin/reliability-report` turns the log into
  docs/reliability.md.
  """
  def record(group, fault, injected, survived, lost, note) do
    if path = System.get_env("MOAT_RELIABILITY_LOG") do
      File.write!(path, "#{group}\t#{fault}\t#{injected}\t#{survived}\t#{lost}\t#{note}\n", [:append])
    end

    :ok
  end

  @doc """
  Appends a row of what a test observed, answer by answer, to the same log:
  the faults `:injected`, and of the callers' answers those `:correct`, those
  that were `:errors` (a `Moat.Error`), the callers `:hung` (no answer) and
  the results `:lost` (wrong data). Record first, then assert, so that the
  row counts what happened.
  """
  def record_observed(group, fault, %{injected: i, correct: c, errors: e, hung: h, lost: l}, note) do
    if path = System.get_env("MOAT_RELIABILITY_LOG") do
      File.write!(path, "#{group}\t#{fault}\t#{i}\t#{c}\t#{e}\t#{h}\t#{l}\t#{note}\n", [:append])
    end

    :ok
  end

  @doc "The machine's available memory, in bytes (`MemAvailable`)."
  def mem_available do
    "/proc/meminfo"
    |> File.read!()
    |> String.split("\n")
    |> Enum.find_value(fn line ->
      case String.split(line) do
        ["MemAvailable:", kb, "kB"] -> String.to_integer(kb) * 1024
        _ -> nil
      end
    end)
  end

  @doc "An integer setting from the environment (soak runs raise the counts)."
  def env_int(name, default) do
    case System.get_env(name) do
      nil -> default
      value -> String.to_integer(value)
    end
  end
end

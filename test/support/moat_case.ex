defmodule Moat.Case do
  @moduledoc false
  # Helpers for tests that drive real workers.

  import ExUnit.Assertions

  @doc "Starts a private worker under the test supervisor; returns its name."
  def start_worker(name, opts \\ []) do
    ExUnit.Callbacks.start_supervised!(Supervisor.child_spec({Moat.Worker, Keyword.put(opts, :name, name)}, id: name))

    name
  end

  @doc """
  Whether the default worker computes on a GPU (bin/gpu). MLX's CUDA backend
  has no float64: there f64 is an ArgumentError (test/moat/gpu_test.exs).
  """
  def gpu?, do: Map.get(Moat.Worker.info(), :device) == :gpu

  @doc "`types` less f64 (as `{:f, 64}` or `:f64`) where the default worker is on a GPU."
  def device_types(types), do: if(gpu?(), do: types -- [{:f, 64}, :f64], else: types)

  def os_pid(worker \\ Moat.Worker), do: Moat.Worker.info(worker).os_pid

  def os_alive?(pid), do: File.exists?("/proc/#{pid}") and not zombie?(pid)

  defp zombie?(pid) do
    case File.read("/proc/#{pid}/stat") do
      {:ok, stat} -> stat |> String.split(") ") |> List.last() |> String.starts_with?("Z")
      _ -> false
    end
  end

  def kill(os_pid, signal \\ "KILL"), do: System.cmd("kill", ["-#{signal}", "#{os_pid}"])

  @doc "Waits until `fun` returns a truthy value, or fails after `ms`."
  def eventually(fun, ms \\ 2_000) do
    deadline = System.monotonic_time(:millisecond) + ms
    do_eventually(fun, deadline, ms)
  end

  defp do_eventually(fun, deadline, ms) do
    case fun.() do
      result when result not in [nil, false] ->
        result

      _ ->
        if System.monotonic_time(:millisecond) > deadline, do: flunk("condition not met within #{ms} ms")
        Process.sleep(5)
        do_eventually(fun, deadline, ms)
    end
  end

  @doc "Waits for the worker to come back as a new generation."
  def await_generation_after(worker, generation) do
    eventually(fn ->
      try do
        Moat.Worker.info(worker).generation > generation
      rescue
        Moat.Error -> false
      end
    end)
  end

  @doc """
  Sends this process `{:telemetry, event, measurements, metadata}` for each
  of `events` (lists of event names) until the test ends.
  """
  def forward_events(events) do
    id = {__MODULE__, make_ref()}
    :telemetry.attach_many(id, events, &__MODULE__.forward_event/4, self())
    ExUnit.Callbacks.on_exit(fn -> :telemetry.detach(id) end)
  end

  @doc "Reads `ref` back: `{transfer, bytes}`, `transfer` being how `to_binary` read it (its telemetry's `:transfer`)."
  def read_back(ref) do
    id = "read-back-#{System.unique_integer([:positive])}"
    :telemetry.attach(id, [:moat, :to_binary, :stop], &__MODULE__.forward_event/4, self())

    try do
      data = Moat.to_binary(ref)
      assert_received {:telemetry, [:moat, :to_binary, :stop], _, %{transfer: transfer}}
      {transfer, data}
    after
      :telemetry.detach(id)
    end
  end

  @doc false
  def forward_event(event, measurements, metadata, pid) do
    send(pid, {:telemetry, event, measurements, metadata})
  end

  def f32(values), do: for(v <- values, into: <<>>, do: <<v::float-32-native>>)

  def from_f32(binary), do: for(<<v::float-32-native <- binary>>, do: v)
end

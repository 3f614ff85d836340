defmodule Moat.Releaser do
  @moduledoc false
  # One per worker incarnation, linked to its Moat.Worker: collects the ids
  # of tensors to forget and sends them in batches, one :release frame per
  # batch.
  #
  # Ids arrive as `{:moat_release, id}` (`Moat.deallocate/1`),
  # `{:moat_release_ids, ids}` (`Moat.scope/1`), and in the finalizer's queue
  # (garbage-collected handles; `{:moat_released}` says it is not empty). A
  # batch goes out when the mailbox runs empty or @max_batch ids wait, in
  # frames of at most @max_batch ids.
  #
  # It also makes creators collect their garbage. Each process that creates a
  # tensor of this worker announces itself once. A handle is a few words on
  # its heap, so a process can drop gigabytes of tensors without ever needing
  # a collection:
  #
  #   * on `{:memory_pressure, active}` (the worker's live buffers grew by
  #     half since their last low point), every creator gets a full-sweep
  #     garbage collection (a busy creator also collects itself, at its next
  #     handle: see Moat.Handles.ref/2);
  #   * a process that goes idle (a Livebook evaluator between cells) may
  #     never collect again: every `:gc_nudge` milliseconds, a creator whose
  #     reduction count has not moved since the previous tick is collected
  #     once, and not again until it runs.

  #
  # It knows nothing of the connection: `attach/2` gives it the function that
  # sends one `:release` frame (so that it depends on no module that
  # depends on it).

  use GenServer

  alias Moat.Finalizer

  @max_batch 8192

  @doc false
  def start_link(opts), do: GenServer.start_link(__MODULE__, opts)

  @doc false
  # `send_release` sends one `:release` frame of the ids it is given.
  def attach(releaser, send_release) when is_function(send_release, 1),
    do: GenServer.cast(releaser, {:attach, send_release})

  @doc """
  Sends every id received so far; returns once their frame is on its way
  (at once if the releaser is gone: its worker and tensors went with it).
  """
  def flush(releaser) do
    GenServer.call(releaser, :flush, :infinity)
  catch
    :exit, _ -> :ok
  end

  @impl true
  def init(opts) do
    nudge = Keyword.fetch!(opts, :gc_nudge)
    if nudge, do: Process.send_after(self(), :nudge, nudge)
    {:ok, %{send_release: nil, pending: [], count: 0, creators: %{}, nudge: nudge}}
  end

  @impl true
  def handle_cast({:attach, send_release}, state), do: next(%{state | send_release: send_release})

  @impl true
  # The caller's garbage queued its ids before this call arrived.
  def handle_call(:flush, _from, state), do: {:reply, :ok, state |> drain() |> send_batch()}

  @impl true
  def handle_info({:moat_release, id}, state) do
    next(%{state | pending: [id | state.pending], count: state.count + 1})
  end

  def handle_info({:moat_released}, state), do: next(drain(state))

  def handle_info({:moat_release_ids, ids}, state) do
    next(%{state | pending: ids ++ state.pending, count: state.count + length(ids)})
  end

  def handle_info(:timeout, state), do: {:noreply, send_batch(state)}

  def handle_info({:moat_creator, pid}, state) do
    if Map.has_key?(state.creators, pid) do
      next(state)
    else
      Process.monitor(pid)
      next(put_in(state.creators[pid], {:busy, nil}))
    end
  end

  def handle_info({:memory_pressure, _active}, state) do
    next(%{state | creators: Map.new(state.creators, &collect/1)})
  end

  def handle_info({:DOWN, _, :process, pid, _}, state), do: next(%{state | creators: Map.delete(state.creators, pid)})

  def handle_info(:nudge, state) do
    Process.send_after(self(), :nudge, state.nudge)
    next(%{state | creators: Map.new(state.creators, &nudge/1)})
  end

  def handle_info({:garbage_collect, {__MODULE__, pid}, _}, state) do
    # Count from after the collection, whose own reductions are not activity.
    case {state.creators, Process.info(pid, :reductions)} do
      {%{^pid => _}, {:reductions, now}} -> next(put_in(state.creators[pid], {:collected, now}))
      _ -> next(state)
    end
  end

  def handle_info(_other, state), do: next(state)

  defp collect({_pid, {:collecting, _}} = creator), do: creator

  defp collect({pid, {_, seen}}) do
    :erlang.garbage_collect(pid, async: {__MODULE__, pid})
    {pid, {:collecting, seen}}
  end

  # A creator is {:busy, reductions} until a tick finds its reductions
  # unchanged; it is collected then, and stays {:collected, reductions}
  # until it runs again.
  defp nudge({pid, {phase, seen}} = creator) do
    case Process.info(pid, :reductions) do
      {:reductions, ^seen} when phase == :busy ->
        :erlang.garbage_collect(pid, async: {__MODULE__, pid})
        {pid, {:collecting, seen}}

      {:reductions, _} when phase == :collecting ->
        creator

      {:reductions, ^seen} ->
        creator

      {:reductions, now} ->
        {pid, {:busy, now}}

      nil ->
        creator
    end
  end

  defp drain(state) do
    case Finalizer.drain(self()) do
      [] -> state
      ids -> drain(%{state | pending: ids ++ state.pending, count: state.count + length(ids)})
    end
  end

  defp next(%{pending: []} = state), do: {:noreply, state}
  defp next(%{count: count} = state) when count >= @max_batch, do: {:noreply, send_batch(state)}
  # Timeout 0: :timeout arrives once the mailbox is empty.
  defp next(state), do: {:noreply, state, 0}

  defp send_batch(%{pending: []} = state), do: state
  defp send_batch(%{send_release: nil} = state), do: state

  # At most @max_batch ids a frame keeps headers far below their limit.
  defp send_batch(%{send_release: send_release, pending: ids} = state) do
    try do
      ids
      |> Enum.chunk_every(@max_batch)
      |> Enum.each(send_release)
    rescue
      # The worker died: its tensors are gone with it.
      Moat.Error -> :ok
    end

    %{state | pending: [], count: 0}
  end
end

defmodule Moat.Writer do
  @moduledoc false
  # One per local worker incarnation (where the finalizer NIF is loaded),
  # linked to its Moat.Worker: it flushes the connection's outbox
  # (Moat.Finalizer.outbox_*, docs/latency.md "Batched writes").
  #
  # Casts push their frame and return; the first push after a flush wakes
  # this process with {:moat_outbox}, and its flush writes everything queued
  # by then as batch packets (protocol.md §1, "Batches"): a batch holds what
  # piled up while this process was waking, so its size follows the load,
  # with no timer. Calls do not wait for it: a call behind queued frames
  # writes them itself, with its own frame last (Moat.Client).
  #
  # Every write of queued frames happens inside the NIF, under the outbox's
  # lock, so frames reach the port in push order whoever flushes, and
  # nothing taken out of the outbox can be lost with a process that dies.
  # This process dying closes the outbox (the NIF monitors it: later pushes
  # answer :closed) and takes its owner down (the link), so every caller is
  # answered as for any worker death; a write the port refuses (the worker
  # died) closes it too.

  alias Moat.Finalizer

  @doc "Payloads this large (bytes) or larger are written by their sender (Moat.Client)."
  def large_payload, do: 64 * 1024

  @doc false
  # Starts the writer of `port`, linked to the caller; returns it and the outbox.
  def start_link(port) do
    owner = self()
    writer = spawn_link(fn -> init(owner) end)
    outbox = Finalizer.outbox_new(writer, port)
    send(writer, {:outbox, outbox})
    {writer, outbox}
  end

  defp init(owner) do
    Process.monitor(owner)

    receive do
      {:outbox, outbox} -> loop(outbox)
    end
  end

  defp loop(outbox) do
    receive do
      {:moat_outbox} -> Finalizer.outbox_flush(outbox)
      {:DOWN, _, :process, _, _} -> exit(:normal)
    end

    loop(outbox)
  end
end

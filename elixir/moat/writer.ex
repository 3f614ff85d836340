defmodule Moat.Writer do
  @moduledoc false
  # One per local worker incarnation (where the finalizer NIF is loaded),
  # linked to its Moat.Worker: the only process that takes frames out of the
  # connection's outbox (Moat.Finalizer.outbox_*), and writes everything it
  # takes to the port as one batch packet (protocol.md §1, "Batches").
  #
  # Casts push their frame and return; the first push into an empty outbox
  # wakes this process with {:moat_outbox}, and it takes and writes until a
  # take finds nothing, so a batch holds whatever piled up while the last
  # one was written: its size follows the load, with no timer. Calls write
  # directly while nothing is queued or being written (Moat.Client).
  #
  # A frame with a large payload is pushed as {:notify, pid, ref, frame}:
  # it goes alone, in its own packet, in its place in the order, and its
  # sender, which waits, hears `{ref, :written}` (or `{ref, :closed}`).
  # So at most one such frame per sender waits here, and the port's busy
  # limit still bounds the payload bytes in flight.
  #
  # A failed write (the port is closed: the worker died) closes the outbox,
  # so later pushes answer :closed; the owner's exit takes this process
  # down with it. This process dying closes the outbox too (the NIF
  # monitors it), and takes its owner down (the link): every caller is
  # answered as for any worker death.

  alias Moat.{Finalizer, Protocol}

  # Frames per batch packet: each is at most a header (≤ 1 MiB, in practice
  # a few hundred bytes) and a payload below @large_payload, so a packet
  # stays far below `max_frame_bytes`, which the worker applies to each
  # frame of a batch.
  @max_batch 256

  @doc "Payloads this large (bytes) or larger go alone (see above)."
  def large_payload, do: 64 * 1024

  @doc false
  # Starts the writer of `port`, linked to the caller; returns the outbox.
  def start_link(port) do
    owner = self()
    writer = spawn_link(fn -> init(owner, port) end)
    outbox = Finalizer.outbox_new(writer)
    send(writer, {:outbox, outbox})
    {writer, outbox}
  end

  defp init(owner, port) do
    Process.monitor(owner)

    receive do
      {:outbox, outbox} -> loop(port, outbox)
    end
  end

  defp loop(port, outbox) do
    receive do
      {:moat_outbox} -> drain(port, outbox)
      {:DOWN, _, :process, _, _} -> exit(:normal)
    end

    loop(port, outbox)
  end

  defp drain(port, outbox) do
    case Finalizer.outbox_take(outbox) do
      [] ->
        :ok

      :closed ->
        :ok

      frames ->
        write(port, outbox, frames, [], 0)
        drain(port, outbox)
    end
  end

  defp write(port, outbox, [], batch, _n), do: flush(port, outbox, batch)

  defp write(port, outbox, [{:notify, pid, ref, frame} | rest], batch, _n) do
    if flush(port, outbox, batch) and transmit(port, outbox, frame) do
      send(pid, {ref, :written})
      write(port, outbox, rest, [], 0)
    else
      failed([{:notify, pid, ref, frame} | rest])
    end
  end

  defp write(port, outbox, [frame | rest], batch, n) when n < @max_batch,
    do: write(port, outbox, rest, [frame | batch], n + 1)

  defp write(port, outbox, frames, batch, _n) do
    if flush(port, outbox, batch), do: write(port, outbox, frames, [], 0), else: failed(frames)
  end

  # The port is closed: senders waiting for their frames hear so.
  defp failed(frames) do
    for {:notify, pid, ref, _} <- frames, do: send(pid, {ref, :closed})
    false
  end

  defp flush(_port, _outbox, []), do: true
  defp flush(port, outbox, batch), do: transmit(port, outbox, Protocol.batch(Enum.reverse(batch)))

  defp transmit(port, outbox, iodata) do
    Port.command(port, iodata)
    true
  rescue
    ArgumentError ->
      Finalizer.outbox_close(outbox)
      false
  end
end

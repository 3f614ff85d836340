defmodule Moat.Reliability.LargeDataTest do
  # A tensor of 2 GiB and 12 bytes (so byte offsets and sizes cross 2^31)
  # goes to the worker and back intact: through the pipe, in frames of at
  # most chunk_bytes each way, and through shared memory (a memory file
  # written with one pwrite, read back with one pread of the worker's
  # memory). Needs about 8 GiB of free memory: test_helper.exs excludes
  # :large where there is less.
  use ExUnit.Case, async: false
  import Moat.Case
  import Bitwise

  alias Moat.Reliability

  @moduletag :large
  @moduletag timeout: 600_000

  for {transfer, shared?} <- [pipe: false, shared_memory: true] do
    test "2 GiB to the worker and back, intact (#{transfer})" do
      transfer = unquote(transfer)
      shared? = unquote(shared?)
      worker = start_worker(:"large_data_#{transfer}", log_level: :error, shared_memory: shared?)
      %{os_pid: os_pid, chunk_bytes: chunk} = Moat.Worker.info(worker)
      assert Moat.Client.conn(worker).shared != nil == shared?
      n = (1 <<< 29) + 3
      data = bytes(4 * n)
      sent_hash = :crypto.hash(:sha256, data)
      started = System.monotonic_time(:millisecond)

      ref = Moat.from_binary(data, {n}, {:u, 32}, worker: worker)
      assert Moat.shape(ref) == {n}
      back = Moat.to_binary(ref)

      elapsed = System.monotonic_time(:millisecond) - started
      assert byte_size(back) == byte_size(data)
      assert :crypto.hash(:sha256, back) == sent_hash
      # Held once in the worker: read straight into its final buffer (or
      # mapped from the file it was written to), read back from it. On a GPU
      # the tensor lives on the card: a mapped upload is copied there at its
      # first evaluation (here the readback, whose host buffer then exists
      # beside it), and CUDA's context takes about 0.5 GB.
      peak = Reliability.proc_status_bytes(os_pid, "VmHWM")

      bound =
        if gpu?() and shared?,
          do: 2 * byte_size(data) + 768 * 1024 ** 2,
          else: byte_size(data) + 512 * 1024 ** 2

      assert peak < bound, "worker peak RSS #{div(peak, 1_048_576)} MiB"

      Reliability.record(
        :load,
        "2 GiB + 12 B tensor, to the worker and back (#{transfer})",
        1,
        1,
        0,
        "#{how(transfer, byte_size(data), chunk)}; SHA-256 equal; #{elapsed} ms; worker peak RSS #{div(peak, 1_048_576)} MiB"
      )
    end
  end

  defp how(:pipe, size, chunk), do: "#{2 * div(size + chunk - 1, chunk)} frames of at most #{div(chunk, 1_048_576)} MiB"
  defp how(:shared_memory, _size, _chunk), do: "one pwrite into a memory file, one pread of the worker's memory"

  # Random bytes (strong_rand_bytes stops below 2 GiB): 64 MiB of them,
  # rotated differently in each 64 MiB stretch, so a chunk misplaced or
  # shifted anywhere changes the hash.
  defp bytes(size) do
    block_size = 64 * 1024 * 1024
    block = :crypto.strong_rand_bytes(block_size)

    blocks =
      for k <- 0..(div(size, block_size) - 1) do
        r = k * 4099
        [binary_part(block, r, block_size - r), binary_part(block, 0, r)]
      end

    IO.iodata_to_binary([blocks, :crypto.strong_rand_bytes(rem(size, block_size))])
  end
end

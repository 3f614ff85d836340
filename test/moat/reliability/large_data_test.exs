defmodule Moat.Reliability.LargeDataTest do
  # A tensor of 2 GiB and 12 bytes (so byte offsets and sizes cross 2^31)
  # goes to the worker and back intact, in frames of at most chunk_bytes each
  # way. Needs about 8 GiB of free memory: test_helper.exs excludes :large
  # where there is less.
  use ExUnit.Case, async: false
  import Moat.Case
  import Bitwise

  alias Moat.Reliability

  @moduletag :large
  @moduletag timeout: 600_000

  test "2 GiB to the worker and back, intact" do
    worker = start_worker(:large_data, log_level: :error)
    %{os_pid: os_pid, chunk_bytes: chunk} = Moat.Worker.info(worker)
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
    # Held once in the worker: read straight into its final buffer, sent
    # back from it.
    peak = Reliability.proc_status_bytes(os_pid, "VmHWM")
    assert peak < byte_size(data) + 512 * 1024 * 1024, "worker peak RSS #{div(peak, 1_048_576)} MiB"

    frames = 2 * div(byte_size(data) + chunk - 1, chunk)

    Reliability.record(
      :load,
      "2 GiB + 12 B tensor, to the worker and back",
      1,
      1,
      0,
      "#{frames} frames of at most #{div(chunk, 1_048_576)} MiB; SHA-256 equal; #{elapsed} ms; worker peak RSS #{div(peak, 1_048_576)} MiB"
    )
  end

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

defmodule Moat.FinalizerTest do
  # Tokens (nif/moat_finalizer.c): a dropped token's id reaches the queue of
  # its own releaser, however many releasers were seen before and in
  # whatever order (the list of queues is reordered on every lookup).
  use ExUnit.Case, async: true
  import Moat.Case

  alias Moat.Finalizer

  # Makes a token in a process that then exits, so the VM frees it.
  defp drop_token(releaser, id) do
    {pid, ref} = spawn_monitor(fn -> Finalizer.new(releaser, id) end)
    assert_receive {:DOWN, ^ref, :process, ^pid, :normal}
  end

  defp drain_all(releaser, acc \\ []) do
    case Finalizer.drain(releaser) do
      [] -> acc
      ids -> drain_all(releaser, ids ++ acc)
    end
  end

  test "each dropped token's id reaches its own releaser, whatever the order releasers were seen in" do
    assert Finalizer.loaded?()
    releasers = for _ <- 1..40, do: spawn(fn -> Process.sleep(:infinity) end)

    expected =
      for round <- 1..3, {releaser, i} <- Enum.shuffle(Enum.with_index(releasers)), reduce: %{} do
        acc ->
          id = round * 1000 + i
          drop_token(releaser, id)
          Map.update(acc, releaser, [id], &[id | &1])
      end

    for releaser <- releasers do
      want = Enum.sort(expected[releaser])
      # drain/1 takes what it returns: keep what earlier tries got.
      eventually(fn ->
        got = Process.get({:got, releaser}, []) ++ drain_all(releaser)
        Process.put({:got, releaser}, got)
        Enum.sort(got) == want
      end)
    end

    # A released token queues nothing.
    [first | _] = releasers
    token = Finalizer.new(first, 99)
    assert Finalizer.release(token)
    refute Finalizer.release(token)
    assert Finalizer.drain(first) == []
    Enum.each(releasers, &Process.exit(&1, :kill))
  end
end

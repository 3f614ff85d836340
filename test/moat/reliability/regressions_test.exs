defmodule Moat.Reliability.RegressionsTest do
  # Bugs the reliability suite found in the client, one test each (the others
  # are covered where they belong: the owner surviving damaged frames in
  # malformed_test.exs, the crash cause reaching every caller in crash_test.exs).
  use ExUnit.Case, async: false

  alias Moat.Client

  test "ids drawn concurrently by many first callers are unique" do
    # Ids once came from a counter created lazily by its first caller, under
    # this key; racing first callers each made one and drew the same ids.
    :persistent_term.erase({Client, :ids})
    parent = self()

    for _ <- 1..50 do
      spawn_link(fn -> send(parent, {:ids, [Client.new_id() | Client.new_ids(200)]}) end)
    end

    ids =
      for _ <- 1..50 do
        assert_receive {:ids, ids}, 5_000
        ids
      end
      |> List.flatten()

    assert length(ids) == 50 * 201
    assert length(Enum.uniq(ids)) == length(ids)
    assert Enum.all?(ids, &(&1 > 0 and &1 < 18_446_744_073_709_551_616))
  end
end

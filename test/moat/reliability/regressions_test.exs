defmodule Moat.Reliability.RegressionsTest do
  # Bugs the reliability suite found in the client and the backend, one test each.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.Client

  test "ids drawn concurrently by many first callers are unique" do
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

  test "an operand from another backend joins the worker of the Moat operands" do
    worker = start_worker(:regression_other_worker)
    a = Nx.tensor([1.0, 2.0], backend: {Moat.Backend, worker: worker})
    b = Nx.tensor([10.0, 20.0], backend: Nx.BinaryBackend)

    for result <- [Nx.add(a, b), Nx.add(b, a), Nx.divide(b, a)] do
      assert result.data.ref.worker == worker
    end

    assert Nx.to_flat_list(Nx.divide(b, a)) == [10.0, 10.0]
  end

  test "a handle used on another worker raises instead of reaching the wrong worker" do
    worker = start_worker(:regression_foreign)
    here = Moat.from_binary(f32([1.0]), {1}, {:f, 32})
    conn = Client.conn(worker)

    assert_raise ArgumentError, ~r/lives in worker Moat.Worker, not :regression_foreign/, fn ->
      Client.ids!(conn, [here], :add)
    end
  end
end

defmodule Moat.ErrorTest do
  # Failures as data end to end: the worker reports a kind and its fields
  # (protocol.md §4), and Moat.Error formats each once, "op: cause". The
  # message of every kind is pinned here; port/tests/failures.rs has the
  # worker's side.
  use ExUnit.Case, async: true

  import Moat.Case
  alias Moat.{Client, Error}

  @mib 1024 * 1024

  describe "from_worker/2 formats every kind once" do
    test "invalid, mlx, protocol and system keep the worker's message after the op" do
      for kind <- [:invalid, :mlx, :protocol, :system] do
        e = Error.from_worker(:add, %{kind: kind, message: "the cause"})
        assert {e.reason, e.op, e.kind, e.message, e.details} == {:op_failed, :add, kind, "add: the cause", %{}}
      end
    end

    test "memory_limit carries the sizes as details and points at the setting" do
      failure = %{
        kind: :memory_limit,
        message: "memory limit exceeded: needs 8.0 MiB, 1.0 MiB in use, limit 4.0 MiB",
        need: 8 * @mib,
        in_use: @mib,
        limit: 4 * @mib
      }

      e = Error.from_worker(:from_binary, failure)
      assert e.reason == :op_failed
      assert e.kind == :memory_limit
      assert e.details == %{need: 8 * @mib, in_use: @mib, limit: 4 * @mib}

      assert e.message ==
               "from_binary: memory limit exceeded: needs 8.0 MiB, 1.0 MiB in use, limit 4.0 MiB (Moat.set_memory_limit/1)"
    end

    test "stale_generation has its own reason and no op" do
      e = Error.from_worker(:stale_generation, %{kind: :stale_generation, message: "sync was sent to generation 2"})

      assert {e.reason, e.op, e.kind, e.message} ==
               {:stale_generation, nil, :stale_generation, "sync was sent to generation 2"}
    end

    test "a failure the client cannot read is a protocol failure that says so" do
      e = Error.from_worker(:add, "a bare string")
      assert {e.reason, e.op, e.kind} == {:op_failed, :add, :protocol}
      assert e.message == ~s(add: the worker sent a failure this client cannot read: "a bare string")
    end

    test "with_op/2 names another op, once" do
      e = Error.from_worker(:upload, %{kind: :invalid, message: "no upload in progress"}) |> Error.with_op(:from_binary)
      assert {e.op, e.message, e.kind} == {:from_binary, "from_binary: no upload in progress", :invalid}
      e = Error.new(:worker_unavailable, nil, "gone") |> Error.with_op(:from_binary)
      assert e.message == "from_binary: gone"
    end
  end

  describe "a real worker" do
    setup do
      name = :"error_test_#{System.unique_integer([:positive])}"
      %{worker: start_worker(name, shared_memory: false, log_level: :error)}
    end

    @tag :capture_log
    test "an upload over the memory limit names from_binary once", %{worker: w} do
      Moat.set_memory_limit(4 * @mib, w)
      ref = Moat.from_binary(:binary.copy(<<0>>, 8 * @mib), {8 * @mib}, {:u, 8}, worker: w)
      e = assert_raise Error, fn -> Moat.to_binary(ref) end
      assert {e.reason, e.op, e.kind} == {:op_failed, :from_binary, :memory_limit}
      assert %{need: 8_388_608, limit: 4_194_304, in_use: in_use} = e.details
      assert is_integer(in_use)

      assert e.message =~
               ~r/^from_binary: memory limit exceeded: needs 8.0 MiB, .* in use, limit 4.0 MiB \(Moat.set_memory_limit\/1\)$/
    end

    test "an unknown op is invalid", %{worker: w} do
      assert {:error, %Error{} = e} = Client.call(Client.conn(w), :frobnicate, [], nil)

      assert {e.reason, e.op, e.kind, e.message} ==
               {:op_failed, :frobnicate, :invalid, "frobnicate: unknown op frobnicate"}
    end

    test "an error MLX raises while evaluating is of kind mlx", %{worker: w} do
      a = Nx.tensor([[0.0, 0.0], [1.0, 1.0]], backend: {Moat.Backend, worker: w})
      x = Nx.LinAlg.triangular_solve(a, Nx.tensor([4.0, 2.0], backend: {Moat.Backend, worker: w}))
      e = assert_raise Error, fn -> Nx.to_binary(x) end
      assert {e.reason, e.op, e.kind} == {:op_failed, :to_binary, :mlx}
      assert e.message =~ ~r/^to_binary: .*triangular inversion failed/
    end
  end
end

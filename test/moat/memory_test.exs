defmodule Moat.MemoryTest do
  # Releasing tensors (explicitly, by scope, by process exit, automatically)
  # and the worker's memory statistics and limit, against real workers.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error, Ref}

  @mib 1024 * 1024

  setup do
    worker = start_worker(:memory_worker, gc_nudge: 50, log_level: :error)
    {:ok, worker: worker}
  end

  defp tensor(worker, values), do: Nx.tensor(values, type: :f32, backend: {Moat.Backend, worker: worker})

  defp ref(%Nx.Tensor{data: %Moat.Backend{ref: ref}}), do: ref

  # Names a tensor without holding its handle (nor a handle: a scope's
  # result would keep it).
  defp name(tensor), do: {:name, Map.from_struct(%{ref(tensor) | token: nil})}

  # Whether the worker still defines the id, after the releases requested so
  # far have reached it.
  defp alive?({:name, %{worker: worker} = fields}) do
    Moat.memory_info(worker)

    try do
      Moat.shape(struct!(Ref, fields))
      true
    rescue
      e in Error ->
        if e.message =~ "unknown tensor id", do: false, else: reraise(e, __STACKTRACE__)
    end
  end

  # Runs `fun` in a new process that returns the names of what it made, then
  # waits (never collecting garbage) until told to exit.
  defp in_process(fun) do
    parent = self()

    pid =
      spawn(fn ->
        send(parent, {:made, self(), fun.()})

        receive do
          :exit -> :ok
        end
      end)

    assert_receive {:made, ^pid, made}, 5_000
    {pid, made}
  end

  describe "explicit release" do
    test "backend_deallocate is :ok once, then :already_deallocated", %{worker: w} do
      t = tensor(w, [1.0, 2.0])
      n = name(t)
      assert Nx.backend_deallocate(t) == :ok
      assert Nx.backend_deallocate(t) == :already_deallocated
      refute alive?(n)
      # Using it raises at once, before anything is sent.
      error = assert_raise Error, fn -> Nx.to_binary(t) end
      assert error.reason == :deallocated
      assert_raise Error, ~r/was deallocated/, fn -> Nx.add(t, t) end
    end

    test "a handle rebuilt from its external term format shares the token while it lives", %{worker: w} do
      t = tensor(w, [1.0])
      copy = t |> :erlang.term_to_binary() |> :erlang.binary_to_term()
      assert Nx.backend_deallocate(copy) == :ok
      assert Nx.backend_deallocate(t) == :already_deallocated
      refute alive?(name(t))

      # Once every live copy is gone, a rebuilt handle's token is a plain
      # reference: deallocating it still works.
      {pid, {made, bin}} = in_process(fn -> tensor(w, [2.0]) |> then(&{name(&1), :erlang.term_to_binary(&1)}) end)
      send(pid, :exit)
      eventually(fn -> not alive?(made) end)
      assert Nx.backend_deallocate(:erlang.binary_to_term(bin)) == :ok
    end

    test "a handle from before a restart is already deallocated", %{worker: w} do
      t = tensor(w, [1.0])
      generation = Moat.Worker.info(w).generation
      kill(os_pid(w))
      await_generation_after(w, generation)
      assert Nx.backend_deallocate(t) == :already_deallocated
    end

    test "many releases travel in one :release frame", %{worker: w} do
      conn = Client.conn(w)
      tensors = for _ <- 1..1000, do: tensor(w, [1.0])
      Moat.memory_info(w)
      :sys.suspend(conn.releaser)
      Enum.each(tensors, &(:ok = Nx.backend_deallocate(&1)))
      sent = :atomics.get(conn.counters, 2)
      :sys.resume(conn.releaser)
      info = Moat.memory_info(w)
      # One :release frame and the :memory_info call.
      assert :atomics.get(conn.counters, 2) - sent == 2
      assert info.tensors == 0
    end
  end

  describe "scope" do
    test "a scope of 20,000 tensors releases them all", %{worker: w} do
      base = tensor(w, [1.0])
      sum = Moat.scope(fn -> for _ <- 1..20_000, reduce: base, do: (acc -> Nx.add(acc, base)) end)
      assert Moat.memory_info(w).tensors == 2
      assert Nx.to_flat_list(sum) == [20_001.0]
      assert Nx.to_flat_list(base) == [1.0]
    end

    test "releases what it created except what it returns, wherever it is", %{worker: w} do
      base = tensor(w, [1.0, 2.0])
      parent = self()

      {kept, %{deep: [{deep}]}} =
        Moat.scope(fn ->
          a = Nx.add(base, base)
          b = Nx.multiply(a, a)
          send(parent, {:temporaries, name(a), name(b)})
          {Nx.subtract(b, base), %{deep: [{Nx.add(b, base)}]}}
        end)

      assert_received {:temporaries, a, b}
      refute alive?(a)
      refute alive?(b)
      assert Nx.to_flat_list(kept) == [3.0, 14.0]
      assert Nx.to_flat_list(deep) == [5.0, 18.0]
      assert alive?(name(base)), "made outside the scope"
    end

    test "nested scopes hand what they return to the enclosing one", %{worker: w} do
      base = tensor(w, [2.0])

      {inner, outer} =
        Moat.scope(fn ->
          inner = Moat.scope(fn -> Nx.add(base, base) end)
          assert alive?(name(inner))
          {name(inner), name(Nx.multiply(inner, base))}
        end)

      refute alive?(inner), "the outer scope did not return it"
      refute alive?(outer)
    end

    test "an exception releases everything it created", %{worker: w} do
      parent = self()

      assert_raise RuntimeError, "boom", fn ->
        Moat.scope(fn ->
          send(parent, {:made, name(tensor(w, [1.0]))})
          raise "boom"
        end)
      end

      assert_received {:made, made}
      refute alive?(made)
    end
  end

  describe "automatic release" do
    test "a dropped tensor is released once its process collects garbage", %{worker: w} do
      made = for _ <- 1..10, do: name(Nx.add(tensor(w, [1.0]), tensor(w, [2.0])))
      kept = tensor(w, [7.0])
      :erlang.garbage_collect()
      eventually(fn -> not Enum.any?(made, &alive?/1) end)
      assert Nx.to_flat_list(kept) == [7.0]
    end

    test "a process that exits releases what only it held", %{worker: w} do
      # Held in its dictionary: a tensor the process merely dropped would be
      # collected by the idle nudge (the last test) before it exits.
      {pid, made} = in_process(fn -> name(tap(tensor(w, [1.0]), &Process.put(:held, &1))) end)
      assert alive?(made)
      send(pid, :exit)
      eventually(fn -> not alive?(made) end)
    end

    test "a tensor held by another process stays until that process drops it", %{worker: w} do
      parent = self()

      holder =
        spawn(fn ->
          receive do
            {:hold, t} ->
              receive do
                :drop -> send(parent, {:dropping, Nx.to_flat_list(t)})
              end

              # The handle is garbage from here on; wait without collecting.
              receive do
                :exit -> :ok
              end
          end
        end)

      {creator, made} =
        in_process(fn ->
          t = tensor(w, [3.0])
          send(holder, {:hold, t})
          name(t)
        end)

      send(creator, :exit)
      :erlang.garbage_collect(holder)
      eventually(fn -> not Process.alive?(creator) end)
      assert alive?(made), "another process holds it"
      send(holder, :drop)
      assert_receive {:dropping, [3.0]}
      # The holder never collects on its own; the idle nudge does it.
      eventually(fn -> not alive?(made) end)
      send(holder, :exit)
    end

    test "a tensor stored in ETS stays until the entry is deleted", %{worker: w} do
      table = :ets.new(:held, [:public])
      {pid, made} = in_process(fn -> name(tap(tensor(w, [4.0]), &:ets.insert(table, {:t, &1}))) end)
      send(pid, :exit)
      eventually(fn -> not Process.alive?(pid) end)
      assert alive?(made), "ETS holds it"
      [{:t, t}] = :ets.lookup(table, :t)
      assert Nx.to_flat_list(t) == [4.0]
      :ets.delete(table, :t)
      t = nil
      _ = t
      :erlang.garbage_collect()
      eventually(fn -> not alive?(made) end)
    end

    test "an idle process that dropped tensors is collected by the nudge", %{worker: w} do
      {pid, made} =
        in_process(fn ->
          # Dropped at once, but this process never collects on its own.
          name(Nx.multiply(tensor(w, [1.0, 2.0]), tensor(w, [3.0, 3.0])))
        end)

      eventually(fn -> not alive?(made) end)
      send(pid, :exit)
    end
  end

  describe "memory statistics and limits" do
    test "memory_info reports the worker's memory and emits telemetry", %{worker: w} do
      forward_events([[:moat, :memory, :stats]])

      before = Moat.memory_info(w)
      t = Moat.from_binary(:binary.copy(f32([1.0]), @mib), {@mib}, {:f, 32}, worker: w)
      info = Moat.memory_info(w)
      assert info.active - before.active == 4 * @mib
      assert info.tensors == before.tensors + 1
      assert info.peak >= info.active
      assert %{limit: limit, cache_limit: _, cache: _} = info
      assert limit > 0
      assert_received {:telemetry, [:moat, :memory, :stats], %{active: _, peak: _, cache: _, tensors: _}, %{worker: ^w}}

      assert Moat.deallocate(t) == :ok
      assert Moat.memory_info(w).cache >= 4 * @mib
      assert Moat.clear_cache(w) == :ok
      assert Moat.memory_info(w).cache == 0
      assert Moat.reset_peak_memory(w) == :ok
      assert Moat.memory_info(w).peak <= before.active
    end

    test "limits return the previous value", %{worker: w} do
      %{limit: limit, cache_limit: cache_limit} = Moat.memory_info(w)
      assert Moat.set_memory_limit(64 * @mib, w) == limit
      assert Moat.set_memory_limit(limit, w) == 64 * @mib
      assert Moat.set_cache_limit(0, w) == cache_limit
      assert Moat.memory_info(w).cache_limit == 0
    end

    @tag :capture_log
    test "a tensor larger than the limit raises and the worker serves the next call", %{worker: w} do
      Moat.set_memory_limit(16 * @mib, w)
      os_pid = os_pid(w)
      small = tensor(w, [1.0, 2.0])

      big = Nx.broadcast(small, {4096, 4096, 2})
      error = assert_raise Error, fn -> Nx.to_binary(big) end
      assert error.message =~ "memory limit exceeded: needs 128.0 MiB"

      upload = Moat.from_binary(:binary.copy(f32([1.0]), 8 * @mib), {8 * @mib}, {:f, 32}, worker: w)
      error = assert_raise Error, fn -> Moat.to_binary(upload) end
      assert error.op == :from_binary
      assert error.message =~ "memory limit exceeded: needs 32.0 MiB"

      assert Nx.to_flat_list(Nx.add(small, small)) == [2.0, 4.0]
      assert os_pid(w) == os_pid
    end
  end
end

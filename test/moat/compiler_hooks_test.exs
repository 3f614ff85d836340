defmodule Moat.CompilerHooksTest do
  # Hooks inside control flow run in the worker: each firing's values come
  # to the caller as `{:hook, seq, info}` frames while the program goes on,
  # and the hook functions run in the caller in the evaluator's order.
  use ExUnit.Case, async: false
  @moduletag :capture_log
  import Moat.Case

  defmodule Loops do
    import Nx.Defn

    defn counted(x) do
      while {x, i = 0}, i < 3 do
        {hook(x + 1, :iteration), i + 1}
      end
    end

    # A while in a while, a cond in the body, a hook before and after the
    # loops, and a token hook (`hook/3` on a container) in the inner loop.
    defn nested(x, n) do
      x = hook(x * 2, :before)

      {x, _, _} =
        while {x, i = 0, n}, i < n do
          {x, _} =
            while {x, j = 0}, j < 2 do
              {hook({x + j, j}, :inner) |> elem(0), j + 1}
            end

          x =
            if rem(i, 2) == 0 do
              hook(x - 1, :even)
            else
              hook(x * 3, :odd)
            end

          {x, i + 1, n}
        end

      hook(x, :after)
    end

    defn chosen(x) do
      cond do
        x > 10 -> hook(x * 10, :big)
        x > 0 -> hook(x + 100, :small)
        true -> hook(-x, :other)
      end
    end

    defn printed(x) do
      while {x, i = 0}, i < 2 do
        {print_value(x * 2, label: "step"), i + 1}
      end
    end

    defn vectorized_if(pred, a, b) do
      if pred do
        hook(a, :big)
      else
        hook({a, b}, :small) |> elem(1)
      end
    end

    defn many(x, n) do
      while {x, i = 0, n}, i < n do
        {hook(x + 1, :tick), i + 1, n}
      end
    end
  end

  @names [:before, :inner, :even, :odd, :after, :big, :small, :other, :iteration, :tick]

  defp jit(fun, opts \\ []), do: Nx.Defn.jit(fun, Keyword.put_new(opts, :compiler, Moat.Compiler))

  defp recording(parent), do: Map.new(@names, &{&1, fn v -> send(parent, {:fired, &1, values(v)}) end})

  defp values(%Nx.Tensor{} = t), do: {t.shape, t.type, t.vectorized_axes, t.names, Nx.to_binary(t)}
  defp values(tuple) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> Enum.map(&values/1)

  defp fired do
    receive do
      {:fired, name, value} -> [{name, value} | fired()]
    after
      0 -> []
    end
  end

  # The hooks' calls and values, and the result, under both compilers.
  defp both(fun, args) do
    hooks = recording(self())
    compiled = apply(jit(fun, hooks: hooks), args)
    compiled_calls = fired()
    evaluated = apply(Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator, hooks: hooks), args)
    evaluated_calls = fired()
    flat = &Nx.Defn.Composite.flatten_list([&1])
    assert Enum.map(flat.(compiled), &Nx.to_binary/1) == Enum.map(flat.(evaluated), &Nx.to_binary/1)
    {compiled_calls, evaluated_calls}
  end

  setup do
    Nx.default_backend(Moat.Backend)
    forward_events([[:moat, :compiler, :fallback]])
    :ok
  end

  test "a hook inside a while body runs in the worker, once per iteration, as on the evaluator" do
    {compiled, evaluated} = both(&Loops.counted/1, [Nx.tensor(0.0)])
    assert compiled == evaluated

    assert Enum.map(compiled, fn {:iteration, {{}, _, [], [], bin}} -> bin end) ==
             Enum.map([1.0, 2.0, 3.0], &<<&1::float-32-little>>)

    refute_received {:telemetry, [:moat, :compiler, :fallback], _, _}
  end

  test "hooks in nested whiles, a cond in a loop and around them: the evaluator's calls, in its order" do
    for n <- [0, 1, 4] do
      {compiled, evaluated} = both(&Loops.nested/2, [Nx.tensor([1.0, -2.0]), Nx.tensor(n)])
      assert compiled == evaluated
      assert length(compiled) == 2 + 3 * n
    end

    refute_received {:telemetry, [:moat, :compiler, :fallback], _, _}
  end

  test "a hook in a cond branch fires only when its branch is taken" do
    for x <- [20, 5, -3] do
      {compiled, evaluated} = both(&Loops.chosen/1, [Nx.tensor(x)])
      assert compiled == evaluated
      assert [_] = compiled
    end
  end

  test "print_value inside a while prints each iteration's value" do
    printed = ExUnit.CaptureIO.capture_io(fn -> jit(&Loops.printed/1).(Nx.tensor([1.0, 2.0])) end)
    expected = ExUnit.CaptureIO.capture_io(fn -> Nx.Defn.jit(&Loops.printed/1).(Nx.tensor([1.0, 2.0])) end)
    assert printed =~ "step"
    assert printed =~ "[2.0, 4.0]" and printed =~ "[4.0, 8.0]"

    # The values are Nx.BinaryBackend tensors (see Moat.Compiler, "Hooks"):
    # printed without the evaluator's `Moat.Backend(cpu)` (or `(gpu)`) line.
    same = &(&1 |> String.replace(~r/Moat\.Backend\((cpu|gpu)\)/, "") |> String.replace(~r/\s+/, " "))
    assert same.(printed) == same.(expected)
  end

  test "a hook function that raises: the call raises as on the evaluator, and the worker carries on" do
    pid = os_pid()
    hooks = %{iteration: fn v -> if Nx.to_number(v) == 2.0, do: raise(ArgumentError, "hook says no") end}

    assert_raise ArgumentError, "hook says no", fn -> jit(&Loops.counted/1, hooks: hooks).(Nx.tensor(0.0)) end
    assert_raise ArgumentError, "hook says no", fn -> Nx.Defn.jit(&Loops.counted/1, hooks: hooks).(Nx.tensor(0.0)) end

    # A raise halfway through a long loop stops it (the worker is not left
    # waiting for acknowledgements), and the next calls are served.
    hooks = %{tick: fn v -> if Nx.to_number(v) == 100.0, do: raise("stop") end}
    assert_raise RuntimeError, "stop", fn -> jit(&Loops.many/2, hooks: hooks).(Nx.tensor(0.0), Nx.tensor(100_000)) end
    assert Nx.to_number(Nx.add(Nx.tensor(1.0), 1)) == 2.0
    {x, _, _} = jit(&Loops.many/2, hooks: %{tick: fn _ -> :ok end}).(Nx.tensor(0.0), Nx.tensor(50))
    assert Nx.to_number(x) == 50.0
    assert os_pid() == pid
  end

  test "hook messages in flight are bounded: a slow hook in a long loop does not pile up values" do
    parent = self()
    counter = :counters.new(1, [])

    hooks = %{
      tick: fn _ ->
        :counters.add(counter, 1, 1)
        # Let the worker run ahead while this caller is slow.
        if :counters.get(counter, 1) < 5, do: Process.sleep(50)
        {:message_queue_len, len} = Process.info(self(), :message_queue_len)
        send(parent, {:queue, len})
      end
    }

    n = 3_000

    {x, _, _} =
      Task.async(fn -> jit(&Loops.many/2, hooks: hooks).(Nx.tensor(0.0), Nx.tensor(n)) end) |> Task.await(60_000)

    assert Nx.to_number(x) == n * 1.0
    assert :counters.get(counter, 1) == n
    lengths = for _ <- 1..n, do: receive(do: ({:queue, len} -> len))
    # 32 firings beyond the last acknowledgement, which the caller sends every 16.
    assert Enum.max(lengths) <= 48
    assert Enum.max(lengths) >= 8
  end

  test "the caller exiting mid-run cancels it; the worker serves the next calls" do
    parent = self()
    hooks = %{tick: fn v -> if Nx.to_number(v) == 3.0, do: send(parent, :running) && Process.sleep(:infinity) end}
    {pid, ref} = spawn_monitor(fn -> jit(&Loops.many/2, hooks: hooks).(Nx.tensor(0.0), Nx.tensor(1_000_000)) end)
    assert_receive :running, 10_000
    Process.exit(pid, :kill)
    assert_receive {:DOWN, ^ref, :process, _, :killed}
    assert Nx.to_number(Nx.multiply(Nx.tensor(3.0), 3)) == 9.0
  end

  test "the worker dying mid-run answers the run's caller and every other caller" do
    start_worker(:hooks_worker)
    parent = self()
    pid = os_pid(:hooks_worker)
    opts = [compiler: Moat.Compiler, worker: :hooks_worker]

    hooks = %{
      tick: fn v ->
        if Nx.to_number(v) == 5.0 do
          # Another caller waits on the same worker, which is busy with the run.
          spawn(fn ->
            send(parent, :other_waits)
            # A float: exact integer ops on BEAM-made values would be answered
            # without the worker.
            t = Nx.tensor([1.0], backend: {Moat.Backend, worker: :hooks_worker})

            send(parent, {:other, try(do: Nx.to_binary(Nx.add(t, 1)), rescue: (e in Moat.Error -> e))})
          end)

          assert_receive :other_waits
          Process.sleep(100)
          kill(pid)
        end
      end
    }

    x = Nx.backend_transfer(Nx.tensor(0.0), {Moat.Backend, worker: :hooks_worker})
    {result, _, _} = Nx.Defn.jit(&Loops.many/2, [hooks: hooks] ++ opts).(x, Nx.tensor(1_000_000))
    assert %Moat.Error{} = assert_raise(Moat.Error, fn -> Nx.to_number(result) end)
    assert_receive {:other, %Moat.Error{reason: reason}}, 10_000
    assert reason in [:worker_died, :worker_unavailable, :stale_generation]
  end

  test "what still cannot run in a program falls back with telemetry" do
    fun = fn x -> Nx.reduce(x, 0, fn a, b -> Nx.add(a, b) end) end
    assert Nx.to_number(jit(fun).(Nx.tensor([1, 2, 3]))) == 6
    assert_receive {:telemetry, [:moat, :compiler, :fallback], _, %{op: :reduce}}
  end

  test "an output that is another output's value is the same tensor, as the evaluator returns it" do
    fun = fn t -> {Nx.cos(t), Nx.cos(t)} |> then(fn {a, _} -> {a, a, Nx.sin(t)} end) end
    assert {x, x, y} = jit(fun).(Nx.tensor(1.0))
    assert {e, e, _} = Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator).(Nx.tensor(1.0))
    assert Nx.to_binary(x) == Nx.to_binary(e)
    assert Nx.to_number(y) == Nx.to_number(Nx.sin(Nx.tensor(1.0)))
  end

  test "hooks of vectorized values inside a vectorized cond: devectorized, as on the evaluator" do
    pred = Nx.vectorize(Nx.tensor([0, 1, 0]), :pred)
    b = Nx.vectorize(Nx.tensor([[9, 10], [11, 12], [13, 14]]), :pred)
    {compiled, evaluated} = both(&Loops.vectorized_if/3, [pred, Nx.tensor(1), b])
    assert compiled == evaluated
    assert [_ | _] = compiled
    assert Enum.any?(compiled, fn {_, value} -> match?([_, {{3, 2}, _, [], [:pred, nil], _}], value) end)
  end
end

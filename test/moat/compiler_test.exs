defmodule Moat.CompilerTest do
  # Moat.Compiler against Nx.Defn.Evaluator, both on Moat.Backend: every
  # function of the corpus (and its gradient) gives the same bits, in the
  # same containers.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.CompilerCorpus, as: C
  alias Nx.Defn.Composite

  setup do
    Nx.default_backend(Moat.Backend)
    :ok
  end

  defp t(data, opts \\ []), do: Nx.tensor(data, opts)

  defp random(shape, seed) do
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape)
    t
  end

  defp jit(fun, opts \\ []), do: Nx.Defn.jit(fun, Keyword.put_new(opts, :compiler, Moat.Compiler))
  defp evaluate(fun), do: Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator)

  defp assert_same(compiled, evaluated) do
    flat = fn c -> Composite.flatten_list([c]) end
    assert length(flat.(compiled)) == length(flat.(evaluated))

    for {c, e} <- Enum.zip(flat.(compiled), flat.(evaluated)) do
      assert {c.shape, c.type, c.names, c.vectorized_axes} == {e.shape, e.type, e.names, e.vectorized_axes}
      assert Nx.to_binary(Nx.devectorize(c)) == Nx.to_binary(Nx.devectorize(e))
    end

    # The containers have the same structure.
    assert Composite.traverse(compiled, fn _ -> 0 end) == Composite.traverse(evaluated, fn _ -> 0 end)
  end

  defp assert_equivalent(fun, args) do
    assert_same(apply(jit(fun), args), apply(evaluate(fun), args))
  end

  # The gradient of the sum of every float output, by the first argument.
  defp grad_of(fun) do
    arity = Function.info(fun, :arity) |> elem(1)

    case arity do
      1 -> fn a -> Nx.Defn.grad(a, &total(fun.(&1))) end
      2 -> fn a, b -> Nx.Defn.grad(a, &total(fun.(&1, b))) end
      5 -> fn a, b, c, d, e -> Nx.Defn.grad(a, &total(fun.(&1, b, c, d, e))) end
    end
  end

  defp total(container) do
    container
    |> then(&Composite.flatten_list([&1]))
    |> Enum.filter(&Nx.Type.float?(&1.type))
    |> Enum.map(&Nx.sum/1)
    |> Enum.reduce(&Nx.add/2)
  end

  @corpus [
    {"element-wise chain", &C.elementwise/2, [[{3, 4}, {3, 4}]], true},
    {"reductions", &C.reductions/1, [[{4, 5}]], true},
    {"dot", &C.dot/2, [[{3, 4}, {5, 4}]], true},
    {"conv and window", &C.conv/2, [[{1, 2, 6, 6}, {3, 2, 3, 3}]], true},
    {"slicing, put_slice, pad, concatenate", &C.slicing/1, [[{3, 4}]], true},
    {"sorting and top_k", &C.sorting/1, [[{3, 5}]], true},
    {"while over a tuple, 1000 iterations", &C.while_tuple/1, [[{4}]], true},
    {"cond", &C.conds/1, [[{4}]], true},
    {"a value shared by cond and its parent", &C.cond_shared/1, [[{4}]], true},
    {"the MLP", &C.mlp/5, [[{8, 16}, {16, 12}, {12}, {12, 4}, {4}]], true},
    {"QR, Cholesky, determinant (native blocks)", &C.linalg/1, [[{3, 3}]], false},
    {"100 tiny element-wise ops", &C.tiny_chain/1, [[{4}]], true}
  ]

  for {name, fun, [shapes], grad?} <- @corpus do
    @fun fun
    @shapes shapes

    test "#{name}: compiled equals evaluated" do
      args = @shapes |> Enum.with_index() |> Enum.map(fn {s, i} -> random(s, i) end)
      assert_equivalent(@fun, args)
    end

    if grad? do
      test "#{name}: its gradient, compiled, equals evaluated" do
        args = @shapes |> Enum.with_index() |> Enum.map(fn {s, i} -> random(s, i + 10) end)
        assert_equivalent(grad_of(@fun), args)
      end
    end
  end

  test "an unfused while runs its counter ahead and stops on the evaluator's state" do
    # Chunks of 4, 8, 16, … iterations: counts around their edges.
    for n <- [0, 1, 3, 4, 5, 11, 12, 13, 27, 28, 29, 60, 61, 300, 1020, 1021] do
      assert_equivalent(&C.count_to/2, [t([1.0, -2.0]), t(n)])
    end

    for limit <- [0.5, 2.5, 5.0] do
      assert_equivalent(&C.take_until/2, [t([1.0, 2.0, 3.0, 9.0]), t(limit)])
    end

    error =
      assert_raise Moat.Error, fn -> jit(&C.take_until/2).(t([1.0, 2.0, 3.0]), t(10.0)) |> elem(1) |> Nx.to_binary() end

    assert error.op == :take

    for x <- [t([4.0, 8.0]), random({300}, 1) |> Nx.abs()], tol <- [0.1, 100.0] do
      assert_equivalent(&C.halve_until/2, [x, t(tol)])
    end
  end

  @tag :f64
  test "small loops (run on the worker's host path) give the evaluator's bits" do
    nan = Nx.tensor([:nan, :infinity, :neg_infinity, -0.0, 0.0, 1.5, -2.5])
    f64 = t([1.0, -2.0e300, 3.5], type: :f64)
    s64 = t([9_000_000_000_000_000_000, -5, 7], type: :s64)

    for n <- [0, 1, 7, 50, 1000] do
      assert_equivalent(&C.small_mixed/3, [f64, s64, t(n)])
      assert_equivalent(&C.small_select/2, [nan, t(n)])
    end

    assert_equivalent(&C.counter/1, [random({4}, 1)])
    assert_equivalent(&C.small_bits/1, [t([0, 1, 200, 255], type: :u8)])
    # NaNs of different bits: one MLX makes (inf - inf, sign set), one from Nx.
    made = Nx.subtract(t([:infinity, 1.0]), t([:infinity, 1.0]))
    assert_equivalent(&C.small_nans/3, [made, t([:nan, 2.0]), t(3)])
    assert_equivalent(&C.small_nans/3, [made, made, t(3)])

    for tol <- [2.0, 0.3, 1.0e-30] do
      assert_equivalent(&C.small_tolerance/2, [random({2, 3}, 2), t(tol)])
    end

    # Past the host's bound (64 elements), the same loops run on MLX.
    assert_equivalent(&C.small_select/2, [random({65}, 3), t(20)])
    assert_equivalent(&C.small_tolerance/2, [random({8, 9}, 4), t(1.0e-3)])
  end

  test "cond takes each branch" do
    for x <- [t([60.0, 50.0]), t([1.0, 2.0]), t([-1.0, -2.0])] do
      assert_equivalent(&C.conds/1, [x])
      assert_equivalent(&C.cond_shared/1, [x])
    end
  end

  test "dynamic slices, gathers and indexed ops" do
    a = random({4, 3}, 1)

    for i <- [0, 2, 7] do
      assert_equivalent(&C.dynamic_slice/2, [a, t(i)])
    end

    assert_equivalent(&C.gathers/2, [a, t([2, 0])])
    assert_equivalent(grad_of(&C.gathers/2), [a, t([2, 0])])
  end

  test "integer division and bit ops" do
    assert_equivalent(&C.integers/2, [t([7, -7, 9, 100]), t([2, 3, -4, 7])])
  end

  test "maps and tuples as inputs and outputs" do
    input = %{a: random({2, 3}, 1), b: {random({2, 3}, 2), random({3}, 3)}}
    assert_equivalent(&C.containers/1, [input])
    result = jit(&C.containers/1).(input)
    assert %{sum: %Nx.Tensor{}, pair: {%Nx.Tensor{}, %Nx.Tensor{shape: {}}}} = result
    # The gradient by a whole container is a container of the same shape.
    grad = fn input -> Nx.Defn.grad(input, &total(C.containers(&1))) end
    assert_equivalent(grad, [input])
    assert %{a: %Nx.Tensor{shape: {2, 3}}, b: {_, %Nx.Tensor{shape: {3}}}} = jit(grad).(input)
  end

  test "vectorized inputs" do
    x = Nx.iota({3, 4}, type: :f32) |> Nx.vectorize(:rows)
    y = Nx.iota({4}, type: :f32)
    fun = fn x, y -> {Nx.sum(Nx.multiply(x, y)), Nx.add(Nx.exp(x), y)} end
    assert_equivalent(fun, [x, y])
    {sum, _} = jit(fun).(x, y)
    assert sum.vectorized_axes == [rows: 3]
    # Gradients of vectorized inputs, and by a plain input of a vectorized graph.
    assert_equivalent(fn x, y -> Nx.Defn.grad(x, &total(fun.(&1, y))) end, [x, y])
    assert_equivalent(fn x, y -> Nx.Defn.grad(y, &total(fun.(x, &1))) end, [x, y])
  end

  test "inputs on other backends, literals and captured tensors" do
    # Nx inlines a closure's tensors copied to Nx.BinaryBackend.
    captured = Nx.backend_copy(t([10.0, 20.0]))
    binary = Nx.tensor([1.0, 2.0], backend: Nx.BinaryBackend)
    fun = fn x -> Nx.add(x, captured) |> Nx.multiply(Nx.tensor([3.0, 4.0])) end
    assert Nx.to_flat_list(jit(fun).(binary)) == [33.0, 88.0]
    assert_equivalent(fun, [binary])
  end

  test "compile/3: a held closure replays, each call one frame" do
    template = Nx.template({4}, :f32)
    fun = Nx.Defn.compile(&C.elementwise/2, [template, template], compiler: Moat.Compiler)
    a = random({4}, 1)
    b = random({4}, 2)
    assert_same(fun.(a, b), evaluate(&C.elementwise/2).(a, b))

    conn = Moat.Client.conn(Moat.Worker)
    # Sent frames (see Moat.Client's counters): a replay is one frame.
    sent = fn -> :atomics.get(conn.counters, 2) end
    before = sent.()
    result = fun.(a, b)
    assert sent.() - before == 1
    assert_same(result, evaluate(&C.elementwise/2).(a, b))
  end

  test "structurally equal functions share one program; telemetry says so" do
    forward_events([[:moat, :compile, :stop]])
    x = random({7, 3}, 1)
    jit(fn a -> Nx.exp(a) |> Nx.sum(axes: [0]) end).(x)
    assert_receive {:telemetry, _, _, %{cache: :miss, program_size: 2}}
    programs = Moat.compiler_info().programs
    jit(fn b -> Nx.sum(Nx.exp(b), axes: [0]) end).(x)
    assert_receive {:telemetry, _, _, %{cache: :hit, program_size: 2}}
    assert Moat.compiler_info().programs == programs
  end

  test "reduce with a user function falls back to the evaluator, or raises" do
    forward_events([[:moat, :compiler, :fallback]])
    fun = fn x -> Nx.reduce(x, 0, fn a, b -> Nx.add(a, b) end) |> Nx.multiply(2) end
    x = t([1, 2, 3])
    assert Nx.to_number(jit(fun).(x)) == 12
    assert_receive {:telemetry, [:moat, :compiler, :fallback], _, %{op: :reduce}}
    assert_equivalent(fun, [x])

    assert_raise ArgumentError, ~r/reduce cannot run in a program/, fn ->
      jit(fun, on_unsupported: :raise).(x)
    end
  end

  @tag :f64
  test "c128 math that Moat.Backend runs on Nx.BinaryBackend falls back to the evaluator" do
    z = Nx.complex(t([0.5, 1.0], type: :f64), t([0.25, -1.0], type: :f64))
    assert Nx.type(z) == {:c, 128}
    assert_same(jit(&Nx.cos/1).(z), evaluate(&Nx.cos/1).(z))
    grad = fn x -> Nx.Defn.grad(x, &Nx.sum(Nx.cos(&1))) end
    assert_same(jit(grad).(z), evaluate(grad).(z))
    # c128 math Moat.Types runs as f64 pairs (which reads its inputs' worker) too.
    for fun <- [&Nx.sigmoid/1, &Nx.log1p/1, &Nx.acos/1] do
      grad = fn x -> Nx.Defn.grad(x, &Nx.sum(fun.(&1))) end
      assert_same(jit(grad).(z), evaluate(grad).(z))
    end
  end

  test "a replay copies no expression out of the cache (a graph copied out of ETS loses its sharing)" do
    # Nx's grad_test.exs, triangular_solve with transform_a: :conjugate: the
    # gradient's graph (c64 after the conjugate, so a fallback) shares its
    # nodes; copied out of ETS it took seconds per call, more with each test.
    grad = fn a, b -> Nx.Defn.grad(b, &Nx.sum(Nx.LinAlg.triangular_solve(a, &1, transform_a: :conjugate))) end
    a = t([[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    b = t([2, 3, 4])
    mlp_args = Enum.map([{8, 16}, {16, 12}, {12}, {12, 4}, {4}], &random(&1, 1))
    :ets.match_delete(Moat.Compiler.Cache, {{:lowered, :_}, :_, :_})

    assert_same(jit(grad).(a, b), evaluate(grad).(a, b))
    assert_same(apply(jit(&C.mlp/5), mlp_args), apply(evaluate(&C.mlp/5), mlp_args))
    entries = :ets.match_object(Moat.Compiler.Cache, {{:lowered, :_}, :_, :_})
    assert length(entries) == 2
    for {_key, compiled, _tick} <- entries, do: assert(:erts_debug.flat_size(compiled) < 2_000)
  end

  test "a closure too large to hash as a cache key is lowered per call" do
    # ETS hashes a key whole without yielding (and blind to sharing: an
    # expression a closure holds can make that exponential); such a function
    # is not cached.
    big = Enum.to_list(1..200_000)
    fun = jit(fn x -> Nx.add(x, length(big)) end)
    lowerings = Moat.compiler_info().lowerings
    assert Nx.to_number(fun.(t(1))) == 200_001
    assert Nx.to_number(fun.(t(2))) == 200_002
    assert Moat.compiler_info().lowerings == lowerings + 2
    refute Moat.Compiler.Cache.hashable?({fun, :key})
    assert Moat.Compiler.Cache.hashable?({&C.mlp/5, :key})
  end

  test "a lazy container's argument the graph does not use is never read" do
    fun = jit(fn %C.Wrapped{a: a} -> Nx.add(a, 1) end)
    assert Nx.to_number(fun.(%C.Lazy{a: t(1.0), b: t(2.0)})) == 2.0
  end

  test "arguments of the same tensors in other containers lower apart" do
    id = jit(& &1)
    assert %Nx.Tensor{} = id.(t(1))
    assert {%Nx.Tensor{}} = id.({t(1)})
    keys = jit(fn map -> Map.new(map, fn {k, v} -> {k, Nx.add(v, 1)} end) end)
    assert %{iteration: a, abc: _} = keys.(%{iteration: t(0), abc: t(1)})
    assert %{iteration: b, xyz: _} = keys.(%{iteration: t(0), xyz: t(1)})
    assert Nx.to_number(a) == 1 and Nx.to_number(b) == 1
  end

  test "hooks run inside the program: their values come back as its extra outputs, in order" do
    forward_events([[:moat, :compiler, :fallback]])
    parent = self()

    fun = fn x ->
      y = x |> Nx.multiply(2) |> Nx.Defn.Kernel.hook(:doubled, &send(parent, {:hook, :doubled, &1}))
      {a, b} = Nx.Defn.Kernel.hook({Nx.add(y, 1), Nx.sum(y)}, :pair, &send(parent, {:hook, :pair, &1}))
      Nx.Defn.Kernel.print_value(Nx.multiply(a, b), label: "printed")
    end

    x = t([1.0, 2.0])
    replays = Moat.compiler_info().replays
    conn = Moat.Client.conn(Moat.Worker)
    sent = :atomics.get(conn.counters, 2)
    printed = ExUnit.CaptureIO.capture_io(fn -> send(parent, {:result, jit(fun).(x)}) end)
    assert_received {:result, result}
    assert printed =~ ~r/printed: #Nx.Tensor<\n  f32\[2\]\n.*\n  \[18.0, 30.0\]/
    assert Moat.compiler_info().replays == replays + 1
    # The program's definition, its run and print_value's readback: no frame per hook.
    assert :atomics.get(conn.counters, 2) - sent <= 3
    refute_received {:telemetry, [:moat, :compiler, :fallback], _, _}
    assert Nx.to_flat_list(result) == [18.0, 30.0]
    assert_received {:hook, :doubled, doubled}
    assert_received {:hook, :pair, {plus, sum}}
    assert Nx.to_flat_list(doubled) == [2.0, 4.0]
    assert {Nx.to_flat_list(plus), Nx.to_number(sum)} == {[3.0, 5.0], 6.0}
    # The evaluator runs the same hooks in the same order.
    flush = fn flush ->
      receive do
        {:hook, name, _} -> [name | flush.(flush)]
      after
        0 -> []
      end
    end

    ExUnit.CaptureIO.capture_io(fn -> evaluate(fun).(x) end)
    evaluated = flush.(flush)
    ExUnit.CaptureIO.capture_io(fn -> jit(fun).(x) end)
    assert flush.(flush) == evaluated

    # The :hooks option overrides a named hook; a hook without a function is skipped.
    ExUnit.CaptureIO.capture_io(fn -> jit(fun, hooks: %{doubled: &send(parent, {:override, &1})}).(x) end)
    assert_received {:override, _}
    refute_received {:hook, :doubled, _}
    assert Nx.to_flat_list(jit(&Nx.Defn.Kernel.hook(Nx.exp(&1), :unset)).(t([0.0]))) == [1.0]
  end

  defmodule Hooked do
    import Nx.Defn

    defn loop(x) do
      while {x, i = 0}, i < 3 do
        {hook(x + 1, :iteration), i + 1}
      end
    end
  end

  test "a hook inside a while body runs in the worker (no fallback), once per iteration" do
    forward_events([[:moat, :compiler, :fallback]])
    parent = self()
    hooks = %{iteration: &send(parent, {:iteration, Nx.to_number(&1)})}
    assert {x, _} = jit(&Hooked.loop/1, hooks: hooks).(t(0.0))
    assert Nx.to_number(x) == 3.0
    refute_received {:telemetry, [:moat, :compiler, :fallback], _, _}
    for i <- [1.0, 2.0, 3.0], do: assert_received({:iteration, ^i})
    # A loop small enough for the host path still fires each iteration's hook, in order.
    assert {x, _} = jit(&Hooked.loop/1, hooks: hooks).(t(10.0))
    assert Nx.to_number(x) == 13.0
    firings = for _ <- 1..4, do: receive(do: ({:iteration, i} -> i), after: (0 -> nil))
    assert firings == [11.0, 12.0, 13.0, nil]
  end

  test "Nx.Serving runs jitted functions" do
    serving = Nx.Serving.jit(&C.elementwise(&1, &1), compiler: Moat.Compiler)
    batch = Nx.Batch.stack([t([1.0, 2.0]), t([3.0, 4.0])])
    result = Nx.Serving.run(serving, batch)
    expected = evaluate(&C.elementwise(&1, &1)).(Nx.stack([t([1.0, 2.0]), t([3.0, 4.0])]))
    assert Nx.to_binary(result) == Nx.to_binary(expected)
  end

  describe "fuse: true" do
    # MLX compiles fused CPU kernels with g++ at run time (seconds for a new
    # kernel, then cached in the worker's kernel cache).
    @describetag timeout: 300_000

    test "fused element-wise chains and the MLP agree with the evaluator" do
      x = random({4}, 1)
      fused = jit(&C.tiny_chain/1, fuse: true).(x)
      assert Nx.to_number(Nx.all_close(fused, evaluate(&C.tiny_chain/1).(x), rtol: 1.0e-6)) == 1

      args = [random({8, 16}, 1), random({16, 12}, 2), random({12}, 3), random({12, 4}, 4), random({4}, 5)]
      fused = apply(jit(&C.mlp/5, fuse: true), args)
      assert Nx.to_number(Nx.all_close(fused, apply(evaluate(&C.mlp/5), args), rtol: 1.0e-5)) == 1
    end

    test "ops that evaluate run unfused; a while loop fuses its iteration" do
      a = random({4, 3}, 1)
      assert_same(jit(&C.gathers/2, fuse: true).(a, t([2, 0])), evaluate(&C.gathers/2).(a, t([2, 0])))
      fused = jit(&C.while_tuple/1, fuse: true).(t([1.0, 2.0]))
      unfused = evaluate(&C.while_tuple/1).(t([1.0, 2.0]))

      if gpu?() do
        # MLX's CUDA kernels contract `acc * 0.999 + 0.001` into one fma,
        # rounded once where the unfused ops round twice: over 1000
        # iterations the f32 results part in the last few hundred ulp.
        for {f, u} <- Enum.zip(Tuple.to_list(fused), Tuple.to_list(unfused)),
            do: assert(Nx.to_number(Nx.all_close(f, u, rtol: 1.0e-4)) == 1)
      else
        assert_same(fused, unfused)
      end

      for n <- [0, 1, 2, 15, 16, 17, 40] do
        assert_same(
          jit(&C.count_to/2, fuse: true).(t([1.0, -2.0]), t(n)),
          evaluate(&C.count_to/2).(t([1.0, -2.0]), t(n))
        )
      end

      error = assert_raise Moat.Error, fn -> jit(&Nx.take(&1, &2), fuse: true).(a, t([9])) |> Nx.to_binary() end
      assert error.op == :take
    end
  end

  test "a program lowered for the GPU refuses f64 as the eager ops do, before anything is sent" do
    # Checked while lowering, so it holds on any worker (test/moat/gpu_test.exs runs it on a GPU).
    for fun <- [&Nx.as_type(&1, :f64), &Nx.add(&1, Nx.iota({2}, type: :f64))] do
      assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> jit(fun, device: :gpu).(t([1.0, 2.0])) end
    end

    if not gpu?(), do: assert(Nx.to_flat_list(jit(&Nx.as_type(&1, :f64)).(t([1.0, 2.0]))) == [1.0, 2.0])
  end

  test "Moat.Compiler's backend and partitions" do
    # device nil: the worker's own.
    assert Moat.Compiler.__to_backend__(worker: :w) == {Moat.Backend, worker: :w, device: nil}
    assert length(Moat.Compiler.__partitions_options__(max_concurrency: 3)) == 3
  end
end

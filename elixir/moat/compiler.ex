defmodule Moat.Compiler do
  @moduledoc """
  A `Nx.Defn.Compiler` that runs a whole `defn` graph in the worker as one
  cached program.

      Nx.Defn.global_default_options(compiler: Moat.Compiler)

      fun = Nx.Defn.jit(&MyModel.predict/2, compiler: Moat.Compiler)
      fun = Nx.Defn.compile(&MyModel.predict/2, templates, compiler: Moat.Compiler)

  The graph is lowered once (per function, argument shapes and types, and
  options) into a program: a list of ops over numbered slots, with
  parameters and outputs. The worker keeps the program; a call sends one
  frame (the program's id, the input ids and the output ids, which the
  client picks, as for every op), so it is fire-and-forget like an eager
  op, and only reading a result waits. Programs are cached by structure
  (ops, attributes, shapes and types), not by function: two functions, or
  two layers, of the same structure share one program.

  ## What is lowered

  Every node becomes the op that `Moat.Backend` sends for it in eager mode,
  with the same attributes (the lowering calls the backend's callbacks,
  which record instead of sending), so a program computes exactly what
  `Nx.Defn.Evaluator` computes on `Moat.Backend`, and every check of the
  eager path (indices, integer divisors, element counts, the memory limit)
  holds inside programs. A failing op poisons the call's outputs, and
  reading one raises a `Moat.Error` naming that op, as in eager mode.

    * every `Nx.Backend` callback Moat runs natively, and `Nx.block/4`s
      (natively where Moat has an op for the block, else its default
      implementation, lowered in the program too);
    * `while`: the loop runs in the worker, which evaluates the condition
      (and each iteration's state) itself, with no round trip per iteration;
      a loop whose steps are all element-wise arithmetic, comparisons,
      logical ops, `select`, conversions and reshapes/broadcasts over
      arrays of at most 64 elements (integers, f32, f64) runs on plain
      buffers in the worker, with no MLX op per step (a counter's 1000
      iterations take about 1 ms instead of 30), computing exactly what the
      MLX ops compute; anything else, or a loop with hooks, runs on MLX;
    * `cond`: the worker evaluates the predicates and runs the chosen branch;
    * hooks (`hook/3`, `print_value/2`, tokens) outside control flow: the
      hooked values are extra outputs of the program, and after the call's
      frame is sent the hook functions run in the caller, in the
      evaluator's order, on handles of those outputs; the program never
      stops for them (reading a value waits for it, as any readback);
    * hooks inside a `while` body, a `cond` branch or a block's default
      implementation (see "Hooks");
    * tensors the graph captures (literals, tensors of a closure) become
      extra inputs of the program, copied into the worker at each call when
      they live elsewhere;
    * containers (tuples, maps) as inputs and outputs, vectorized
      tensors, and `Nx.Defn.grad/2` and `value_and_grad/3` (which Nx
      expands before the compiler sees the graph).

  ## What falls back

  A graph that holds a node a program cannot run — a user function
  (`Nx.reduce/4`, `Nx.window_reduce/5`), an op that Moat.Backend runs on
  Nx.BinaryBackend (convolutions of more than 3 spatial axes, complex
  `triangular_solve`), or `runtime_call` — runs as a whole through `Nx.Defn.Evaluator` on
  `Moat.Backend`, after emitting `[:moat, :compiler, :fallback]` telemetry
  (metadata `:op`), or raises with `on_unsupported: :raise`. Its results
  are the evaluator's: nothing changes silently.

  ## Options

    * `:worker` - the `Moat.Worker` to run on (default `Moat.Worker`);
      inputs on other workers or backends are copied there
    * `:device` - `:cpu` or `:gpu`; by default the device the worker runs
      its ops on
    * `:on_unsupported` - `:evaluate` (default) or `:raise`, see above
    * `:fuse` - `true` runs programs (or `while` iterations) made only of
      element-wise, shape, reduction and dot ops through
      `mlx::core::compile`, which fuses element-wise chains into single
      kernels (default `false`; see "Fusion")
    * `:donate` - `true` (default) lets a program write the caches its
      arguments hold in place: an argument that a `Moat.KVCache.update/3`
      (or `Moat.KVCache.write/4`) inside the function writes is spent by
      the call, as it is eagerly, and the program writes its buffer
      instead of copying the whole cache per call; `false` keeps the
      arguments readable (each call then copies such a cache once).
      Captured tensors are never spent
    * `:max_concurrency` - partitions for `Nx.Serving` (default 1)
    * `:hooks` - a map of functions overriding named hooks, as for
      `Nx.Defn.Evaluator`

  ## Fusion

  With `fuse: true`, MLX compiles each fused chain into a CPU kernel by
  running `g++` (several seconds per new kernel on a small machine; then
  kept in the worker's kernel cache, `Moat.Worker`'s `:kernel_cache`, for
  later runs and processes). Without `g++` programs run unfused, with a
  warning in the worker's log. A straight-line program is compiled whole; in
  one with control flow, each `while` loop whose condition and body are
  straight-line compiles 16 iterations as one call (after the first, each
  iteration's state is kept only while the condition still holds, so the
  loop ends on the same state). Ops that evaluate while they are built
  (indexing, integer division: their checks read values) keep their part
  unfused, as do `cond` branches. A small loop that can run on host
  buffers (see `while` above) runs there, fused or not: faster than its
  fused iterations. Fused results may differ from the
  evaluator's in the last bits of float math; unfused ones are equal bit
  for bit.

  Off by default, by measurement (`bench/fuse_default.exs`, two runs on this
  2-core VM under load): the first fused call of a new structure costs
  3.1–7.0 s while MLX runs `g++` on an empty kernel cache, and 30–123 ms
  with the kernels cached (unfused: 4–77 ms, a new worker included), where
  a fused call then saves 0.2–2 ms (MLP 1.4–1.9× under load, 1.08× in
  `bin/bench`'s quiet run; a 102-op element-wise chain 4.5–14×; the
  1000-iteration while loop 3.7× and 0.57× in the two runs, 5.8× quiet,
  before such small loops ran on host buffers, fused or not). The first
  call on an empty cache is repaid after
  1,700–19,000 calls, on a filled one after 20–140: worth it for a
  long-lived serving or a training loop, not for the many one-off shapes of
  tests, notebooks and exploratory work, whose every new structure would
  stall for seconds. Set it per function (`Nx.Defn.jit(fun, compiler:
  Moat.Compiler, fuse: true)`) or for all (`Nx.Defn.global_default_options(
  compiler: Moat.Compiler, fuse: true)`). The kernel cache is `moat-kernels`
  in the user's cache folder by default, or `config :moat, kernel_cache:`,
  and stays valid across runs and workers.

  ## Hooks

  In a graph with a hook inside control flow, every hook of the graph is a
  step of the program: the worker sends its values to the caller as it
  reaches it (per iteration, per taken branch) and goes on, and the call
  waits for the program's end, running each hook's function as its values
  arrive, in the order `Nx.Defn.Evaluator` runs them (protocol.md §6,
  "Hooks"). The functions get `Nx.BinaryBackend` tensors, copies of the
  values, so they may read them at once. At most 32 firings (and, past
  64 MiB of values, one) travel beyond what the caller has taken, so a
  hook in a long loop holds a bounded amount of memory however slow its
  function; the worker waits for the caller meanwhile. A function that
  raises stops the program and the call raises it; a caller that exits
  stops it too. A hook function that itself waits on the same worker
  (reading a Moat tensor) waits for the program to end, and the program
  waits for it once 32 firings are pending: do such work after the call.

  ## Caches and restarts

  `config :moat, max_programs: 256` bounds the programs each worker holds
  and the lowered functions `Nx.Defn.jit/2` keeps; the least recently used
  go first (a program evicted from the worker is defined again on its next
  call). After a worker restart, the next call of a jitted or compiled
  function defines its program in the new worker, transparently: a closure
  from `Nx.Defn.compile/3` stays usable. `Moat.compiler_info/1` counts
  programs, lowerings, replays and fallbacks.

  ## Telemetry

    * `[:moat, :compile, :start | :stop]` around each lowering, with
      `:cache` (`:hit` when the worker already held a program of that
      structure, else `:miss`), `:program_size` (steps, nested ones
      included) and `:fallback` (the unsupported op, or nil) on `:stop`
    * `[:moat, :compiler, :fallback]` when a graph falls back (see above)
  """

  @behaviour Nx.Defn.Compiler

  alias Moat.Compiler.{Cache, Lower}
  alias Moat.{Client, Handles, Ref}
  alias Nx.Defn.Composite
  alias Nx.Tensor, as: T

  @impl true
  def __partitions_options__(opts), do: List.duplicate(opts, Keyword.get(opts, :max_concurrency, 1))

  @impl true
  def __to_backend__(opts) do
    opts = options(opts)
    {Moat.Backend, worker: opts[:worker], device: opts[:device]}
  end

  @impl true
  def __jit__(key, vars, fun, args_list, opts) do
    opts = options(opts)
    plain = {key, templates(vars), %{}, opts}

    case lowered(plain, fn -> build(vars, fun, opts) end) do
      %{kind: :evaluator} = c ->
        # Built again per call, as Nx.Defn.Evaluator does: the cache keeps
        # no expression (an ETS copy of a graph loses its sharing, so a
        # gradient's graph grows exponentially there).
        evaluate(c, Nx.Defn.Evaluator.__compile__(key, vars, fun, c.opts), args_list)

      compiled ->
        # Quantized arguments are lowered as such (Moat.Quantized); only
        # the arguments the graph uses are read (a lazy container's other
        # fields must not be).
        {lowered_key, compiled} =
          case quantized(compiled.used, hd(args_list)) do
            none when none == %{} ->
              {plain, compiled}

            quant ->
              key = put_elem(plain, 2, quant)
              {key, lowered(key, fn -> build(vars, fun, Keyword.put(opts, :quant, quant)) end)}
          end

        Enum.map(args_list, &run(compiled, &1, source(compiled, lowered_key)))
    end
  end

  @impl true
  def __compile__(key, vars, fun, opts) do
    opts = options(opts)

    case build(vars, fun, opts) do
      {%{kind: :evaluator} = c, nil} ->
        evaluator = Nx.Defn.Evaluator.__compile__(key, vars, fun, c.opts)
        &evaluate(c, evaluator, &1)

      {compiled, program} ->
        source = fn -> program end
        fn args_list -> Enum.map(args_list, &run(compiled, &1, source)) end
    end
  end

  # The lowered function under `key` in the cache, or, when `key` is too
  # large to hash (a closure holding a big or shared term: ETS hashes it
  # whole, without yielding, and a graph's sharing makes that exponential),
  # built per call, as Nx.Defn.Evaluator does.
  defp lowered(key, build) do
    if Cache.hashable?(key) do
      Cache.lowered(key, build)
    else
      {compiled, program} = build.()
      Map.put(compiled, :program, program)
    end
  end

  defp source(%{program: program}, _key), do: fn -> program end
  defp source(_compiled, key), do: fn -> Cache.source(key) end

  defp options(opts) do
    opts = Keyword.take(opts, [:worker, :device, :on_unsupported, :max_concurrency, :hooks, :fuse, :donate])

    opts =
      Keyword.merge([worker: Moat.Worker, device: nil, on_unsupported: :evaluate, fuse: false, donate: true], opts)

    unless opts[:on_unsupported] in [:evaluate, :raise] do
      raise ArgumentError,
            "Moat.Compiler: :on_unsupported must be :evaluate or :raise, got #{inspect(opts[:on_unsupported])}"
    end

    opts
  end

  defp quantized(used, args) do
    args = List.to_tuple(args)
    for pos <- used, q = Moat.Quantized.info(elem(args, pos).()), into: %{}, do: {pos, q}
  end

  # The arguments' containers (tuples, map keys) with each tensor's shape,
  # type, names and vectorized axes: two calls differing in any of them
  # lower apart (same leaves in other containers give other outputs).
  defp templates(vars) do
    Enum.map(vars, fn var ->
      Composite.traverse(var, fn %T{shape: s, type: t, names: n, vectorized_axes: v} -> {s, t, n, v} end)
    end)
  end

  ## Lowering

  # Builds the graph, lowers it and defines its program in the worker;
  # returns the compiled function and its program term (nil on fallback).
  defp build(vars, fun, opts) do
    # nil: the device the worker runs its ops on.
    opts = Keyword.put(opts, :device, opts[:device] || Map.get(Moat.Worker.info(opts[:worker]), :device, :cpu))

    :telemetry.span([:moat, :compile], %{worker: opts[:worker]}, fn ->
      result = fun.(vars)
      expr = Composite.traverse(result, &Nx.devectorize/1)
      output = Composite.traverse(result, &Nx.to_template/1)
      Cache.count_lowering()

      case Lower.lower(expr, Keyword.get(opts, :quant, %{}), Keyword.get(opts, :hooks, %{}), opts[:device]) do
        {:ok, program, used, captures, hooks} ->
          program = if opts[:fuse] == true, do: Map.put(program, :fuse, true), else: program
          # An output that is another's slot is that output again (the
          # evaluator returns one tensor twice: `{x, x} = f.(t)` matches).
          {unique, spread} = spread(program.outputs)
          program = %{program | outputs: unique}
          # The arguments come first among the inputs, then the captures.
          program = if opts[:donate] == false, do: program, else: Map.put(program, :args, length(used))

          compiled = %{
            kind: :program,
            digest: :erlang.md5(:erlang.term_to_binary(program)),
            used: used,
            quant: Keyword.get(opts, :quant, %{}),
            captures: captures,
            output: output,
            outputs: length(program.outputs),
            spread: spread,
            hooks: hooks,
            worker: opts[:worker],
            device: opts[:device]
          }

          {_id, cache} = Cache.program(Client.conn(opts[:worker]), compiled.digest, fn -> program end)
          {{compiled, program}, %{cache: cache, program_size: size(program.steps), fallback: nil}}

        {:unsupported, op} ->
          {{fallback(op, opts), nil}, %{cache: :miss, program_size: 0, fallback: op}}
      end
    end)
  end

  # The distinct output slots, and for each output its position among
  # them (nil when all are distinct).
  defp spread(outputs) do
    unique = Enum.uniq(outputs)

    if length(unique) == length(outputs) do
      {outputs, nil}
    else
      position = unique |> Enum.with_index() |> Map.new()
      {unique, Enum.map(outputs, &Map.fetch!(position, &1))}
    end
  end

  defp size(steps) do
    Enum.reduce(steps, 0, fn
      {:while, _, _, %{cond: c, body: b}}, n ->
        n + 1 + size(c) + size(b)

      {:cond, _, _, %{clauses: cs, last: {l, _}}}, n ->
        n + 1 + size(l) + Enum.sum(for {p, _, s, _} <- cs, do: size(p) + size(s))

      _op, n ->
        n + 1
    end)
  end

  defp fallback(op, opts) do
    if opts[:on_unsupported] == :raise do
      raise ArgumentError,
            "Moat.Compiler: #{op} cannot run in a program (on_unsupported: :raise); " <>
              "without that option the function runs on Nx.Defn.Evaluator"
    end

    :telemetry.execute([:moat, :compiler, :fallback], %{}, %{op: op, worker: opts[:worker]})
    Cache.count(:fallback)
    %{kind: :evaluator, opts: Keyword.take(opts, [:hooks]), worker: opts[:worker], device: opts[:device]}
  end

  ## Running

  defp evaluate(c, evaluator, args_list) do
    Nx.with_default_backend({Moat.Backend, worker: c.worker, device: c.device}, fn ->
      Enum.map(args_list, fn args -> hd(evaluator.([args])) end)
    end)
  end

  defp run(%{kind: :program} = c, args, source) do
    conn = Client.conn(c.worker)
    {id, _} = Cache.program(conn, c.digest, source)
    args = List.to_tuple(args)
    tensors = Enum.map(c.used, &param(elem(args, &1).(), c.quant[&1])) ++ c.captures
    moved = Enum.map(tensors, &to_worker(&1, c.worker, c.device))
    ins = Handles.ids!(conn, Enum.map(moved, & &1.data.ref), :run_program)
    outs = Client.new_ids(c.outputs)
    # Handles exist before the frame that defines their ids (see Moat.Handles.ref/2).
    refs = Enum.map(outs, &Handles.ref(conn, &1))
    refs = if c.spread, do: Enum.map(c.spread, &Enum.at(refs, &1)), else: refs
    dispatch(conn, c.hooks, outs, ins, id)
    Cache.count(:replay)

    for {m, t} <- Enum.zip(moved, tensors), m != t, do: Nx.backend_deallocate(m)

    {result, refs} = fill(c.output, refs, c.device)

    # The hooks' values are the program's last outputs: each function gets
    # its handles once the call is sent (reading one waits for the program).
    [] =
      Enum.reduce(outputs_hooks(c.hooks), refs, fn {fun, template, _count}, refs ->
        {value, rest} = fill(Composite.traverse(template, &Nx.devectorize/1), refs, c.device)
        fun.(value)
        rest
      end)

    result
  end

  defp outputs_hooks({:live, _}), do: []
  defp outputs_hooks(hooks), do: hooks

  defp dispatch(conn, {:live, funs}, outs, ins, id) do
    # Hooks inside control flow: the run is a call, during which the
    # worker sends each hook's values as it reaches it; their functions run
    # here, in the evaluator's order, while the program goes on.
    {reply, _} = Client.request_with_hooks(conn, :run_program, outs, ins, id, &hook_value(&1, &2, &3, funs), [])

    case reply do
      {:ok, _, _} -> :ok
      # The outputs are poisoned with it: reading them raises, as after a cast.
      {:error, _} -> :ok
    end
  end

  defp dispatch(_conn, _hooks, [], _ins, _id), do: :ok
  defp dispatch(conn, _hooks, outs, ins, id), do: Client.cast(conn, :run_program, outs, ins, id)

  # One value of a hook firing (as Nx.BinaryBackend tensors: the function
  # may read them while the worker is still running the program); the
  # function runs on the firing's last.
  defp hook_value(%{id: id, value: v, of: n}, bytes, acc, funs) do
    acc = [bytes | acc]

    if v == n - 1 do
      {fun, template} = Map.fetch!(funs, id)

      # Devectorized, as the evaluator computes hooked values.
      {value, []} =
        Composite.traverse(template, Enum.reverse(acc), fn %T{type: type} = t, [b | rest] ->
          {Nx.BinaryBackend.from_binary(Nx.devectorize(t), Moat.Types.from_storage(b, type), []), rest}
        end)

      fun.(value)
      []
    else
      acc
    end
  end

  defp fill(templates, refs, device) do
    Composite.traverse(templates, refs, fn template, [ref | rest] ->
      {%{template | data: %Moat.Backend{ref: ref, device: device}}, rest}
    end)
  end

  # A quantized argument the program was not lowered for is dequantized.
  defp param(arg, quant) do
    arg = Nx.devectorize(arg)
    if Moat.Quantized.info(arg) == quant, do: arg, else: Moat.Quantized.dequantize(arg)
  end

  defp to_worker(%T{data: %Moat.Backend{ref: %Ref{worker: worker}}} = t, worker, _device), do: t
  defp to_worker(%T{} = t, worker, device), do: Nx.backend_copy(t, {Moat.Backend, worker: worker, device: device})
end

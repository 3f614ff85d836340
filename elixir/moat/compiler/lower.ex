defmodule Moat.Compiler.Lower do
  @moduledoc false
  # Lowers a `Nx.Defn.Expr` graph to a program: the nodes are visited like
  # Nx.Defn.Evaluator visits them, and each calls the same Moat.Backend
  # callback, which records its op (name and attrs, as eager mode sends
  # them) into Moat.Compiler.Recorder. `while`, `cond` and blocks without a
  # native op become control-flow steps and sub-frames.
  #
  # Scopes follow Nx.Defn.Tree.scope_ids/2: a node used outside a cond
  # branch (or by several conds) is computed before the cond, in the
  # outermost scope that holds it; one used only inside a branch, only
  # when the branch runs.

  alias Moat.Compiler.Recorder
  alias Moat.Compiler.Recorder.Slot
  alias Nx.Defn.{Composite, Expr, Tree}
  alias Nx.Tensor, as: T

  # Nodes with a user function or a side effect: these run on the evaluator
  # (`hook` only inside control flow, see apply_node(:hook, ...)).
  @unsupported [:fun, :token, :attach_token, :runtime_call, :reduce, :window_reduce]
  @emulated Moat.Types.emulated()

  @doc """
  `{:ok, program, used_params, captures, hooks}` or `{:unsupported, op}`.
  `program` is the term `:define_program` takes, without its id; its
  inputs are the used parameters (by position), then the captures; its
  outputs are the graph's, then each hook's values (`hooks`, in the order
  the evaluator runs them: `{fun, template, count}`). `hooks` is the
  `:hooks` option (name => function) that overrides named hooks.

  A graph with a hook inside control flow (a `while` body, a `cond`
  branch, a block's default implementation) is lowered `live`: every hook
  is then a `{:hook, slots, [], %{id: id}}` step, which sends its values to
  the caller as the worker reaches it, and `hooks` is `{:live, %{id =>
  {fun, template}}}`.
  """
  def lower(expr, quant \\ %{}, hooks \\ %{}, device \\ :cpu, live \\ false) do
    Recorder.start()
    Recorder.update(&Map.merge(&1, %{quant: quant, hook_funs: hooks, hooks: [], device: device, live: live}))

    result =
      try do
        {outputs, steps} =
          frame(%{}, true, Tree.scope_ids(expr), fn ->
            expr |> Composite.traverse(&lower_node/1) |> flat() |> Enum.map(&Recorder.slot/1)
          end)

        state = Recorder.get()
        {positions, param_slots} = state.inputs |> Enum.sort() |> Enum.unzip()
        {capture_slots, captures} = state.capture_list |> Enum.reverse() |> Enum.unzip()

        {hook_slots, hooks} =
          if live do
            {[], {:live, Map.new(state.hooks, fn {fun, template, id} -> {id, {fun, template}} end)}}
          else
            hooks = Enum.reverse(state.hooks)
            hook_slots = Enum.flat_map(hooks, fn {_fun, _template, slots} -> slots end)
            {hook_slots, Enum.map(hooks, fn {fun, template, slots} -> {fun, template, length(slots)} end)}
          end

        outputs = outputs ++ hook_slots
        program = %{slots: state.next, inputs: param_slots ++ capture_slots, outputs: outputs, steps: steps}
        {:ok, program, positions, captures, hooks}
      catch
        {:moat_unsupported, :hook} when not live -> {:relower, :live}
        {:moat_unsupported, op} -> {:unsupported, op}
      after
        Recorder.stop()
      end

    case result do
      {:relower, :live} -> lower(expr, quant, hooks, device, true)
      result -> result
    end
  end

  # Runs `fun` in a fresh frame (the function itself, a while's condition
  # and body, a block's default implementation): its own parameters (`top`:
  # the function's, which become program inputs as they are met), memo and
  # scopes. Returns fun's result and the frame's steps.
  defp frame(params, top, ids, fun) do
    saved = Recorder.get()
    Recorder.put(%{saved | params: params, top: top, scopes: [scope(ids)]})
    result = fun.()
    state = Recorder.get()
    [%{steps: steps}] = state.scopes
    Recorder.put(%{state | params: saved.params, top: saved.top, scopes: saved.scopes})
    {result, Enum.reverse(steps)}
  end

  defp scope(ids), do: %{steps: [], memo: %{}, ids: ids}

  # The steps the current scope recorded so far, which it forgets (a while
  # takes its condition's steps before it lowers its body; the memo stays,
  # so the body reuses what the condition computed).
  defp take_steps do
    state = Recorder.get()
    [scope | rest] = state.scopes
    Recorder.put(%{state | scopes: [%{scope | steps: []} | rest]})
    Enum.reverse(scope.steps)
  end

  defp lower_node(%T{data: %Expr{id: id, op: op}} = t) do
    %{scopes: scopes} = Recorder.get()

    case Enum.find_value(scopes, &(Map.fetch(&1.memo, id) |> ok())) do
      {:ok, result} ->
        result

      nil ->
        depth = target_depth(scopes, id)
        at_depth(depth, fn -> apply_node(op, t) end, id)
    end
  end

  defp ok({:ok, _} = found), do: found
  defp ok(:error), do: nil

  # The outermost scope of this frame that holds `id`, or the current one.
  defp target_depth(scopes, id) do
    scopes
    |> Enum.with_index()
    |> Enum.reduce(0, fn {%{ids: ids}, k}, acc -> if is_map_key(ids, id), do: k, else: acc end)
  end

  # Lowers in the scope `depth` levels out (whose steps run before the
  # inner scopes' cond steps are recorded), and memoizes there.
  defp at_depth(depth, fun, id) do
    {inner, outer} = Enum.split(Recorder.get().scopes, depth)
    Recorder.update(&%{&1 | scopes: outer})
    result = fun.()

    Recorder.update(fn %{scopes: [scope | rest]} = state ->
      %{state | scopes: inner ++ [%{scope | memo: Map.put(scope.memo, id, result)} | rest]}
    end)

    result
  end

  defp apply_node(op, _t) when op in @unsupported, do: Recorder.unsupported!(op)

  defp apply_node(:parameter, %T{data: %Expr{args: [pos]}} = t) do
    state = Recorder.get()

    case state.params do
      %{^pos => tensor} ->
        tensor

      %{} when state.top ->
        # A parameter of the function: a program input.
        [slot] = Recorder.alloc(1)
        tensor = bind(t, slot, state.quant[pos])
        Recorder.update(&%{&1 | params: Map.put(&1.params, pos, tensor), inputs: [{pos, slot.n} | &1.inputs]})
        tensor
    end
  end

  defp apply_node(:tensor, %T{data: %Expr{args: [tensor]}} = t),
    do: bind(t, %Slot{n: Recorder.slot(tensor)}, Moat.Quantized.info(tensor))

  # A hook of the function's own frame (not in a while, a cond branch or a
  # block's default implementation): its values become extra outputs of
  # the program, and Moat.Compiler calls its function on them after the
  # call's frame is sent, so the program never stops for it. Elsewhere a
  # hook fires per iteration or per taken branch, which only the worker
  # knows: the graph is lowered again `live` (see lower/5), where every
  # hook is a step that sends its values to the caller.
  defp apply_node(:hook, %T{data: %Expr{args: [tensor_expr, spec, template, _ref]}} = t) do
    %{scopes: scopes, top: top, live: live} = Recorder.get()
    unless live or (top and length(scopes) == 1), do: Recorder.unsupported!(:hook)
    value = Composite.traverse(tensor_expr, &lower_node/1)

    {hooked, template, spec} =
      case spec do
        {:token_hook, hooked_expr, inner} ->
          hooked = Composite.traverse(hooked_expr, &lower_node/1)
          {hooked, Composite.traverse(hooked_expr, &Nx.to_template/1), inner}

        spec ->
          {value, template, spec}
      end

    case hook_fun(spec, Recorder.get().hook_funs) do
      nil ->
        :ok

      fun when live ->
        slots = hooked |> flat() |> Enum.map(&Recorder.slot/1)
        id = length(Recorder.get().hooks)
        Recorder.push({:hook, slots, [], %{id: id}})
        Recorder.update(&%{&1 | hooks: [{fun, template, id} | &1.hooks]})

      fun ->
        slots = hooked |> flat() |> Enum.map(&Recorder.slot/1)
        Recorder.update(&%{&1 | hooks: [{fun, template, slots} | &1.hooks]})
    end

    case t.type do
      {:tuple, _} -> value |> flat() |> List.to_tuple()
      _ -> value
    end
  end

  defp apply_node(:constant, %T{data: %Expr{args: [number]}} = t), do: Moat.Backend.constant(t, number, [])

  defp apply_node(:metadata, %T{data: %Expr{args: [expr, _metadata]}}), do: Composite.traverse(expr, &lower_node/1)

  defp apply_node(:elem, %T{data: %Expr{args: [tuple, i]}}), do: elem(lower_node(tuple), i)

  defp apply_node(:while, %T{data: %Expr{args: [initial, arg, condition, body]}}) do
    init = initial |> Composite.traverse(&lower_node/1) |> flat()
    arg = Composite.flatten_list([arg])
    state_slots = Recorder.alloc(length(arg))

    params =
      Map.new(Enum.zip(arg, state_slots), fn {%T{data: %Expr{args: [pos]}} = p, slot} -> {pos, bind(p, slot)} end)

    {{pred, cond_steps, results}, body_steps} =
      frame(params, false, Tree.scope_ids({condition, body}), fn ->
        pred = lower_node(condition)
        cond_steps = take_steps()
        results = body |> Composite.traverse(&lower_node/1) |> flat()
        {pred, cond_steps, results}
      end)

    outs = Recorder.alloc(length(arg))

    Recorder.push(
      {:while, Enum.map(init, &Recorder.slot/1), Recorder.numbers(outs),
       %{
         state: Recorder.numbers(state_slots),
         cond: cond_steps,
         pred: Recorder.slot(pred),
         body: body_steps,
         results: Enum.map(results, &Recorder.slot/1)
       }}
    )

    shape_like(initial, Enum.zip_with(arg, outs, &bind/2))
  end

  defp apply_node(:cond, %T{data: %Expr{args: [clauses, last]}} = t) do
    clauses =
      Enum.map(clauses, fn {pred, body} ->
        {{pred, pred_steps, results}, steps} =
          branch({pred, body}, fn ->
            pred = lower_node(pred)
            pred_steps = take_steps()
            {pred, pred_steps, body |> Composite.traverse(&lower_node/1) |> flat()}
          end)

        {pred_steps, Recorder.slot(pred), steps, Enum.map(results, &Recorder.slot/1)}
      end)

    {last_results, last_steps} = branch(last, fn -> last |> Composite.traverse(&lower_node/1) |> flat() end)
    outs = Recorder.alloc(length(last_results))
    attrs = %{clauses: clauses, last: {last_steps, Enum.map(last_results, &Recorder.slot/1)}}
    Recorder.push({:cond, [], Recorder.numbers(outs), attrs})
    results = Enum.zip_with(last_results, outs, &bind/2)

    case t.type do
      {:tuple, _} -> List.to_tuple(results)
      _ -> hd(results)
    end
  end

  defp apply_node(:block, %T{data: %Expr{args: [struct, in_args, expr, _default]}} = t) do
    {tensors, opts} = Enum.split_while(in_args, &(not is_list(&1)))
    tensors = Enum.map(tensors, &lower_node/1)
    out = if match?({:tuple, _}, t.type), do: expr, else: t

    case Moat.Backend.native_block(struct, out, tensors ++ opts) do
      :default ->
        # Its default implementation, a graph over the block's arguments.
        params = tensors |> Enum.with_index(&{&2, &1}) |> Map.new()
        {result, steps} = frame(params, false, Tree.scope_ids(expr), fn -> Composite.traverse(expr, &lower_node/1) end)
        Enum.each(steps, &Recorder.push/1)
        result

      result ->
        result
    end
  end

  defp apply_node(op, t) do
    {args, _} = Tree.apply_args(t, nil, &{lower_node(&1), &2})

    args =
      cond do
        op in [:eye, :iota] -> [t | args] ++ [[]]
        match?({:tuple, _}, t.type) -> args
        true -> [t | args]
      end

    # What Moat.Backend runs on Nx.BinaryBackend (c128 math MLX lacks), or
    # emulates over MLX types (c128, f8, sub-byte integers: Moat.Types,
    # which reads its inputs' worker), cannot be a step: the graph runs on
    # the evaluator.
    [out | rest] = args
    if Moat.Types.route(op, out, rest) == :fallback or emulated?(args), do: Recorder.unsupported!(op)

    apply(Moat.Backend, op, args)
  end

  defp emulated?(args), do: Enum.any?(args, &match?(%T{type: type} when type in @emulated, &1))

  # As Nx.Defn.Evaluator resolves a hook's function.
  defp hook_fun({:fn, fun}, _hooks), do: fun
  defp hook_fun({:named, name, callback}, hooks), do: hooks[name] || callback

  # Lowers `fun` in a cond branch: a scope of its own inside this frame.
  defp branch(exprs, fun) do
    Recorder.update(&%{&1 | scopes: [scope(Tree.scope_ids(exprs)) | &1.scopes]})
    result = fun.()
    state = Recorder.get()
    [%{steps: steps} | rest] = state.scopes
    Recorder.put(%{state | scopes: rest})
    {result, Enum.reverse(steps)}
  end

  # `quant`: a quantized weight's parameters (Moat.Quantized), or nil.
  defp bind(%T{} = template, %Slot{} = slot, quant \\ nil),
    do: %{template | data: %Moat.Backend{ref: slot, quant: quant}}

  defp flat(container), do: Composite.flatten_list([container])

  defp shape_like(%T{}, [single]), do: single
  defp shape_like(tuple, results) when is_tuple(tuple), do: List.to_tuple(results)
end

defmodule Moat.OpTableTest do
  # The ops the client can send are the ops the worker knows, both ways. The
  # ops sent are read from the compiled code of the library's modules (not
  # from a list kept by hand): each call that reaches `Moat.Protocol.request/6,7`,
  # the one place a request header is made, with its op as a literal atom (or
  # a literal map of them); a function that passes one of its parameters on
  # as the op is a sender too, and its callers are followed in turn. So is a
  # sender passed as a fun (`&op/4` given to Moat.Quantized, which calls
  # `send.(out, :quantized_matmul, ...)`): the parameter it is bound to is
  # followed into the functions it is passed on to and the calls made of it;
  # a sending fun that goes anywhere else is reported, as is a non-literal op.
  # The worker's side (`moat_port --list-ops` equals protocol.md §6) is
  # checked by port/tests/op_table.rs.
  use ExUnit.Case, async: true

  @roots %{{Moat.Protocol, :request, 6} => 3, {Moat.Protocol, :request, 7} => 3}

  # priv/'s worker is the CPU build, which bin/gpu does not carry.
  # Ops the worker serves that no library code sends, each for its reason.
  @worker_only %{
    # The smallest two-input op with shape rules of its own (Moat.Backend
    # sends `:dot`): the worker's frame, fault and malformed-request tests
    # and protocol.md's error example drive it.
    "matmul" => "the worker's own two-input test op",
    # A shape-only broadcast (Moat.Backend sends `:broadcast`, with axes):
    # the worker's memory and size-guard tests ask it for huge shapes.
    "broadcast_to" => "the worker's own huge-shape test op",
    # The protocol's barrier (protocol.md §6): benches measure the round trip
    # with it and reliability tests wait on it; the library waits on readbacks.
    "sync" => "the barrier benches and tests call through Moat.Client.call/4"
  }

  # priv/'s worker is the CPU build, which bin/gpu does not carry.
  @tag :cpu_only
  test "every op the library can send is one the worker lists" do
    {sent, unresolved} = sent_ops()
    assert unresolved == [], "cannot tell which op these calls send: #{inspect(unresolved)}"
    assert map_size(sent) > 130, "found only #{map_size(sent)} ops sent: #{inspect(Map.keys(sent))}"

    missing = for {op, where} <- sent, to_string(op) not in worker_ops(), do: {op, where}
    assert missing == [], "ops the client sends but the worker does not know: #{inspect(missing)}"
  end

  @tag :cpu_only
  test "every op the worker lists is one the library sends (or one of the few it need not)" do
    {sent, _} = sent_ops()
    sent = MapSet.new(Map.keys(sent), &to_string/1)
    unsent = for op <- worker_ops(), op not in sent, not Map.has_key?(@worker_only, op), do: op

    assert unsent == [],
           "ops the worker lists but no Elixir code sends (dead, or a sender the analysis misses): #{inspect(unsent)}"

    stale = for {op, _} <- @worker_only, op in sent or op not in worker_ops(), do: op
    assert stale == [], "@worker_only names ops sent by the library or unknown to the worker: #{inspect(stale)}"
  end

  test "the analysis finds the senders it must" do
    {sent, _} = sent_ops()
    # One of each way an op name reaches the wire: a callback generated from a
    # table, a single clause, a literal map of a block, a control call of the
    # client, a memory call, the releaser's batches, a sender passed as a fun.
    for op <-
          [:exp, :add, :equal, :dot, :cumulative_max, :top_k, :from_binary, :upload, :upload_file] ++
            [:to_binary, :set_memory_limit, :release, :quantized_matmul, :dequantize] do
      assert Map.has_key?(sent, op), "#{op} not found among the ops sent"
    end
  end

  defp worker_ops do
    {out, 0} = System.cmd(Path.join(:code.priv_dir(:moat), "moat_port"), ["--list-ops"])
    String.split(out, "\n", trim: true)
  end

  # %{op => [{module, line}]} and the calls whose op is not a literal.
  defp sent_ops do
    functions =
      for mod <- library_modules(), {:function, _, name, arity, clauses} <- forms(mod), into: %{} do
        {{mod, name, arity}, clauses}
      end

    known = fixpoint(functions, {@roots, %{}})
    collect(functions, known)
  end

  defp library_modules do
    {:ok, mods} = :application.get_key(:moat, :modules)
    lib = Path.expand("../../elixir", __DIR__)
    Enum.filter(mods, fn mod -> String.starts_with?(to_string(mod.module_info(:compile)[:source]), lib) end)
  end

  defp forms(mod) do
    {:ok, {^mod, [debug_info: {:debug_info_v1, backend, data}]}} =
      :beam_lib.chunks(:code.which(mod), [:debug_info])

    {:ok, forms} = backend.debug_info(:erlang_v1, mod, data, [])
    forms
  end

  # What is known: senders (`%{mfa => position of the op}`) and sending fun
  # parameters (`%{{mfa, k} => position of the op in the fun's calls}`).
  # A function that passes a parameter on as the op of a sender is a sender;
  # a parameter given a sending fun (a capture of a sender, or a sending fun
  # parameter passed on) is a sending fun parameter.
  defp fixpoint(functions, {senders, fun_params} = known) do
    calls = sends(functions, known)

    senders =
      for {fun, params, _, args, _, pos} <- calls,
          pos != nil,
          {:var, _, var} <- [Enum.at(args, pos - 1)],
          k = param_position(params, var),
          k != nil,
          into: senders,
          do: {fun, k}

    fun_params =
      for {fun, params, {_, _, _} = callee, args, _, _} <- calls,
          Map.has_key?(functions, callee),
          {arg, i} <- Enum.with_index(args, 1),
          pos = sending_fun(arg, fun, params, known),
          pos != nil,
          into: fun_params,
          do: {{callee, i}, pos}

    new = {senders, fun_params}
    if new == known, do: known, else: fixpoint(functions, new)
  end

  # Each call in each clause: {function, its params, callee, args, line,
  # the position of the op it sends or nil}. A closure's callee is
  # `{:closure, var}`.
  defp sends(functions, {senders, fun_params}) do
    for {{mod, _, _} = fun, clauses} <- functions,
        {:clause, _, params, _, body} <- clauses,
        {callee, args, line} <- calls(mod, body) do
      pos =
        case callee do
          {:closure, var} -> fun_params[{fun, param_position(params, var)}]
          mfa -> senders[mfa]
        end

      {fun, params, callee, args, line, pos}
    end
  end

  # The op position of `term` if it is a sending fun (see fixpoint/2), or nil.
  defp sending_fun({:fun, _, {:function, f, a}}, {mod, _, _}, _, {senders, _}), do: senders[{mod, f, a}]

  defp sending_fun({:fun, _, {:function, {:atom, _, m}, {:atom, _, f}, {:integer, _, a}}}, _, _, {senders, _}),
    do: senders[{m, f, a}]

  defp sending_fun({:var, _, var}, fun, params, {_, fun_params}), do: fun_params[{fun, param_position(params, var)}]
  defp sending_fun(_, _, _, _), do: nil

  defp collect(functions, known) do
    results =
      for {fun, params, _callee, args, line, pos} <- sends(functions, known), pos != nil do
        {mod, _, _} = fun

        case Enum.at(args, pos - 1) do
          {:atom, _, op} ->
            {:ops, [{op, {mod, line}}]}

          {:var, _, var} = arg ->
            if param_position(params, var), do: {:ops, []}, else: {:unresolved, {mod, line, arg}}

          expr ->
            case map_atoms(expr) do
              [] -> {:unresolved, {mod, line, expr}}
              ops -> {:ops, for(op <- ops, do: {op, {mod, line}})}
            end
        end
      end

    escaped =
      for {{mod, _, _} = fun, clauses} <- functions,
          {:clause, _, params, _, body} <- clauses,
          term <- escaped(body, {functions, fun, params, known}),
          do: {mod, :escaped, term}

    sent = for({:ops, ops} <- results, {op, where} <- ops, do: {op, where}) |> Enum.group_by(&elem(&1, 0), &elem(&1, 1))
    {sent, for({:unresolved, u} <- results, do: u) ++ escaped}
  end

  # Sending funs used other than as a closure's callee or an argument of a
  # library function (whose parameter is then followed): ops the analysis
  # would lose.
  defp escaped(term, {functions, fun, params, known} = ctx) do
    case term do
      {:call, _, {:var, _, _}, args} ->
        escaped(args, ctx)

      {:call, _, callee, args} ->
        {mod, _, _} = fun

        target =
          case callee do
            {:atom, _, f} -> {mod, f, length(args)}
            {:remote, _, {:atom, _, m}, {:atom, _, f}} -> {m, f, length(args)}
            _ -> nil
          end

        if Map.has_key?(functions, target),
          do: Enum.flat_map(args, &if(sending_fun(&1, fun, params, known), do: [], else: escaped(&1, ctx))),
          else: escaped([callee | args], ctx)

      tuple when is_tuple(tuple) ->
        if sending_fun(tuple, fun, params, known), do: [tuple], else: tuple |> Tuple.to_list() |> escaped(ctx)

      list when is_list(list) ->
        Enum.flat_map(list, &escaped(&1, ctx))

      _ ->
        []
    end
  end

  # Every call in a body: {{module, function, arity}, args, line}.
  defp calls(mod, term) do
    case term do
      {:call, anno, {:var, _, var}, args} ->
        [{{:closure, var}, args, :erl_anno.line(anno)} | calls(mod, args)]

      {:call, anno, {:atom, _, f}, args} ->
        [{{mod, f, length(args)}, args, :erl_anno.line(anno)} | calls(mod, args)]

      {:call, anno, {:remote, _, {:atom, _, m}, {:atom, _, f}}, args} ->
        [{{m, f, length(args)}, args, :erl_anno.line(anno)} | calls(mod, args)]

      tuple when is_tuple(tuple) ->
        tuple |> Tuple.to_list() |> calls_in(mod)

      list when is_list(list) ->
        calls_in(list, mod)

      _ ->
        []
    end
  end

  defp calls_in(list, mod), do: Enum.flat_map(list, &calls(mod, &1))

  # The 1-based position of the parameter bound to `var` (directly, or as
  # `pattern = var`), or nil.
  defp param_position(params, var) do
    Enum.find_value(Enum.with_index(params, 1), fn {param, k} -> if binds?(param, var), do: k end)
  end

  defp binds?({:var, _, var}, var), do: true
  defp binds?({:match, _, left, right}, var), do: binds?(left, var) or binds?(right, var)
  defp binds?(_, _), do: false

  defp map_atoms({:map, _, assocs}), do: for({:map_field_assoc, _, _, {:atom, _, op}} <- assocs, do: op)
  defp map_atoms(tuple) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> Enum.flat_map(&map_atoms/1)
  defp map_atoms(list) when is_list(list), do: Enum.flat_map(list, &map_atoms/1)
  defp map_atoms(_), do: []
end

defmodule Moat.OpTableTest do
  # Every op the client can send is one the worker knows. The ops sent are
  # read from the compiled code of the library's modules (not from a list kept
  # by hand): each call that reaches `Moat.Protocol.request/6,7`, the one
  # place a request header is made, with its op as a literal atom (or a
  # literal map of them); a function that passes one of its parameters on
  # as the op is a sender too, and its callers are followed in turn. The
  # worker's side (`moat_port --list-ops` equals protocol.md §6) is checked
  # by port/tests/op_table.rs.
  use ExUnit.Case, async: true

  @roots %{{Moat.Protocol, :request, 6} => 3, {Moat.Protocol, :request, 7} => 3}

  # priv/'s worker is the CPU build, which bin/gpu does not carry.
  @tag :cpu_only
  test "every op the library can send is one the worker lists" do
    {sent, unresolved} = sent_ops()
    assert unresolved == [], "cannot tell which op these calls send: #{inspect(unresolved)}"
    assert map_size(sent) > 130, "found only #{map_size(sent)} ops sent: #{inspect(Map.keys(sent))}"

    missing = for {op, where} <- sent, to_string(op) not in worker_ops(), do: {op, where}
    assert missing == [], "ops the client sends but the worker does not know: #{inspect(missing)}"
  end

  test "the analysis finds the senders it must" do
    {sent, _} = sent_ops()
    # One of each way an op name reaches the wire: a callback generated from a
    # table, a single clause, a literal map of a block, a control call of the
    # client, a memory call, the releaser's batches.
    for op <-
          [:exp, :add, :equal, :dot, :cumulative_max, :top_k, :from_binary, :upload, :upload_file] ++
            [:to_binary, :set_memory_limit, :release] do
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

    senders = fixpoint(functions, @roots)
    collect(functions, senders)
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

  # Functions that pass a parameter on as the op of a sender are senders.
  defp fixpoint(functions, senders) do
    found =
      for {{mod, _, _} = fun, clauses} <- functions,
          {:clause, _, params, _, body} <- clauses,
          {callee, args, _line} <- calls(mod, body),
          pos = senders[callee],
          pos != nil,
          {:var, _, var} <- [Enum.at(args, pos - 1)],
          k = param_position(params, var),
          k != nil,
          into: %{},
          do: {fun, k}

    new = Map.merge(found, senders)
    if map_size(new) == map_size(senders), do: senders, else: fixpoint(functions, new)
  end

  defp collect(functions, senders) do
    results =
      for {{mod, _, _}, clauses} <- functions,
          {:clause, _, params, _, body} <- clauses,
          {callee, args, line} <- calls(mod, body),
          pos = senders[callee],
          pos != nil do
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

    sent = for({:ops, ops} <- results, {op, where} <- ops, do: {op, where}) |> Enum.group_by(&elem(&1, 0), &elem(&1, 1))
    {sent, for({:unresolved, u} <- results, do: u)}
  end

  # Every call in a body: {{module, function, arity}, args, line}.
  defp calls(mod, term) do
    case term do
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

defmodule Moat.Scope do
  @moduledoc false
  # `Moat.scope/1`: the ids created by this process inside a scope, kept in
  # the process dictionary as {worker, incarnation, id} (not the handles, so
  # that garbage inside a long scope is still released automatically). The
  # handles' tokens are not marked, so an id a scope released may be sent
  # again when its handle is collected; the worker ignores unknown ids.
  #
  # `run/2` is given the function that releases ids (Moat.Handles'), so that
  # this module, which Moat.Handles calls, calls nothing that calls it.

  alias Moat.Ref

  @key :moat_scope

  @doc false
  def record(worker, incarnation, id) do
    case Process.get(@key) do
      nil -> :ok
      created -> Process.put(@key, [{worker, incarnation, id} | created])
    end
  end

  @doc false
  # `release.(worker, generation, ids)` releases ids of one worker incarnation.
  def run(fun, release) when is_function(fun, 0) and is_function(release, 3) do
    outer = Process.put(@key, [])

    try do
      fun.()
    catch
      kind, reason ->
        close(outer, MapSet.new(), release)
        :erlang.raise(kind, reason, __STACKTRACE__)
    else
      result ->
        close(outer, collect(result, MapSet.new()), release)
        result
    end
  end

  # Releases what the scope created except `keep`; what it keeps belongs to
  # the enclosing scope, if any.
  defp close(outer, keep, release) do
    created = Process.delete(@key) || []
    {kept, dropped} = Enum.split_with(created, fn {_, inc, id} -> MapSet.member?(keep, {inc, id}) end)
    if outer, do: Process.put(@key, kept ++ outer)

    dropped
    |> Enum.group_by(fn {worker, inc, _} -> {worker, inc} end, fn {_, _, id} -> id end)
    |> Enum.each(fn {{worker, inc}, ids} -> release.(worker, inc, ids) end)
  end

  # Every handle inside a term (tensors, containers, structs), as
  # {incarnation, id}: a handle of another node's worker keeps nothing here.
  defp collect(%Ref{incarnation: inc, id: id}, acc), do: MapSet.put(acc, {inc, id})
  defp collect(%_{} = struct, acc), do: struct |> Map.from_struct() |> collect(acc)
  defp collect(map, acc) when is_map(map), do: Enum.reduce(map, acc, fn {k, v}, acc -> collect(v, collect(k, acc)) end)
  defp collect([head | tail], acc), do: collect(tail, collect(head, acc))
  defp collect(tuple, acc) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> collect(acc)
  defp collect(_other, acc), do: acc
end

defmodule Moat.Scope do
  @moduledoc false
  # `Moat.scope/1`: the ids created by this process inside a scope, kept in
  # the process dictionary as {worker, incarnation, id} (not the handles, so
  # that garbage inside a long scope is still released automatically). The
  # handles' tokens are not marked, so an id a scope released may be sent
  # again when its handle is collected; the worker ignores unknown ids.
  # Each scope has a flag (`flag/0`), set when it closes: Moat.Backend keeps
  # the flag of the scope a tensor's BEAM-side bytes were kept in, and reads
  # them without a round trip only while it is open (a read of a released id
  # must take the round trip, which raises). A flag, not the tokens: holding
  # those would keep garbage inside a long scope from being released.
  #
  # `run/2` is given the function that releases ids (Moat.Handles'), so that
  # this module, which Moat.Handles calls, calls nothing that calls it.

  alias Moat.Ref

  @key :moat_scope
  @flag :moat_scope_flag

  @typedoc "A scope's flag: an :atomics of one, set to 1 when the scope closes."
  @type flag :: :atomics.atomics_ref()

  @doc false
  # The innermost open scope's flag, or nil outside any scope.
  @spec flag() :: flag() | nil
  def flag, do: Process.get(@flag)

  @doc false
  # Whether the scope of `flag` has closed (nil: made outside any scope).
  @spec closed?(flag() | nil) :: boolean()
  def closed?(nil), do: false
  def closed?(flag), do: :atomics.get(flag, 1) == 1

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
    outer_flag = Process.put(@flag, :atomics.new(1, signed: false))

    try do
      fun.()
    catch
      kind, reason ->
        close(outer, outer_flag, MapSet.new(), release)
        :erlang.raise(kind, reason, __STACKTRACE__)
    else
      result ->
        close(outer, outer_flag, collect(result, MapSet.new()), release)
        result
    end
  end

  # Releases what the scope created except `keep`; what it keeps belongs to
  # the enclosing scope, if any. The flag is set first, so that no read
  # answers from BEAM-side bytes once their ids may be gone (what it keeps
  # loses that shortcut too: one flag cannot tell them apart).
  defp close(outer, outer_flag, keep, release) do
    :atomics.put(Process.get(@flag), 1, 1)
    if outer_flag, do: Process.put(@flag, outer_flag), else: Process.delete(@flag)
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

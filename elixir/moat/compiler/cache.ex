defmodule Moat.Compiler.Cache do
  @moduledoc false
  # Moat.Compiler's caches, in one public ETS table made at application start:
  #
  #   * `{:lowered, key}` - jit's lowered functions by (function, argument
  #     templates, options), so a replay lowers nothing, and beside each
  #     `{:source, key}`, its program's term (read only to define it, so a
  #     replay does not copy it out of the table);
  #   * `{:program, worker, generation, digest}` - the id of a program, by
  #     the digest of its structure (ops, attrs, shapes, types), in that
  #     worker incarnation. A restart starts a new generation, so the next
  #     call defines the program again.
  #
  # Each holds at most `config :moat, max_programs:` (256) entries per kind
  # (programs: per worker); the least recently used goes first, and an
  # evicted program is released in its worker. A call that read a program's
  # id just before another process evicted it may reach the worker after
  # the release: its outputs are then poisoned ("program N is not
  # defined"), never wrong, and the next call defines the program again.
  # Only the least recently used entry is evicted, so this takes a bound
  # far below the programs in use.

  alias Moat.{Client, Error}

  @table __MODULE__
  # :counters slots
  @replays 1
  @defined 2
  @lowered 3
  @fallbacks 4

  def init do
    :ets.new(@table, [:set, :public, :named_table, read_concurrency: true, write_concurrency: true])
    :persistent_term.put({__MODULE__, :counters}, :counters.new(4, [:write_concurrency]))
    :ok
  end

  defp counters, do: :persistent_term.get({__MODULE__, :counters})
  defp tick, do: System.unique_integer([:monotonic])

  def count(:replay), do: :counters.add(counters(), @replays, 1)
  def count(:fallback), do: :counters.add(counters(), @fallbacks, 1)

  def max_programs, do: Moat.Config.get(:max_programs)

  @doc """
  The lowered function under `key`, made by `build` on a miss (which
  returns it and its program's term, or nil).
  """
  def lowered(key, build) do
    case :ets.lookup(@table, {:lowered, key}) do
      [{_, compiled, _}] ->
        compiled

      [] ->
        {compiled, program} = build.()
        :ets.insert(@table, [{{:source, key}, program, nil}, {{:lowered, key}, compiled, tick()}])

        evict({{:lowered, :_}, :_, :_}, fn keys ->
          Enum.each(keys, &:ets.delete(@table, {:source, &1}))
        end)

        compiled
    end
  end

  # Terms a key may hold (elements, list cells, map entries, closure
  # environments, binary KiB) for hashing it to be cheap.
  @hash_budget 100_000

  @doc """
  Whether `key` is small enough to hash: counted here with a budget, as a
  preemptible walk, where ETS's hash of a term runs without yielding and
  does not see its sharing.
  """
  def hashable?(key), do: cost(key, @hash_budget) >= 0

  defp cost(_term, n) when n < 0, do: n
  defp cost(tuple, n) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> cost(n - 1)
  defp cost([head | tail], n), do: cost(tail, cost(head, n - 1))
  defp cost(map, n) when is_map(map), do: map |> Map.to_list() |> cost(n - 1)
  defp cost(binary, n) when is_binary(binary), do: n - 1 - div(byte_size(binary), 1024)
  defp cost(fun, n) when is_function(fun), do: fun |> Function.info(:env) |> elem(1) |> cost(n - 1)
  defp cost(_term, n), do: n - 1

  def count_lowering, do: :counters.add(counters(), @lowered, 1)

  @doc "The program term `lowered/2` keeps beside `key`."
  def source(key) do
    case :ets.lookup(@table, {:source, key}) do
      [{_, program, _}] -> program
      [] -> raise Error.new(:op_failed, :define_program, "the lowered function was evicted meanwhile; call it again")
    end
  end

  @doc """
  The id of program `digest` in `conn`'s worker, defined there first from
  `source.()` when it is not (`:miss`, else `:hit`).
  """
  def program(conn, digest, source) do
    key = {:program, conn.name, conn.generation, digest}

    case :ets.lookup(@table, key) do
      [{_, id, _}] ->
        :ets.update_element(@table, key, {3, tick()})
        {id, :hit}

      [] ->
        {define(conn, key, digest, source), :miss}
    end
  end

  defp define(conn, key, digest, source) do
    id = Client.new_id()

    case Client.call(conn, :define_program, [], Map.put(source.(), :id, id)) do
      {:ok, _, _} -> :ok
      {:error, e} -> raise e
    end

    :counters.add(counters(), @defined, 1)

    if :ets.insert_new(@table, {key, id, tick()}) do
      evict_programs(conn)
      id
    else
      # Another process defined it meanwhile: use theirs, drop ours.
      Client.cast(conn, :release_program, [], [], [id])
      conn |> program(digest, source) |> elem(0)
    end
  end

  defp evict_programs(%Client{name: name, generation: g} = conn) do
    # Entries of earlier generations name programs that died with them.
    :ets.select_delete(@table, [{{{:program, name, :"$1", :_}, :_, :_}, [{:"/=", :"$1", g}], [true]}])
    evict({{:program, name, g, :_}, :_, :_}, &Client.cast(conn, :release_program, [], [], &1))
  end

  defp evict(pattern, release) do
    entries = :ets.match_object(@table, pattern)
    excess = length(entries) - max_programs()

    if excess > 0 do
      old = entries |> Enum.sort_by(&elem(&1, 2)) |> Enum.take(excess)
      Enum.each(old, &:ets.delete(@table, elem(&1, 0)))
      release.(Enum.map(old, &release_key/1))
    end

    :ok
  end

  # What an evicted entry leaves to release: a lowered function's key, a
  # program's id.
  defp release_key({{:lowered, key}, _, _}), do: key
  defp release_key({_, id, _}), do: id

  @doc "See `Moat.compiler_info/1`."
  def info(worker) do
    g = Client.last_generation(worker)
    c = counters()

    %{
      programs: :ets.select_count(@table, [{{{:program, worker, g, :_}, :_, :_}, [], [true]}]),
      lowered: :ets.select_count(@table, [{{{:lowered, :_}, :_, :_}, [], [true]}]),
      replays: :counters.get(c, @replays),
      defined: :counters.get(c, @defined),
      lowerings: :counters.get(c, @lowered),
      fallbacks: :counters.get(c, @fallbacks)
    }
  end
end

defmodule Moat.KVCacheTest do
  # Moat.KVCache in a real worker against the same steps on
  # Nx.BinaryBackend (the reference: Nx.put_slice and the attention
  # composition), the in-place write measured by the worker's peak memory,
  # and what the spent handles say.
  use ExUnit.Case, async: false

  alias Moat.{Fast, KVCache}

  # atol = rtol against the reference, as in fast_test.exs.
  @tolerance %{{:f, 32} => 1.0e-5, {:f, 16} => 4.0e-3, {:bf, 16} => 3.0e-2}

  defp random(seed, shape, type \\ {:f, 32}) do
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape, type: {:f, 32})
    Nx.as_type(t, type)
  end

  defp moat(t), do: Nx.backend_copy(t, Moat.Backend)

  defp assert_close!(a, b, tol) do
    a = a |> Nx.backend_copy(Nx.BinaryBackend) |> Nx.as_type({:f, 64})
    b = Nx.as_type(b, {:f, 64})
    worst = a |> Nx.subtract(b) |> Nx.abs() |> Nx.subtract(Nx.multiply(Nx.abs(b), tol)) |> Nx.reduce_max()
    assert Nx.to_number(worst) <= tol, "differ by more than #{tol}: #{Nx.to_number(worst)}"
  end

  # A prefill of 5 rows, then 3 decode steps: the attention output of every
  # step, and the final cache, on `backend`.
  defp run(backend, type, starts) do
    cache = KVCache.new(batch: 2, heads: 2, max_len: 12, head_dim: 16, type: type, starts: starts, backend: backend)
    on = &Nx.backend_copy(&1, backend)

    Enum.map_reduce([{5, 1}, {1, 2}, {1, 3}, {1, 4}], cache, fn {t, seed}, cache ->
      {q, k, v} =
        {random(seed, {2, 4, t, 16}, type), random(seed + 10, {2, 2, t, 16}, type),
         random(seed + 20, {2, 2, t, 16}, type)}

      cache = KVCache.update(cache, on.(k), on.(v))
      {KVCache.attend(cache, on.(q), mask: :causal), cache}
    end)
  end

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}] do
    test "prefill and decode steps match the reference #{inspect(type)}" do
      type = unquote(type)
      tol = Map.fetch!(@tolerance, type)

      for starts <- [0, Nx.tensor([0, 2])] do
        {outs, cache} = run(Moat.Backend, type, starts)
        {expected, ref} = run(Nx.BinaryBackend, type, starts)
        assert cache.offset == 8 and ref.offset == 8
        # Row 1's first two prefill queries see no key when it is padded by
        # 2 (not defined): the others are compared.
        [first | rest] = Enum.zip(outs, expected)
        {out, exp} = first
        padded = if is_integer(starts), do: 0, else: 2

        assert_close!(
          Nx.slice_along_axis(out, padded, 5 - padded, axis: 2),
          Nx.slice_along_axis(exp, padded, 5 - padded, axis: 2),
          tol
        )

        assert_close!(Nx.slice_along_axis(out, 0, 1, axis: 0), Nx.slice_along_axis(exp, 0, 1, axis: 0), tol)
        for {out, exp} <- rest, do: assert_close!(out, exp, tol)
        assert Nx.to_binary(cache.keys) == Nx.to_binary(ref.keys)
        assert Nx.to_binary(cache.values) == Nx.to_binary(ref.values)
      end
    end
  end

  test "with left padding, a row attends only to its own tokens" do
    # Row 1 is padded by 2: its attention equals that of a cache holding
    # only its last 3 rows.
    {k, v, q} = {random(1, {2, 2, 5, 16}), random(2, {2, 2, 5, 16}), random(3, {2, 4, 1, 16})}
    cache = KVCache.new(batch: 2, heads: 2, max_len: 8, head_dim: 16, starts: Nx.tensor([0, 2]))
    cache = KVCache.update(cache, moat(k), moat(v))
    out = KVCache.attend(cache, moat(q), mask: :causal) |> Nx.backend_transfer()
    row = fn t -> Nx.slice(t, [1, 0, 2, 0], [1, 2, 3, 16]) end
    alone = Fast.scaled_dot_product_attention(Nx.slice(q, [1, 0, 0, 0], [1, 4, 1, 16]), row.(k), row.(v))
    assert_close!(Nx.slice(out, [1, 0, 0, 0], [1, 4, 1, 16]), alone, 1.0e-5)
    assert Nx.to_flat_list(KVCache.positions(cache)) == [5, 3]
  end

  test "writes go into the cache's own buffer: the peak stays at one cache" do
    # 2 x 16 MiB of f32.
    cache = KVCache.new(batch: 1, heads: 4, max_len: 2048, head_dim: 512)
    rows = Nx.iota({1, 4, 1, 512}, type: :f32, backend: Moat.Backend)
    eval = fn c -> Moat.eval([c.keys.data.ref, c.values.data.ref]) end
    cache = KVCache.update(cache, rows, rows)
    eval.(cache)
    Moat.reset_peak_memory()
    before = Moat.memory_info()

    cache =
      Enum.reduce(1..8, cache, fn i, cache ->
        cache = KVCache.update(cache, Nx.add(rows, i), rows)
        eval.(cache)
        cache
      end)

    peak = Moat.memory_info().peak
    # A copying write would hold two of the 16 MiB buffers at once.
    assert peak - before.active < 8 * 1024 * 1024, "peak grew by #{peak - before.active} bytes"
    assert Nx.to_flat_list(Nx.slice(cache.keys, [0, 3, 8, 0], [1, 1, 1, 2])) == [1544.0, 1545.0]
  end

  test "what still reads the old contents sees them: the write copies then" do
    cache = KVCache.new(batch: 1, heads: 1, max_len: 4, head_dim: 2)
    cache = KVCache.update(cache, moat(Nx.tensor([[[[1.0, 2.0]]]])), moat(Nx.tensor([[[[3.0, 4.0]]]])))
    Moat.eval(cache.keys.data.ref)
    # Built, not evaluated: it holds the old keys.
    pending = Nx.sum(cache.keys)
    shared = Nx.reshape(cache.keys, {8})
    Moat.eval(shared.data.ref)
    next = KVCache.update(cache, moat(Nx.tensor([[[[5.0, 6.0]]]])), moat(Nx.tensor([[[[7.0, 8.0]]]])))
    assert Nx.to_flat_list(next.keys) == [1.0, 2.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0]
    assert Nx.to_number(pending) == 3.0
    assert Nx.to_flat_list(shared) == [1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
  end

  test "the cache passed to update/3 is spent, and says where it went" do
    cache = KVCache.new(batch: 1, heads: 1, max_len: 4, head_dim: 2)
    rows = moat(Nx.tensor([[[[1.0, 2.0]]]]))
    _next = KVCache.update(cache, rows, rows)

    error = assert_raise Moat.Error, fn -> Nx.to_binary(cache.keys) end
    assert Exception.message(error) =~ "kv_write"
    assert Exception.message(error) =~ "written in place"
    # The rows written stay usable.
    assert Nx.to_flat_list(rows) == [1.0, 2.0]
  end

  test "a write past the end is refused, never clamped" do
    cache = KVCache.new(batch: 1, heads: 1, max_len: 4, head_dim: 2)
    rows = moat(Nx.broadcast(1.0, {1, 1, 3, 2}))
    cache = KVCache.update(cache, rows, rows)

    assert_raise ArgumentError, ~r/3 new rows at offset 3 do not fit the cache's 4 rows/, fn ->
      KVCache.update(cache, rows, rows)
    end

    # With a tensor offset the worker checks it.
    spent = KVCache.write(cache.keys, rows, Nx.tensor(2))
    error = assert_raise Moat.Error, fn -> Nx.to_binary(spent) end
    assert Exception.message(error) =~ "kv_write: offset 2 with 3 new rows is outside the cache's 4 rows along axis 2"
    # A refused write moves nothing.
    assert Nx.to_flat_list(cache.keys) == List.duplicate(1.0, 6) ++ [0.0, 0.0]
  end

  test "inside a Moat.Compiler program: the same kv_write op, results as eager" do
    step = fn cache, q, k, v ->
      cache = KVCache.update(cache, k, v)
      {KVCache.attend(cache, q, mask: :causal), cache}
    end

    jitted = Nx.Defn.jit(step, compiler: Moat.Compiler)
    {q, k, v} = {random(1, {1, 2, 1, 8}), random(2, {1, 1, 1, 8}), random(3, {1, 1, 1, 8})}
    fresh = fn -> %{KVCache.new(batch: 1, heads: 1, max_len: 6, head_dim: 8) | offset: Nx.tensor(2)} end

    {out, cache} = jitted.(fresh.(), moat(q), moat(k), moat(v))
    {expected, ref} = step.(fresh.(), moat(q), moat(k), moat(v))
    assert_close!(out, Nx.backend_transfer(expected), 1.0e-6)
    assert Nx.to_number(cache.offset) == 3
    assert Nx.to_binary(cache.keys) == Nx.to_binary(ref.keys)
  end

  test "a compiled step writes the cache it is given in place and spends it (donate: false keeps it)" do
    step = fn cache, rows -> KVCache.update(cache, rows, rows) end
    rows = Nx.iota({1, 4, 1, 512}, type: :f32, backend: Moat.Backend)
    eval = fn c -> Moat.eval([c.keys.data.ref, c.values.data.ref]) end
    # 2 x 16 MiB of f32, its offset a tensor (one program for every step).
    fresh = fn -> %{KVCache.new(batch: 1, heads: 4, max_len: 2048, head_dim: 512) | offset: Nx.tensor(0)} end

    # Peak bytes above the live ones over 4 compiled steps.
    grows = fn jitted ->
      cache = jitted.(fresh.(), rows)
      eval.(cache)
      Moat.reset_peak_memory()
      before = Moat.memory_info()

      cache =
        Enum.reduce(1..4, cache, fn _, cache ->
          next = jitted.(cache, rows)
          eval.(next)
          next
        end)

      {Moat.memory_info().peak - before.active, cache}
    end

    {in_place, cache} = grows.(Nx.Defn.jit(step, compiler: Moat.Compiler))
    {copied, kept} = grows.(Nx.Defn.jit(step, compiler: Moat.Compiler, donate: false))
    assert in_place < 8 * 1024 * 1024, "peak grew by #{in_place} bytes"
    # A copying step holds the old and the new 16 MiB buffers at once.
    assert copied >= 16 * 1024 * 1024, "peak grew by only #{copied} bytes"
    assert Nx.to_number(cache.offset) == 5 and Nx.to_binary(cache.keys) == Nx.to_binary(kept.keys)

    # The argument is spent; under donate: false it stays readable.
    old = %{fresh.() | offset: Nx.tensor(1)}
    _ = Nx.Defn.jit(step, compiler: Moat.Compiler).(old, rows)
    error = assert_raise Moat.Error, fn -> Nx.to_binary(old.keys) end
    assert Exception.message(error) =~ "written in place by program"
    assert Nx.to_flat_list(rows) |> length() == 2048

    old = %{fresh.() | offset: Nx.tensor(1)}
    _ = Nx.Defn.jit(step, compiler: Moat.Compiler, donate: false).(old, rows)
    assert byte_size(Nx.to_binary(old.keys)) == 16 * 1024 * 1024
  end
end

defmodule Moat.CompilerCorpus do
  @moduledoc false
  # defn functions for the compiler's equivalence tests and benchmarks.
  import Nx.Defn

  defn elementwise(a, b) do
    c = Nx.exp(a) * Nx.sin(b) - Nx.tanh(a / (Nx.abs(b) + 1))
    Nx.pow(c, 2) + Nx.sqrt(Nx.abs(c)) * Nx.sigmoid(b) - Nx.log1p(Nx.abs(a))
  end

  defn reductions(a) do
    {Nx.sum(a, axes: [1]), Nx.reduce_max(a), Nx.argmax(a, axis: 0), Nx.mean(a), Nx.product(a, axes: [0]),
     Nx.cumulative_sum(a, axis: 1), Nx.logsumexp(a, axes: [1])}
  end

  defn(dot(a, b), do: Nx.dot(a, Nx.transpose(b)) |> Nx.dot(b))

  defn(conv(x, k), do: Nx.conv(x, k, strides: [1, 1], padding: :same) |> Nx.window_max({1, 1, 2, 2}))

  defn slicing(a) do
    {a[[0..1, 1..2]], Nx.put_slice(a, [1, 1], Nx.tensor([[9.0, 9.0]])), Nx.reverse(a, axes: [0]),
     Nx.pad(a, 0.5, [{1, 0, 0}, {0, 2, 1}]), Nx.concatenate([a, a], axis: 1)}
  end

  defn(dynamic_slice(a, i), do: {Nx.slice(a, [i, 0], [1, 3]), Nx.put_slice(a, [i, 1], Nx.tensor([[7.0, 8.0]]))})

  defn gathers(a, idx) do
    pairs = Nx.stack([idx, idx], axis: 1)

    {Nx.take(a, idx, axis: 0), Nx.gather(a, pairs), Nx.indexed_add(a, pairs, Nx.tensor([1.0, 2.0])),
     Nx.indexed_put(a, pairs, Nx.tensor([5.0, 6.0])),
     Nx.take_along_axis(a, Nx.stack([idx, idx, idx], axis: 1), axis: 0)}
  end

  defn(sorting(a), do: {Nx.sort(a, axis: 1), Nx.argsort(a, axis: 1, direction: :desc), Nx.top_k(a, k: 2)})

  # A loop of `n` iterations (a fused call runs several: the state must
  # stop at the right one).
  defn count_to(x, n) do
    while {i = 0, acc = x, n}, i < n do
      {i + 1, acc * 0.75 + i, n}
    end
  end

  # A condition reading a tensor at the counter: run ahead (unfused, the
  # worker builds the counter's iterations before it knows the flags), the
  # counter reaches an index the loop itself never reads, out of bounds.
  defn take_until(t, limit) do
    while {i = 0, acc = 0.0, t, limit}, Nx.take(t, i) < limit do
      {i + 1, acc + Nx.take(t, i), t, limit}
    end
  end

  # A condition on the whole state (nothing but control), small or not.
  defn halve_until(x, tol) do
    while {x, i = 0, tol}, Nx.sum(x) > tol and i < 100 do
      {x * 0.5 + 0.001, i + 1, tol}
    end
  end

  defn while_tuple(x) do
    {_i, acc, n} =
      while {i = 0, acc = x, n = 0.0}, i < 1000 do
        {i + 1, acc * 0.999 + 0.001, n + Nx.sum(acc)}
      end

    {acc, n}
  end

  defn conds(x) do
    cond do
      Nx.sum(x) > 100 -> {x * 2, Nx.sum(x)}
      Nx.sum(x) > 0 -> {x + 1, Nx.reduce_min(x)}
      true -> {-x, Nx.sum(x) * 0}
    end
  end

  # A value computed outside the cond and used inside it.
  defn cond_shared(x) do
    y = Nx.exp(x)
    z = if Nx.all(x > 0), do: y * 2, else: y - 1
    z + y
  end

  defn(containers(%{a: a, b: {b, c}}), do: %{sum: a + b, pair: {b * c, Nx.sum(c)}})

  defn mlp(x, w1, b1, w2, b2) do
    h = Nx.max(Nx.dot(x, w1) + b1, 0)
    logits = Nx.dot(h, w2) + b2
    e = Nx.exp(logits - Nx.reduce_max(logits, axes: [1], keep_axes: true))
    e / Nx.sum(e, axes: [1], keep_axes: true)
  end

  defn linalg(a) do
    spd = Nx.dot(a, Nx.transpose(a)) + Nx.eye(3)
    {q, r} = Nx.LinAlg.qr(spd)
    {q, r, Nx.LinAlg.cholesky(spd), Nx.LinAlg.determinant(spd)}
  end

  defn(integers(a, b), do: {Nx.quotient(a, b), Nx.remainder(a, b), Nx.bitwise_and(a, 6), Nx.left_shift(a, 2)})

  # A plain function (defn has no Enum), jitted like one.
  def tiny_chain(x) do
    Enum.reduce(1..100, x, fn i, acc -> if rem(i, 2) == 0, do: Nx.add(acc, 1.0), else: Nx.multiply(acc, 0.5) end)
  end

  defn counter(x) do
    {_i, acc} =
      while {i = 0, acc = x}, i < 1000 do
        {i + 1, acc + 1}
      end

    acc
  end

  # Loops of small arrays, which the worker runs on the host
  # (port/src/program/host.rs): f64 and s64 state, integers that wrap.
  defn small_mixed(x, k, n) do
    while {i = 0, x, k, j = 1, n}, i < n do
      {i + 1, x * 1.0001 + Nx.as_type(k, :f64) / 1.0e19, k * 3 + 1, j * 7 - 3, n}
    end
  end

  # Select, min, max, abs and negate on whatever the state holds (NaN, infinities, -0).
  defn small_select(x, n) do
    while {i = 0, x, n}, i < n do
      y = Nx.select(x > 0, -x, Nx.abs(x))
      {i + 1, Nx.max(Nx.min(y * 2.0, x), -1.0e30) + 0.5, n}
    end
  end

  # A condition of two comparisons; a scalar broadcast over the state.
  defn small_tolerance(x, tol) do
    while {i = 0, err = 1.0, x, tol}, i < 1000 and err > tol do
      {i + 1, err * 0.5, x + err, tol}
    end
  end

  # Sums and products of NaNs (of different bits, where MLX's layout picks
  # the NaN kept: the host path leaves those to MLX).
  defn small_nans(x, y, n) do
    while {i = 0, x, y, n}, i < n do
      {i + 1, x + y, y * x - x, n}
    end
  end

  # u8 arithmetic and bit ops, wrapping.
  defn small_bits(a) do
    while {i = 0, a}, i < 300 do
      {i + 1, Nx.bitwise_xor(a * 3, a + 1)}
    end
  end

  defn divide_loop(x, d) do
    {_i, x, _d} =
      while {i = 0, x, d}, i < 3 do
        {i + 1, Nx.quotient(x, d), d}
      end

    x
  end
end

defmodule Moat.CompilerCorpus.Wrapped do
  @moduledoc false
  @derive {Nx.Container, containers: [:a, :b]}
  defstruct [:a, :b]
end

defmodule Moat.CompilerCorpus.Lazy do
  @moduledoc false
  # A lazy container whose `b` must not be read unless the graph uses it
  # (here, in test/support, as protocols are consolidated).
  defstruct [:a, :b]

  defimpl Nx.LazyContainer do
    def traverse(%{a: a, b: b}, acc, fun) do
      {a, acc} = fun.(Nx.to_template(a), fn -> a end, acc)
      {b, acc} = fun.(Nx.to_template(b), fn -> raise "b was read" end, acc)
      {%Moat.CompilerCorpus.Wrapped{a: a, b: b}, acc}
    end
  end
end

# Timing and table helpers shared by the bench/ scripts.

defmodule Bench do
  def time_us(fun) do
    t0 = System.monotonic_time(:nanosecond)
    fun.()
    (System.monotonic_time(:nanosecond) - t0) / 1000
  end

  def samples(n, fun), do: for(_ <- 1..n, do: time_us(fun))

  def median(xs), do: percentile(xs, 50)

  def percentile(xs, p) do
    sorted = Enum.sort(xs)
    Enum.at(sorted, round(p / 100 * (length(sorted) - 1)))
  end

  def fmt(x) when x >= 100, do: :erlang.float_to_binary(x / 1, decimals: 0)
  def fmt(x) when x >= 10, do: :erlang.float_to_binary(x / 1, decimals: 1)
  def fmt(x), do: :erlang.float_to_binary(x / 1, decimals: 2)

  def row(cells), do: IO.puts("| " <> Enum.join(cells, " | ") <> " |")

  def f32(n, value), do: :binary.copy(<<value::float-32-native>>, n)

  def moat(binary, shape, worker \\ Moat.Worker) do
    Nx.from_binary(binary, :f32, backend: {Moat.Backend, worker: worker}) |> Nx.reshape(shape)
  end

  def ratio(a, b), do: "#{fmt(a / b)}×"
end

# The compiler issue's 2-layer MLP (32×784→256→10, relu, softmax), for
# bench/compiler.exs, bench/fuse_default.exs and bench/gpu.exs.
defmodule Bench.Transfers do
  @moduledoc false
  import Bench

  @bytes 64 * 1024 * 1024

  # The 64 MiB rows (docs/latency.md), rep by rep over `workers` (`{label,
  # worker}`): a plain `:binary.copy` in the VM, a tensor's first readback
  # (made and evaluated outside the timing), a repeated one, a repeated one
  # with every byte read (copied), an upload. Returns GB/s by case
  # (`:vm_copy` or `{kind, worker}`).
  def measure(workers, reps) do
    bytes = @bytes
    data = :binary.copy(<<1, 2, 3, 4, 5, 6, 7, 8>>, div(bytes, 8))
    held = for {_, w} <- workers, into: %{}, do: {w, Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)}
    Enum.each(held, fn {_, ref} -> :ok = Moat.eval(ref) end)

    first_readback = fn w ->
      fresh = Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)
      :ok = Moat.eval(fresh)
      us = time_us(fn -> ^bytes = byte_size(Moat.to_binary(fresh)) end)
      Moat.deallocate(fresh)
      us
    end

    measure = fn
      {:first_readback, w} -> first_readback.(w)
      {:readback, w} -> time_us(fn -> ^bytes = byte_size(Moat.to_binary(held[w])) end)
      {:readback_copy, w} -> time_us(fn -> ^bytes = byte_size(:binary.copy(Moat.to_binary(held[w]))) end)
      :vm_copy -> time_us(fn -> ^bytes = byte_size(:binary.copy(data)) end)
      {:upload, w} -> time_us(fn -> :ok = Moat.eval(Moat.from_binary(data, {bytes}, {:u, 8}, worker: w)) end)
    end

    cases =
      [:vm_copy] ++
        for(kind <- [:first_readback, :readback, :readback_copy, :upload], {_, w} <- workers, do: {kind, w})

    times =
      for _ <- 1..reps, c <- cases, reduce: %{} do
        acc ->
          us = measure.(c)
          :erlang.garbage_collect()
          Map.update(acc, c, [us], &[us | &1])
      end

    Map.new(times, fn {c, us} -> {c, bytes / (median(us) * 1000)} end)
  end

  # The table of `measure/2`'s results, a row per worker (the one README carries).
  def table(workers, gbps) do
    vm_copy = gbps[:vm_copy]

    row([
      "",
      "first readback of a tensor",
      "readback (`Moat.to_binary`)",
      "readback + `:binary.copy`",
      "vs a plain `:binary.copy`",
      "upload (+ eval)"
    ])

    row(["---", "---:", "---:", "---:", "---:", "---:"])

    for {label, w} <- workers do
      copied = gbps[{:readback_copy, w}]
      cells = [gbps[{:first_readback, w}], gbps[{:readback, w}], copied]
      row([label | Enum.map(cells, &fmt/1)] ++ [ratio(copied, vm_copy), fmt(gbps[{:upload, w}])])
    end

    row(["`:binary.copy` of a 64 MiB binary made in the VM", "–", "–", fmt(vm_copy), "1×", "–"])
  end
end

defmodule Bench.MLP do
  import Nx.Defn

  defn mlp(x, w1, b1, w2, b2) do
    h = Nx.max(Nx.dot(x, w1) + b1, 0)
    logits = Nx.dot(h, w2) + b2
    e = Nx.exp(logits - Nx.reduce_max(logits, axes: [1], keep_axes: true))
    e / Nx.sum(e, axes: [1], keep_axes: true)
  end
end

# The transformer decoder block of the compiler issue, for bench/compiler.exs
# and bench/kernels.exs.
defmodule Bench.Decoder do
  def weight_shapes do
    %{
      g1: {512},
      b1: {512},
      wq: {512, 512},
      wk: {512, 512},
      wv: {512, 512},
      wo: {512, 512},
      g2: {512},
      b2: {512},
      w1: {512, 2048},
      c1: {2048},
      w2: {2048, 512},
      c2: {512}
    }
  end

  # The block (pre-norm, d_model 512, 8 heads, causal attention, MLP 2048
  # with a sigmoid-GELU) on a {seq, 512} input: plain Nx calls, so the same
  # function runs eagerly and jitted.
  def block(x, p) do
    {s, d} = Nx.shape(x)
    heads = 8
    dh = div(d, heads)
    split = fn t -> t |> Nx.reshape({s, heads, dh}) |> Nx.transpose(axes: [1, 0, 2]) end
    h = layer_norm(x, p.g1, p.b1)
    {q, k, v} = {split.(Nx.dot(h, p.wq)), split.(Nx.dot(h, p.wk)), split.(Nx.dot(h, p.wv))}
    scores = Nx.dot(q, [2], [0], k, [2], [0]) |> Nx.multiply(1 / :math.sqrt(dh))
    causal = Nx.greater_equal(Nx.iota({s, s}, axis: 0), Nx.iota({s, s}, axis: 1))
    scores = Nx.select(Nx.broadcast(causal, {heads, s, s}), scores, -1.0e9)
    e = Nx.exp(Nx.subtract(scores, Nx.reduce_max(scores, axes: [2], keep_axes: true)))
    probs = Nx.divide(e, Nx.sum(e, axes: [2], keep_axes: true))
    attn = Nx.dot(probs, [2], [0], v, [1], [0]) |> Nx.transpose(axes: [1, 0, 2]) |> Nx.reshape({s, d})
    x = Nx.add(x, Nx.dot(attn, p.wo))
    h = layer_norm(x, p.g2, p.b2)
    up = Nx.add(Nx.dot(h, p.w1), p.c1)
    gelu = Nx.multiply(up, Nx.sigmoid(Nx.multiply(up, 1.702)))
    Nx.add(x, Nx.add(Nx.dot(gelu, p.w2), p.c2))
  end

  defp layer_norm(x, g, b) do
    mean = Nx.mean(x, axes: [1], keep_axes: true)
    centered = Nx.subtract(x, mean)
    var = Nx.mean(Nx.multiply(centered, centered), axes: [1], keep_axes: true)
    Nx.add(Nx.multiply(Nx.multiply(centered, Nx.rsqrt(Nx.add(var, 1.0e-5))), g), b)
  end
end

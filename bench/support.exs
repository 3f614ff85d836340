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

  # CPU time of all the threads of OS process `pid` (ns, /proc/PID/task/*/schedstat).
  def cpu_ns(pid) do
    case File.ls("/proc/#{pid}/task") do
      {:ok, tids} ->
        Enum.reduce(tids, 0, fn tid, acc ->
          case File.read("/proc/#{pid}/task/#{tid}/schedstat") do
            {:ok, line} -> acc + (line |> String.split() |> hd() |> String.to_integer())
            {:error, _} -> acc
          end
        end)

      {:error, _} ->
        0
    end
  end
end

# The compiler issue's 2-layer MLP (32×784→256→10, relu, softmax), for
# bench/compiler.exs, bench/fuse_default.exs and bench/gpu.exs.
defmodule Bench.Transfers do
  @moduledoc false
  import Bench

  @bytes 64 * 1024 * 1024

  # The 64 MiB rows (docs/latency.md), one pass per worker of `workers`
  # (`{label, worker}`), rep by rep within it: a plain `:binary.copy` in the
  # VM, a tensor's first readback (made and evaluated outside the timing: an
  # uploaded tensor, whose bytes the worker holds in the upload's memory
  # file, and a computed one, in MLX's own buffer, alone and with every byte
  # then read: a `:binary.copy`), a repeated one, a repeated one with every
  # byte read, an upload. A pass per worker,
  # since what one worker leaves running (a sealed-file worker's spare files,
  # made in the background) would slow the other's rows. Returns GB/s by
  # case (`{kind, worker}`; `{:vm_copy, worker}` is the plain copy measured
  # in that worker's pass, `:vm_copy` over all of them). Every row is
  # settled (`settle/1`) right before its timing starts, after its own setup:
  # what earlier rows released (two 64 MiB tensors per first-readback row,
  # an upload's tensor, mapped and copied binaries) is freed by then, so
  # that cleanup is in no row's time (docs/latency.md, "Settled rows").
  def measure(workers, reps) do
    bytes = @bytes
    data = :binary.copy(<<1, 2, 3, 4, 5, 6, 7, 8>>, div(bytes, 8))

    first_readback = fn w ->
      fresh = Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)
      :ok = Moat.eval(fresh)
      settle(w)
      us = time_us(fn -> ^bytes = byte_size(Moat.to_binary(fresh)) end)
      Moat.deallocate(fresh)
      us
    end

    first_computed = fn w, read ->
      x = Nx.from_binary(data, :f32, backend: {Moat.Backend, worker: w})
      %Nx.Tensor{data: %Moat.Backend{ref: ref}} = y = Nx.multiply(x, 2.0)
      :ok = Moat.eval(ref)
      settle(w)
      us = time_us(fn -> ^bytes = byte_size(read.(Moat.to_binary(ref))) end)
      Nx.backend_deallocate(x)
      Nx.backend_deallocate(y)
      us
    end

    pass = fn w ->
      held = Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)
      :ok = Moat.eval(held)

      settled = fn f ->
        settle(w)
        time_us(f)
      end

      measure = fn
        :vm_copy -> settled.(fn -> ^bytes = byte_size(:binary.copy(data)) end)
        :first_readback -> first_readback.(w)
        :first_computed -> first_computed.(w, & &1)
        :first_computed_copy -> first_computed.(w, &:binary.copy/1)
        :readback -> settled.(fn -> ^bytes = byte_size(Moat.to_binary(held)) end)
        :readback_copy -> settled.(fn -> ^bytes = byte_size(:binary.copy(Moat.to_binary(held))) end)
        :upload -> settled.(fn -> :ok = Moat.eval(Moat.from_binary(data, {bytes}, {:u, 8}, worker: w)) end)
      end

      kinds = [:vm_copy, :first_readback, :first_computed, :first_computed_copy, :readback, :readback_copy, :upload]

      times =
        for _ <- 1..reps, kind <- kinds, reduce: %{} do
          acc ->
            us = measure.(kind)
            :erlang.garbage_collect()
            Map.update(acc, {kind, w}, [us], &[us | &1])
        end

      Moat.deallocate(held)
      times
    end

    times = workers |> Enum.map(fn {_, w} -> pass.(w) end) |> Enum.reduce(&Map.merge/2)
    all_copies = for({{:vm_copy, _}, us} <- times, do: us) |> Enum.concat()
    gbps = fn us -> bytes / (median(us) * 1000) end
    times |> Map.new(fn {c, us} -> {c, gbps.(us)} end) |> Map.put(:vm_copy, gbps.(all_copies))
  end

  # Lets what was released before finish, so that it lands on no timing:
  # this process's garbage collected (a mapped binary no longer referenced
  # is unmapped there, and the finalizer tokens of dropped tensors fire),
  # a call to the worker after the releases are flushed (`Moat.memory_info/1`:
  # the worker has run every release by its answer, unmapping uploads and
  # handing exported buffers to its reaper thread), then a wait until the
  # worker's threads (the reaper's `munmap` and `close` included) used no
  # CPU for 5 ms in a row (at most 1 s).
  def settle(worker) do
    :erlang.garbage_collect()
    _ = Moat.memory_info(worker)
    pid = Moat.Worker.info(worker).os_pid
    await_idle(pid, Bench.cpu_ns(pid), now_ms(), now_ms())
  end

  @quiet_ms 5
  @settle_max_ms 1000

  defp await_idle(pid, cpu, quiet_since, started) do
    Process.sleep(1)
    now = now_ms()
    cpu_now = Bench.cpu_ns(pid)

    cond do
      now - started > @settle_max_ms -> :timeout
      cpu_now > cpu + 50_000 -> await_idle(pid, cpu_now, now, started)
      now - quiet_since >= @quiet_ms -> :ok
      true -> await_idle(pid, cpu, quiet_since, started)
    end
  end

  defp now_ms, do: System.monotonic_time(:millisecond)

  # The table of `measure/2`'s results, a row per worker (the one README carries).
  def table(workers, gbps) do
    vm_copy = gbps[:vm_copy]

    row([
      "",
      "first readback: uploaded",
      "first readback: computed",
      "first readback + `:binary.copy`",
      "readback again (`Moat.to_binary`)",
      "readback + `:binary.copy`",
      "vs a plain `:binary.copy`",
      "upload (+ eval)"
    ])

    row(["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"])

    for {label, w} <- workers do
      copied = gbps[{:readback_copy, w}]
      firsts = [gbps[{:first_readback, w}], gbps[{:first_computed, w}], gbps[{:first_computed_copy, w}]]
      cells = firsts ++ [gbps[{:readback, w}], copied]
      row([label | Enum.map(cells, &fmt/1)] ++ [ratio(copied, gbps[{:vm_copy, w}]), fmt(gbps[{:upload, w}])])
    end

    row(["`:binary.copy` of a 64 MiB binary made in the VM", "–", "–", "–", "–", fmt(vm_copy), "1×", "–"])
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

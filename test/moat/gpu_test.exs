defmodule Moat.GpuTest do
  # The GPU worker (MLX's CUDA build, MOAT_MLX=cuda13): what it announces,
  # that its results equal a CPU worker's, that f64 is refused, that the
  # guards hold, and that a real device fault is contained. Tagged :gpu:
  # test_helper.exs runs these only where the default worker announces a GPU
  # (bin/gpu on the lent H200); elsewhere they are skipped with a message.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Error, Reliability}

  @moduletag :gpu
  @moduletag :capture_log
  @moduletag timeout: 300_000

  setup_all do
    cpu = :"gpu_test_cpu_#{System.unique_integer([:positive])}"
    start_worker(cpu, device: :cpu)
    %{cpu: cpu}
  end

  test "the worker announces the GPU it runs on" do
    info = Moat.Worker.info()
    assert info.device == :gpu
    assert hd(info.devices) == :gpu and :cpu in info.devices
    [gpu | _] = for %{kind: :gpu} = d <- info.device_info, do: d
    assert gpu.name =~ ~r/\S/
    assert gpu.memory > 1024 ** 3
    assert {major, minor} = gpu.compute_capability
    assert major >= 7 and minor >= 0
    IO.puts("\nGPU: #{gpu.name}, #{div(gpu.memory, 1024 ** 2)} MiB, compute capability #{major}.#{minor}")
  end

  test "a worker pinned to GPU 0 runs on it" do
    name = start_worker(:"gpu_pinned_#{System.unique_integer([:positive])}", gpu: 0)
    assert Moat.Worker.info(name).device == :gpu
    t = Nx.iota({4}, type: :f32, backend: {Moat.Backend, worker: name})
    assert Nx.to_flat_list(Nx.multiply(t, 2)) == [0.0, 2.0, 4.0, 6.0]
  end

  test "asking a CPU-only worker for the GPU names what it has", %{cpu: cpu} do
    assert_raise ArgumentError, ~r/runs its ops on :cpu, not :gpu/, fn ->
      Nx.tensor([1.0], backend: {Moat.Backend, worker: cpu, device: :gpu})
    end
  end

  test "results on the GPU equal the CPU worker's", %{cpu: cpu} do
    key = Nx.Random.key(42)
    {a, key} = Nx.Random.normal(key, shape: {64, 96}, type: :f32)
    {b, key} = Nx.Random.normal(key, shape: {96, 32}, type: :f32)
    {i, _key} = Nx.Random.randint(key, -1000, 1000, shape: {256}, type: :s32)

    cases = [
      {"add/exp/sum", fn a, _b, _i -> a |> Nx.add(1.5) |> Nx.exp() |> Nx.sum(axes: [1]) end, 1.0e-5},
      {"dot f32", fn a, b, _i -> Nx.dot(a, b) end, 1.0e-5},
      {"dot bf16", fn a, b, _i -> Nx.dot(Nx.as_type(a, :bf16), Nx.as_type(b, :bf16)) |> Nx.as_type(:f32) end, 2.0e-2},
      {"softmax", fn a, _b, _i -> Nx.exp(a) |> Nx.divide(Nx.sum(Nx.exp(a), axes: [1], keep_axes: true)) end, 1.0e-5},
      {"sort/argmax",
       fn a, _b, _i ->
         Nx.concatenate([Nx.sort(a, axis: 1), Nx.as_type(Nx.argmax(a, axis: 1, keep_axis: true), :f32)], axis: 1)
       end, 0.0},
      {"integers", fn _a, _b, i -> i |> Nx.multiply(3) |> Nx.remainder(7) |> Nx.add(Nx.quotient(i, 5)) end, 0.0},
      {"take", fn a, _b, _i -> Nx.take(a, Nx.tensor([3, 0, 63, 5]), axis: 0) end, 0.0},
      {"cumulative", fn a, _b, _i -> Nx.cumulative_sum(a, axis: 1) end, 1.0e-4}
    ]

    for {label, fun, tol} <- cases do
      on = fn worker ->
        copy = &Nx.backend_copy(&1, {Moat.Backend, worker: worker})
        fun.(copy.(a), copy.(b), copy.(i)) |> Nx.backend_transfer(Nx.BinaryBackend)
      end

      gpu = on.(Moat.Worker)
      cpu_result = on.(cpu)
      assert gpu.type == cpu_result.type, label

      if tol == 0.0 do
        assert gpu == cpu_result, label
      else
        diff = Nx.subtract(gpu, cpu_result) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
        scale = cpu_result |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
        assert diff <= tol * max(scale, 1.0), "#{label}: max |gpu - cpu| = #{diff} (scale #{scale})"
      end
    end
  end

  test "f32 matmul: full f32 by default and with tf32: false, TF32 with tf32: true" do
    # One nonzero term per output: 1 + 2^-20 survives f32 (23-bit mantissa)
    # but not TF32 (10 bits), whatever the order of accumulation.
    product = fn worker ->
      backend = {Moat.Backend, worker: worker}
      x = Nx.broadcast(Nx.tensor(1.0 + :math.pow(2, -20), type: :f32, backend: backend), {256, 256})
      y = Nx.equal(Nx.iota({256, 256}, axis: 0, backend: backend), 0) |> Nx.as_type(:f32)
      Nx.dot(x, y) |> Nx.slice([0, 0], [1, 1]) |> Nx.to_flat_list() |> hd()
    end

    exact = start_worker(:"gpu_f32_#{System.unique_integer([:positive])}", tf32: false)
    tf32 = start_worker(:"gpu_tf32_#{System.unique_integer([:positive])}", tf32: true)
    assert product.(exact) == 1.0 + :math.pow(2, -20)
    assert product.(tf32) == 1.0
    # Moat's default is full f32.
    assert product.(Moat.Worker) == 1.0 + :math.pow(2, -20)
  end

  test "f64 on the GPU is an ArgumentError, never a silent downcast" do
    assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> Nx.tensor([1.0], type: :f64, backend: Moat.Backend) end
    t = Nx.tensor([1.0, 2.0], backend: Moat.Backend)
    assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> Nx.as_type(t, :f64) end
    assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> Nx.iota({3}, type: :f64, backend: Moat.Backend) end
    assert Nx.to_flat_list(Nx.add(t, 1)) == [2.0, 3.0]
  end

  test "f64 in a compiled program is the same ArgumentError, raised while it is lowered" do
    t = Nx.tensor([1.0, 2.0], backend: Moat.Backend)
    jit = &Nx.Defn.jit(&1, compiler: Moat.Compiler)
    assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> jit.(&Nx.as_type(&1, :f64)).(t) end
    assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> jit.(&Nx.add(&1, Nx.iota({2}, type: :f64))).(t) end
    assert_raise ArgumentError, ~r/\{:f, 64\} on the GPU/, fn -> jit.(&Nx.add(&1, 1)).(Nx.tensor([1.0], type: :f64)) end
  end

  test "ops MLX's CUDA backend refuses to build run in programs as eagerly (built on the CPU)", %{cpu: cpu} do
    a = Nx.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])

    funs = [fn x -> x |> Nx.LinAlg.qr() |> elem(1) end, fn x -> Nx.window_max(x, {2, 2}) end]

    for fun <- funs do
      on = fn worker -> Nx.backend_copy(a, {Moat.Backend, worker: worker}) end
      compiled = Nx.Defn.jit(fun, compiler: Moat.Compiler).(on.(Moat.Worker)) |> Nx.backend_transfer()
      eager = fun.(on.(Moat.Worker)) |> Nx.backend_transfer()
      assert compiled == eager
      assert Nx.to_number(Nx.all_close(compiled, fun.(on.(cpu)) |> Nx.backend_transfer(), rtol: 1.0e-5)) == 1
    end
  end

  test "the guards hold on the GPU: indices, divisors, the memory limit" do
    t = Nx.iota({4}, type: :f32, backend: Moat.Backend)
    e = assert_raise Error, fn -> Nx.take(t, Nx.tensor([0, 9], backend: Moat.Backend)) |> Nx.to_binary() end
    assert e.message =~ ~r/out of range|index/i
    z = Nx.tensor([1, 0], backend: Moat.Backend)
    e = assert_raise Error, fn -> Nx.quotient(Nx.tensor([4, 4], backend: Moat.Backend), z) |> Nx.to_binary() end
    assert e.message =~ ~r/zero/i

    %{limit: limit} = Moat.memory_info()
    [gpu | _] = for %{kind: :gpu} = d <- Moat.Worker.info().device_info, do: d
    IO.puts("\nmemory limit #{div(limit, 1024 ** 2)} MiB of #{div(gpu.memory, 1024 ** 2)} MiB on the GPU")
    assert limit <= gpu.memory
    # More than the card holds: refused by the limit, the worker carries on.
    rows = div(gpu.memory, 4 * 65_536) + 1
    one = Nx.tensor(1.0, backend: Moat.Backend)
    e = assert_raise Error, fn -> Nx.broadcast(one, {rows, 65_536}) |> Nx.add(1) |> Nx.to_binary() end

    assert e.message =~ ~r/memory limit/
    assert Nx.to_flat_list(Nx.add(t, 1)) == [1.0, 2.0, 3.0, 4.0]
  end

  test "large transfers round-trip through the GPU worker" do
    n = 32 * 1024 * 1024
    data = :crypto.strong_rand_bytes(4 * n)
    t = Nx.from_binary(data, :u32, backend: Moat.Backend)
    assert Nx.to_binary(t) == data
    assert t |> Nx.add(0) |> Nx.to_binary() == data
    IO.puts("\ntransfer path: #{if Moat.Worker.info().shared_memory, do: "shared memory offered", else: "pipe"}")
  end

  test "a long GPU computation is not a hang for the watchdog" do
    name = start_worker(:"gpu_long_#{System.unique_integer([:positive])}", watchdog: 500)
    %{generation: g} = Moat.Worker.info(name)
    backend = {Moat.Backend, worker: name}
    a = Nx.iota({8192, 8192}, type: :s32, backend: backend) |> Nx.remainder(7) |> Nx.as_type(:f32)
    eye = Nx.eye(8192, type: :f32, backend: backend)
    # About 150 full-f32 8192³ products in a chain: seconds of GPU work in one evaluation.
    chain = Enum.reduce(1..150, a, fn _, acc -> Nx.dot(acc, eye) end)
    {us, sum} = :timer.tc(fn -> chain |> Nx.sum() |> Nx.to_number() end)
    IO.puts("\nlong GPU computation: #{div(us, 1000)} ms under a 500 ms watchdog")
    assert sum == a |> Nx.sum() |> Nx.to_number()
    assert us > 1_000_000
    assert Moat.Worker.info(name).generation == g
  end

  describe "crash containment" do
    setup do
      name = :"gpu_fault_#{System.unique_integer([:positive])}"
      test = self()

      :telemetry.attach_many(
        {name, :lifecycle},
        [[:moat, :worker, :up], [:moat, :worker, :down]],
        fn [:moat, :worker, ev], _m, %{worker: ^name} = meta, _ ->
          send(test, {:lifecycle, ev, meta, System.monotonic_time(:microsecond)})
        end,
        nil
      )

      on_exit(fn -> :telemetry.detach({name, :lifecycle}) end)
      child = {Moat.Worker, name: name, worker_path: Reliability.fault_worker_path()}

      start_supervised!(%{
        id: name,
        type: :supervisor,
        start: {Supervisor, :start_link, [[child], [strategy: :one_for_one, max_restarts: 100, max_seconds: 1]]}
      })

      assert_receive {:lifecycle, :up, %{generation: 1}, _}, 10_000
      %{worker: name}
    end

    test "a real CUDA fault ends only the worker; callers get Moat.Errors; the next one computes on the GPU",
         %{worker: worker} do
      times =
        for _round <- 1..3 do
          %{generation: g} = Moat.Worker.info(worker)
          test = self()

          callers =
            for _ <- 1..8 do
              spawn(fn ->
                Nx.default_backend({Moat.Backend, worker: worker})
                results = for _ <- 1..200, do: busy()
                send(test, {:done, self(), results})
              end)
            end

          Process.sleep(50)
          Reliability.inject(worker, :device_write)
          assert_receive {:lifecycle, :down, %{generation: ^g, reason: reason}, down_at}, 20_000
          assert reason =~ ~r/status 75|SIGABRT|SIGSEGV/
          assert_receive {:lifecycle, :up, %{generation: g2}, up_at}, 20_000
          assert g2 == g + 1

          for pid <- callers do
            assert_receive {:done, ^pid, results}, 60_000
            for r <- results, do: assert(r == :ok or match?({:error, %Error{}}, r), inspect(r))
          end

          # The next generation computes on the GPU, including its first kernel.
          backend = {Moat.Backend, worker: worker}
          t = Nx.iota({32, 32}, type: :f32, backend: backend)
          assert Moat.Worker.info(worker).device == :gpu
          assert t |> Nx.dot(Nx.eye(32, backend: backend)) |> Nx.sum() |> Nx.to_number() == 523_776.0

          ready_at = System.monotonic_time(:microsecond)
          {div(up_at - down_at, 1000), div(ready_at - down_at, 1000), reason}
        end

      for {up, ready, reason} <- times do
        IO.puts("\nGPU fault (#{reason}): next generation up #{up} ms, first GPU result #{ready} ms after the death")
      end

      # The first round may compile kernels the next generation has not run
      # before (MLX keeps them on disk for later processes).
      assert Enum.all?(tl(times), fn {_up, ready, _} -> ready <= 2_000 end), inspect(times)
    end
  end

  defp busy do
    a = Nx.iota({256, 256}, type: :f32) |> Nx.divide(65_536)
    Nx.dot(a, a) |> Nx.sum() |> Nx.to_number()
    :ok
  rescue
    e in Error -> {:error, e}
  end
end

defmodule Moat.CompilerWorkerTest do
  # Moat.Compiler on a private worker: guards inside programs, restarts,
  # and the bound on programs held.
  use ExUnit.Case, async: false
  @moduletag :capture_log
  import Moat.Case

  alias Moat.Error

  @worker :compiler_worker

  setup do
    start_worker(@worker)
    %{pid: os_pid(@worker)}
  end

  defp moat(t), do: Nx.backend_transfer(t, {Moat.Backend, worker: @worker})
  defp jit(fun, opts \\ []), do: Nx.Defn.jit(fun, [compiler: Moat.Compiler, worker: @worker] ++ opts)

  test "an out-of-range gather inside a program fails as in eager mode; the worker lives", %{pid: pid} do
    fun = jit(fn t, i -> t |> Nx.take(i) |> Nx.multiply(2) end)
    t = moat(Nx.iota({3, 4}))

    for index <- [3, 1_000_000_000, -1] do
      error = assert_raise Error, fn -> fun.(t, moat(Nx.tensor([0, index]))) |> Nx.to_binary() end
      assert {error.reason, error.op} == {:op_failed, :take}
      assert error.message =~ "index #{index} is out of bounds for axis 0"
    end

    assert os_pid(@worker) == pid
    assert Nx.to_flat_list(fun.(t, moat(Nx.tensor([2])))) == [16, 18, 20, 22]
  end

  test "an integer division by zero inside a while loop names the op", %{pid: pid} do
    fun = jit(&Moat.CompilerCorpus.divide_loop/2)

    error = assert_raise Error, fn -> fun.(moat(Nx.tensor([8, 4])), moat(Nx.tensor([2, 0]))) |> Nx.to_binary() end
    assert error.op == :quotient
    assert os_pid(@worker) == pid
    assert Nx.to_flat_list(fun.(moat(Nx.tensor([8, 4])), moat(Nx.tensor([2, 1])))) == [1, 4]
  end

  test "a held compile/3 closure survives a worker restart", %{pid: pid} do
    fun = Nx.Defn.compile(&Nx.multiply(&1, &1), [Nx.template({2}, :f32)], compiler: Moat.Compiler, worker: @worker)
    assert Nx.to_flat_list(fun.(Nx.tensor([3.0, 4.0]))) == [9.0, 16.0]
    jitted = jit(&Nx.add(&1, 1))
    assert Nx.to_flat_list(jitted.(Nx.tensor([1.0]))) == [2.0]

    generation = Moat.Worker.info(@worker).generation
    kill(pid)
    await_generation_after(@worker, generation)

    assert Nx.to_flat_list(fun.(Nx.tensor([3.0, 4.0]))) == [9.0, 16.0]
    assert Nx.to_flat_list(fun.(moat(Nx.tensor([5.0, 6.0])))) == [25.0, 36.0]
    assert Nx.to_flat_list(jitted.(Nx.tensor([1.0]))) == [2.0]
    assert Moat.compiler_info(@worker).programs == 2
  end

  test "the least recently used programs are released past max_programs" do
    previous = Application.get_env(:moat, :max_programs)
    Application.put_env(:moat, :max_programs, 2)

    on_exit(fn ->
      if previous,
        do: Application.put_env(:moat, :max_programs, previous),
        else: Application.delete_env(:moat, :max_programs)
    end)

    funs =
      for k <- 1..4,
          do: Nx.Defn.compile(&Nx.add(&1, k), [Nx.template({}, :f32)], compiler: Moat.Compiler, worker: @worker)

    assert Moat.compiler_info(@worker).programs <= 2
    # An evicted program is defined again on its next call.
    for {fun, k} <- Enum.with_index(funs, 1), do: assert(Nx.to_number(fun.(Nx.tensor(1.0))) == 1.0 + k)
    assert Moat.compiler_info(@worker).programs <= 2
  end

  describe "the kernel cache" do
    @describetag :cpu_only
    @describetag timeout: 120_000

    defp worker_tmpdir(name) do
      "/proc/#{os_pid(name)}/environ"
      |> File.read!()
      |> String.split(<<0>>)
      |> Enum.find_value(fn
        "TMPDIR=" <> dir -> dir
        _ -> nil
      end)
    end

    test "is under the user's cache by default, where the worker's MLX builds its kernels" do
      assert worker_tmpdir(@worker) == to_string(:filename.basedir(:user_cache, ~c"moat-kernels"))
    end

    test "is the folder :kernel_cache names; fused kernels are built there" do
      dir = Path.join(System.tmp_dir!(), "moat-kernel-cache-#{System.unique_integer([:positive])}")
      on_exit(fn -> File.rm_rf!(dir) end)
      start_worker(:kernel_cache_worker, kernel_cache: dir)
      assert worker_tmpdir(:kernel_cache_worker) == dir

      fun =
        Nx.Defn.jit(&(&1 |> Nx.multiply(3) |> Nx.subtract(1) |> Nx.exp()),
          compiler: Moat.Compiler,
          worker: :kernel_cache_worker,
          fuse: true
        )

      x = Nx.backend_transfer(Nx.tensor([0.0, 1.0]), {Moat.Backend, worker: :kernel_cache_worker})
      assert Nx.to_flat_list(fun.(x)) |> Enum.map(&Float.round(&1, 4)) == [0.3679, 7.3891]
      assert Path.wildcard(Path.join(dir, "**/*.so")) != []
    end
  end
end

# Nx on Moat, then a crash: the worker's OS process is SIGKILLed while
# callers wait on it; they get clear errors and the worker comes back.
# Run with bin/demo (or: mix run examples/demo.exs).

Nx.global_default_backend(Moat.Backend)
info = Moat.Worker.info()

IO.puts("""
Moat worker: OS pid #{info.os_pid}, generation #{info.generation}, \
MLX #{info.mlx}, BLAS #{info.blas}, devices #{inspect(info.devices)}
""")

a = Nx.tensor([[1.0, 2.0], [3.0, 4.0]])
IO.puts("a . a + 1 =")
IO.inspect(a |> Nx.dot(a) |> Nx.add(1))

big = Nx.broadcast(Nx.tensor(0.001, type: :f32), {1024, 1024})
slow = Enum.reduce(1..400, big, fn _, acc -> Nx.dot(acc, big) end)

IO.puts("\nFive callers wait on a long chain of 1024x1024 matmuls...")

tasks =
  for i <- 1..5 do
    Task.async(fn ->
      try do
        Nx.to_binary(slow)
        {i, :finished}
      rescue
        e in Moat.Error -> {i, e}
      end
    end)
  end

Process.sleep(300)
IO.puts("...and the worker (OS pid #{info.os_pid}) gets SIGKILL mid-flight.\n")
System.cmd("kill", ["-9", "#{info.os_pid}"])

for {i, result} <- Task.await_many(tasks, 5_000) do
  IO.puts("  caller #{i}: " <> if(is_atom(result), do: "#{result}", else: Exception.message(result)))
end

back =
  Enum.find_value(1..200, fn _ ->
    Process.sleep(10)

    try do
      new = Moat.Worker.info()
      if new.generation > info.generation, do: new
    rescue
      Moat.Error -> nil
    end
  end)

IO.puts("""

The BEAM is still here (#{System.pid()}); the supervisor restarted the worker:
OS pid #{back.os_pid}, generation #{back.generation}. It serves the next call:
""")

IO.inspect(Nx.tensor([1.0, 2.0, 3.0]) |> Nx.multiply(2) |> Nx.sum())

IO.puts("\nA tensor from before the crash is stale, not silently wrong:")

try do
  Nx.to_binary(a)
rescue
  e in Moat.Error -> IO.puts("  ** (Moat.Error) " <> Exception.message(e))
end

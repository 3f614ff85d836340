# A hook inside a while loop: Moat.Compiler (the worker sends each
# iteration's value while the loop runs) against Nx.Defn.Evaluator on Moat
# (a round trip per iteration for the condition). Medians of call (the
# hook functions run inside it) + readback, ms.
# Run: mix run -r bench/support.exs bench/compiler_hooks.exs

defmodule Bench.HookModels do
  import Nx.Defn

  defn hooked(x, n) do
    {_i, acc, _n} =
      while {i = 0, acc = x, n}, i < n do
        {i + 1, hook(acc * 0.5 + 1, :step), n}
      end

    acc
  end

  defn plain(x, n) do
    {_i, acc, _n} =
      while {i = 0, acc = x, n}, i < n do
        {i + 1, acc * 0.5 + 1, n}
      end

    acc
  end
end

alias Bench.HookModels, as: M

x = Nx.tensor([1.0, 2.0, 3.0, 4.0], backend: Moat.Backend)
counter = :counters.new(1, [])
hooks = %{step: fn _ -> :counters.add(counter, 1, 1) end}
read = &Nx.to_binary/1
med = fn n, fun -> Bench.median(Bench.samples(n, fun)) / 1000 end

IO.puts("### A hook inside a while loop (ms, medians)\n")

Bench.row([
  "iterations",
  "jit, no hook",
  "jit, hook",
  "evaluator, hook",
  "hook cost per iteration (µs)",
  "jit vs evaluator"
])

Bench.row(["---:", "---:", "---:", "---:", "---:", "---:"])

for n <- [100, 1000] do
  count = Nx.tensor(n, backend: Moat.Backend)
  jit_plain = Nx.Defn.jit(&M.plain/2, compiler: Moat.Compiler)
  jit_hooked = Nx.Defn.jit(&M.hooked/2, compiler: Moat.Compiler, hooks: hooks)
  eval_hooked = Nx.Defn.jit(&M.hooked/2, compiler: Nx.Defn.Evaluator, hooks: hooks)
  Enum.each([jit_plain, jit_hooked, eval_hooked], &read.(&1.(x, count)))
  plain = med.(10, fn -> read.(jit_plain.(x, count)) end)
  hooked = med.(10, fn -> read.(jit_hooked.(x, count)) end)
  evaluated = med.(5, fn -> read.(eval_hooked.(x, count)) end)

  Bench.row([
    "#{n}",
    Bench.fmt(plain),
    Bench.fmt(hooked),
    Bench.fmt(evaluated),
    Bench.fmt((hooked - plain) * 1000 / n),
    Bench.ratio(evaluated, hooked)
  ])
end

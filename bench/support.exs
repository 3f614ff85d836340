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

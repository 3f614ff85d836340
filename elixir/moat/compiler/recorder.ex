defmodule Moat.Compiler.Recorder do
  @moduledoc false
  # The program a lowering builds, in the process dictionary of the process
  # that lowers: `Moat.Backend`'s callbacks, called on tensors bound to
  # slots, append their op here instead of sending it (see Moat.Compiler).
  #
  # The state: `next` (the next free slot), `scopes` (innermost first, each
  # `%{steps: reversed, memo: %{expr id => result}, ids: scope ids}`),
  # `params` (the current frame's parameters), `inputs` (`{position, slot}`
  # of the function's parameters used), `captures` (tensors the graph holds,
  # each an extra input of the program).

  alias Nx.Tensor, as: T

  defmodule Slot do
    @moduledoc false
    # A tensor's place in a program being recorded.
    defstruct [:n]
  end

  @type slot :: %Slot{n: non_neg_integer()}

  @key :moat_compiler_recording

  def active?, do: Process.get(@key) != nil

  def start do
    Process.put(@key, %{next: 0, scopes: [], params: %{}, top: true, inputs: [], captures: %{}, capture_list: []})
    :ok
  end

  def stop, do: Process.delete(@key)

  @doc "The device the program is lowered for (its ops are checked against it, as eager ones)."
  def device, do: Map.get(get(), :device, :cpu)

  def get, do: Process.get(@key)
  def put(state), do: Process.put(@key, state)
  def update(fun), do: put(fun.(get()))

  @doc "Raises out of the lowering: `op` cannot run in a program."
  def unsupported!(op), do: throw({:moat_unsupported, op})

  @doc "`n` fresh slots."
  def alloc(n) do
    state = get()
    put(%{state | next: state.next + n})
    Enum.map(state.next..(state.next + n - 1)//1, &%Slot{n: &1})
  end

  @doc "Appends a step to the current scope."
  def push(step) do
    update(fn %{scopes: [scope | rest]} = state ->
      %{state | scopes: [%{scope | steps: [step | scope.steps]} | rest]}
    end)
  end

  @doc "Records one op; returns the slots of its `n` outputs."
  def record(name, inputs, attrs, n) do
    ins = Enum.map(inputs, &slot/1)
    outs = alloc(n)
    push({name, ins, numbers(outs), attrs})
    outs
  end

  def numbers(slots), do: Enum.map(slots, fn %Slot{n: n} -> n end)

  @doc "The slot of a tensor: its own, or a new input for a captured tensor."
  def slot(%T{data: %{ref: %Slot{n: n}}}), do: n
  def slot(%T{} = tensor), do: capture(tensor)

  defp capture(tensor) do
    key = capture_key(tensor)

    case get().captures do
      %{^key => n} ->
        n

      %{} ->
        [%Slot{n: n}] = alloc(1)
        update(&%{&1 | captures: Map.put(&1.captures, key, n), capture_list: [{n, tensor} | &1.capture_list]})
        n
    end
  end

  # Moat tensors by their handle; others (literals on other backends) by value.
  defp capture_key(%T{data: %{__struct__: Moat.Backend, ref: ref}}), do: {:ref, ref}
  defp capture_key(tensor), do: {:value, tensor}
end

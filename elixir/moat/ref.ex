defmodule Moat.Ref do
  @moduledoc """
  A handle to a tensor that lives in a worker: the worker's name, its
  generation (incarnation) and the tensor's id there.

  A handle from before a worker restart is stale: its data died with the old
  process, and using it raises `Moat.Error` with reason `:stale_generation`.
  """

  @enforce_keys [:worker, :generation, :id]
  defstruct [:worker, :generation, :id]

  @type t :: %__MODULE__{worker: atom(), generation: pos_integer(), id: pos_integer()}
end

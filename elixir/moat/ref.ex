defmodule Moat.Ref do
  @moduledoc """
  A handle to a tensor that lives in a worker: the worker's name, its
  generation (incarnation) and the tensor's id there.

  A handle from before a worker restart is stale: its data died with the old
  process, and using it raises `Moat.Error` with reason `:stale_generation`.

  `token` frees the tensor in the worker once the VM has garbage-collected
  every copy of the handle (see `Moat`, "Memory"). Copies of a handle share
  it. Make handles with `Moat.Client.ref/2`: a handle without a token
  (`nil`) is never released automatically.
  """

  @enforce_keys [:worker, :generation, :id]
  defstruct [:worker, :generation, :id, :token]

  @type t :: %__MODULE__{worker: atom(), generation: pos_integer(), id: pos_integer(), token: reference() | nil}
end

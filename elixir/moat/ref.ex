defmodule Moat.Ref do
  @moduledoc """
  A handle to a tensor that lives in a worker: the worker's name, its
  generation, the tensor's id there, and which worker incarnation holds it.

  A tensor belongs to one worker incarnation (one start of one worker, on
  one node). `incarnation` is a random number drawn when that worker
  started, and `owner` the `Moat.Worker` process that runs it (it says
  which node holds the data). The client checks both on every use, so a
  handle never names another tensor:

    * a handle from before a worker restart is stale: its data died with
      the old process, and using it raises `Moat.Error` with reason
      `:stale_generation`;
    * a handle whose worker runs on another connected node (sent in a
      message, or through `Nx.Serving`'s distributed mode) is copied at the
      boundary: an op here fetches its bytes from that node and uploads
      them to this node's worker. Copies on other nodes do not keep the
      tensor alive: once its own node drops it, using them raises
      `:foreign_tensor`, and where that node cannot be reached,
      `:worker_unreachable`;
    * a handle read back with `:erlang.binary_to_term/1` in a later VM
      names an incarnation that no longer exists and raises
      `:foreign_tensor`.

  `token` frees the tensor in the worker once the VM has garbage-collected
  every copy of the handle (see `Moat`, "Memory"). Copies of a handle share
  it. Make handles with `Moat.Handles.ref/2`: a handle without a token
  (`nil`) is never released automatically.
  """

  @enforce_keys [:worker, :generation, :incarnation, :owner, :id]
  defstruct [:worker, :generation, :incarnation, :owner, :id, :token]

  @type t :: %__MODULE__{
          worker: atom(),
          generation: pos_integer(),
          incarnation: non_neg_integer(),
          owner: pid(),
          id: pos_integer(),
          token: reference() | nil
        }
end

defmodule Moat.Error do
  @moduledoc """
  Raised when the worker cannot do what was asked.

  `:reason` says which kind of failure it is:

    * `:op_failed` — an MLX operation failed; `:op` names the operation that
      failed first (it may be an earlier op whose result fed this one).
    * `:worker_died` — the worker process exited while the call was in flight
      (`:op` is the call; the message says how it died).
    * `:stale_generation` — the tensor belongs to a worker that has since been
      restarted; its data is gone.
    * `:foreign_tensor` — the tensor belongs to a worker incarnation whose
      data cannot be had here: one this VM never ran (a handle read back
      with `:erlang.binary_to_term/1` in a later VM, or from a VM that was
      not a distributed node), or one of another node that no longer holds
      it (handles on other nodes do not keep a tensor alive) or whose
      worker restarted. Raised before anything is sent; nothing else's data
      is ever read in its place.
    * `:worker_unreachable` — the tensor belongs to a worker of another node,
      and that node cannot be asked for it (not connected, or not running
      Moat).
    * `:deallocated` — the tensor was released with `Nx.backend_deallocate/1`
      (or `Moat.deallocate/1`); raised before anything is sent. A tensor a
      `Moat.scope/1` released is gone from the worker: using it fails with
      `:op_failed`, "unknown tensor id", at the next blocking call.
    * `:worker_unavailable` — no worker is running (it is restarting, or the
      application is stopped).
    * `:timeout` — the call did not complete in time.
  """

  @type reason ::
          :op_failed
          | :worker_died
          | :stale_generation
          | :foreign_tensor
          | :worker_unreachable
          | :deallocated
          | :worker_unavailable
          | :timeout

  defexception [:reason, :op, :message]

  @type t :: %__MODULE__{reason: reason(), op: atom() | nil, message: String.t()}

  @doc false
  @spec new(reason(), atom() | nil, String.t()) :: t()
  def new(reason, op, detail) do
    prefix = if op, do: "#{op}: ", else: ""
    %__MODULE__{reason: reason, op: op, message: prefix <> detail}
  end
end

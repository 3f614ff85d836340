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
    * `:deallocated` — the tensor was released with `Nx.backend_deallocate/1`
      (or `Moat.deallocate/1`); raised before anything is sent. A tensor a
      `Moat.scope/1` released is gone from the worker: using it fails with
      `:op_failed`, "unknown tensor id", at the next blocking call.
    * `:worker_unavailable` — no worker is running (it is restarting, or the
      application is stopped).
    * `:timeout` — the call did not complete in time.
  """

  @type reason ::
          :op_failed | :worker_died | :stale_generation | :deallocated | :worker_unavailable | :timeout

  defexception [:reason, :op, :message]

  @type t :: %__MODULE__{reason: reason(), op: atom() | nil, message: String.t()}

  @doc false
  @spec new(reason(), atom() | nil, String.t()) :: t()
  def new(reason, op, detail) do
    prefix = if op, do: "#{op}: ", else: ""
    %__MODULE__{reason: reason, op: op, message: prefix <> detail}
  end
end

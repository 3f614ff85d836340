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

  A failure the worker reported also has its `:kind` (protocol.md §4):
  `:invalid` (the request cannot be done as asked), `:mlx` (MLX raised while
  evaluating), `:memory_limit` (`:details` holds the bytes `:need`ed, `:in_use`
  and the `:limit`), `:stale_generation`, `:protocol` (a malformed frame) or
  `:system` (the operating system refused); `nil` for failures of the client's
  own. The message is `"op: cause"`, the op named once.
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

  @type kind :: :invalid | :mlx | :memory_limit | :stale_generation | :protocol | :system | nil

  defexception [:reason, :op, :message, :kind, details: %{}]

  @type t :: %__MODULE__{
          reason: reason(),
          op: atom() | nil,
          message: String.t(),
          kind: kind(),
          details: map()
        }

  @doc false
  @spec new(reason(), atom() | nil, String.t(), kind(), map()) :: t()
  def new(reason, op, detail, kind \\ nil, details \\ %{}) do
    %__MODULE__{reason: reason, op: op, message: prefix(op) <> detail, kind: kind, details: details}
  end

  @doc false
  # The failure of an `{:error, seq, op, failure}` reply; the only place a
  # worker's failure becomes a message.
  @spec from_worker(atom(), term()) :: t()
  def from_worker(_op, %{kind: :stale_generation, message: message}) when is_binary(message),
    do: new(:stale_generation, nil, message, :stale_generation)

  def from_worker(op, %{kind: kind, message: message} = failure) when is_atom(kind) and is_binary(message),
    do: new(:op_failed, op, message <> hint(kind), kind, Map.drop(failure, [:kind, :message]))

  def from_worker(op, other),
    do: new(:op_failed, op, "the worker sent a failure this client cannot read: #{inspect(other)}", :protocol)

  @doc false
  # The same failure, named after another op (an upload's errors name
  # :from_binary, whichever frame carried its bytes).
  @spec with_op(t(), atom() | nil) :: t()
  def with_op(%__MODULE__{op: old, message: message} = e, op),
    do: %{e | op: op, message: prefix(op) <> String.replace_prefix(message, prefix(old), "")}

  defp prefix(nil), do: ""
  defp prefix(op), do: "#{op}: "

  defp hint(:memory_limit), do: " (Moat.set_memory_limit/1)"
  defp hint(_kind), do: ""

  @doc false
  # How the worker's process ended, from its exit status (the port's).
  def describe_exit(status) when status > 128, do: "killed by signal #{status - 128}#{signal_name(status - 128)}"
  def describe_exit(101), do: "exited with status 101 (a panic; the worker's log has its message)"
  def describe_exit(75), do: "exited with status 75 (a CUDA fault made its GPU context unusable)"
  def describe_exit(status), do: "exited with status #{status}"

  defp signal_name(n) do
    names = %{6 => "SIGABRT", 8 => "SIGFPE", 9 => "SIGKILL", 11 => "SIGSEGV", 15 => "SIGTERM"}
    if name = names[n], do: " (#{name})", else: ""
  end
end

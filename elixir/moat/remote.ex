defmodule Moat.Remote do
  @moduledoc """
  The connection to a worker that runs as an Erlang C-node
  (`moat_port --node NAME@HOST --cookie-file PATH`), possibly on another
  host: `{Moat.Worker, name: W, node: :"moat@gpu-host"}`.

  The worker speaks the same protocol as over a port; each frame travels as
  one distribution message (protocol.md, "Transports"). `open/3` connects to
  the node (the distribution handshake, with this VM's cookie for that node:
  `Node.set_cookie/2` sets one per node), asks it for a session of the given
  generation, and returns the pid the worker's frames come from. That pid
  then stands where a local worker has its port: frames go to it with
  `command/2`, and its replies arrive as `{pid, {:data, frame}}`, the
  messages a port sends. The worker's session ends with the connection:
  when the node goes down (`{:nodedown, node}`, which `open/3` subscribes
  to), every tensor of that session is gone, and the next connection is a
  new generation.

  This VM must be a distributed node (`Node.alive?/0`). Shared memory is
  never used with a remote worker, and `Moat.Worker`'s watchdog is off (it
  kills a hung worker by its OS pid, which only a local worker's host has).
  """

  alias Moat.Protocol

  # The pause between connection attempts, doubled up to @max_pause.
  @first_pause 50
  @max_pause 1_000

  @doc """
  Connects to the worker `node` and opens a session of `generation`,
  retrying with backoff for up to `timeout` ms: `{:ok, pid, hello_info}` or
  `{:error, why}`.
  """
  @spec open(node(), pos_integer(), timeout()) :: {:ok, pid(), map()} | {:error, term()}
  def open(node, generation, timeout) do
    cond do
      not Node.alive?() ->
        {:error,
         {:not_distributed,
          "a remote worker (node: #{inspect(node)}) needs this VM to be a distributed node (start it with --name or --sname)"}}

      not is_atom(node) or not String.contains?(Atom.to_string(node), "@") ->
        {:error, {:bad_node, "Moat.Worker: :node must be a node name such as :\"moat@host\", got #{inspect(node)}"}}

      true ->
        attempt(node, generation, System.monotonic_time(:millisecond) + timeout, @first_pause, nil)
    end
  end

  defp attempt(node, generation, deadline, pause, last) do
    left = deadline - System.monotonic_time(:millisecond)

    if left <= 0 do
      {:error, {:worker_unreachable, "cannot open a session on node #{node} (#{last || "no answer"})"}}
    else
      case try_open(node, generation, left) do
        {:ok, pid, info} ->
          {:ok, pid, info}

        {:retry, why} ->
          Process.sleep(min(pause, max(deadline - System.monotonic_time(:millisecond), 0)))
          attempt(node, generation, deadline, min(pause * 2, @max_pause), why)

        {:error, _} = error ->
          error
      end
    end
  end

  defp try_open(node, generation, left) do
    if :net_kernel.connect_node(node) do
      :erlang.monitor_node(node, true)
      send({:moat, node}, {:open, self(), generation})
      await_hello(node, left)
    else
      {:retry, "it does not answer, or refuses the connection (its cookie, or another node holds it)"}
    end
  end

  defp await_hello(node, left) do
    receive do
      {pid, {:data, frame}} when is_pid(pid) and node(pid) == node ->
        case Protocol.decode(frame) do
          {:ok, {:hello, 1, info}, _} ->
            {:ok, pid, Map.put(info, :node, node)}

          {:ok, {:hello, version, _}, _} ->
            close(pid)

            {:error,
             {:protocol_mismatch, "the worker speaks protocol version #{version}, this client #{Protocol.version()}"}}

          other ->
            close(pid)
            {:error, {:bad_handshake, other}}
        end

      {:nodedown, ^node} ->
        {:retry, "it disconnected before its hello"}
    after
      left ->
        :erlang.monitor_node(node, false)

        receive do
          {:nodedown, ^node} -> :ok
        after
          0 -> :ok
        end

        {:retry, "no hello within the time left"}
    end
  end

  @doc "Sends one frame to the worker whose session `pid` is."
  @spec command(pid(), iodata()) :: :ok
  def command(pid, frame) do
    send(pid, IO.iodata_to_binary(frame))
    :ok
  end

  @doc "Ends the session: disconnects from the worker's node."
  @spec close(pid()) :: :ok
  def close(pid) do
    :erlang.disconnect_node(node(pid))
    :ok
  end
end

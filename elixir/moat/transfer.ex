defmodule Moat.Transfer do
  @moduledoc """
  Tensor bytes in and out of a worker, by id: uploads (`upload/5`) and
  readbacks (`read/4`).

  Large tensors skip the pipe where the worker runs on this host and offers
  shared memory (see `Moat.Worker`'s `:shared_memory` option and
  `Moat.Shared`); everything else travels in frames of at most the
  connection's `chunk_bytes`. The handles of the ids are `Moat.Handles`'
  business: make them before an upload, check them before a readback.
  """

  require Logger

  alias Moat.{Client, Error, Finalizer, Shared}

  @doc """
  Uploads a binary as tensor `id` (whose handle `Moat.Handles.ref/2` made first): through a
  shared memory file when the connection has shared memory and the binary
  has at least its threshold of bytes, otherwise in frames of at most
  `chunk_bytes`. A refusal (the memory limit, say) poisons `id`: the next
  blocking call on it raises it.
  """
  @spec upload(Client.t(), pos_integer(), binary(), [non_neg_integer()], Nx.Type.t()) :: :ok
  def upload(conn, id, binary, shape, type) do
    attrs = %{bytes: byte_size(binary), dtype: type, shape: shape}

    if shared?(conn, byte_size(binary)) and upload_shared(conn, id, binary, attrs) == :ok do
      :ok
    else
      upload_piped(conn, id, binary, attrs)
    end
  rescue
    # Errors name :from_binary, whichever way and in whichever frame the
    # bytes travel.
    e in Error -> reraise Error.with_op(e, :from_binary), __STACKTRACE__
  end

  defp shared?(%Client{shared: %{threshold: threshold}}, bytes), do: bytes > 0 and bytes >= threshold
  defp shared?(_conn, _bytes), do: false

  defp upload_shared(conn, id, binary, attrs) do
    case Client.request(conn, :upload_file, [id], [], attrs, :infinity) do
      {:ok, location, _} ->
        case Shared.write(location, binary) do
          :ok ->
            Client.cast(conn, :from_file, [id], [], nil)

          {:error, why} ->
            # The file is gone (:enoent) when the worker just died, and the
            # pipe will say so; anything else is not expected once the
            # hello's probe passed. Either way the bytes go through the pipe
            # once the worker has dropped its file.
            if why != :enoent do
              Logger.warning("Moat: cannot write the worker's shared file (#{inspect(why)}); using the pipe")
            end

            Client.cast(conn, :release, [], [id], nil)
            :pipe
        end

      {:error, %Error{reason: :op_failed}} ->
        :ok

      {:error, e} ->
        raise e
    end
  end

  defp upload_piped(conn, id, binary, attrs) do
    size = attrs.bytes
    first = min(size, conn.chunk_bytes)
    Client.cast(conn, :from_binary, [id], [], attrs, binary_part(binary, 0, first))
    upload_rest(conn, id, binary, first, size)
  end

  defp upload_rest(_conn, _id, _binary, offset, size) when offset >= size, do: :ok

  defp upload_rest(conn, id, binary, offset, size) do
    n = min(size - offset, conn.chunk_bytes)
    Client.cast(conn, :upload, [id], [], offset, binary_part(binary, offset, n))
    upload_rest(conn, id, binary, offset + n, size)
  end

  @doc """
  Evaluates tensor `id` and returns its bytes as `Moat.Client.call/5` does,
  with the reply's metadata. Where the connection has shared memory, a
  tensor of at least its threshold of bytes is read straight from the
  worker's memory (the metadata says `transfer: :shared_memory`), and the
  worker holds it (as a pin, an id of its own) only until then. `handle`
  (the id's, checked by the caller) stays reachable until the last frame
  that reads `id` is written. A caller that knows the tensor holds fewer
  bytes than the threshold says so with `max_bytes`: the worker would send
  it through the pipe anyway, so the read skips the pin (its id, token and
  attrs: 3–4 µs of a small readback, docs/latency.md).
  """
  @spec read(Client.t(), pos_integer(), term(), non_neg_integer() | nil) ::
          {:ok, map(), binary()} | {:error, Error.t()}
  def read(conn, id, handle, max_bytes \\ nil)

  def read(%Client{shared: %{threshold: threshold} = shared} = conn, id, handle, max_bytes)
      when max_bytes == nil or max_bytes >= threshold,
      do: read_shared(conn, shared, id, handle)

  def read(conn, id, _handle, _max_bytes), do: Client.call(conn, :to_binary, [id], nil)

  defp read_shared(conn, shared, id, handle, attrs \\ nil) do
    %Client{releaser: releaser} = conn
    attrs = attrs || Shared.pin_attrs(shared)
    pin = Client.new_id()
    # The pin goes like a tensor: released below, or by this process's
    # garbage should it die before.
    token = Finalizer.new(releaser, pin)

    case Client.request(conn, :to_binary, [pin], [id], attrs, :infinity) do
      {:ok, meta, _} when is_map_key(meta, :address) or is_map_key(meta, :path) ->
        read = read_pinned(shared, meta, handle)
        if Finalizer.release(token), do: send(releaser, {:moat_release, pin})

        case read do
          {:ok, data} ->
            {:ok,
             meta |> Map.drop([:address, :path, :inode, :file_bytes, :offset]) |> Map.put(:transfer, :shared_memory),
             data}

          {:error, why} when is_map_key(meta, :offset) ->
            # A refused mapping of the tensor's own buffer: read it again
            # as before it could be exported (its address, or the pipe).
            Logger.warning("Moat: cannot map the worker's buffer (#{inspect(why)}); reading it another way")
            Client.pin(handle)
            read_shared(conn, shared, id, handle, Shared.plain_pin_attrs(shared))

          {:error, why} ->
            Logger.warning("Moat: cannot read the worker's memory (#{inspect(why)}); using the pipe")
            # The handle, used again here, stays alive until this call is sent.
            Client.pin(handle)
            Client.call(conn, :to_binary, [id], nil)
        end

      reply ->
        Finalizer.release(token)
        reply
    end
  end

  # A tensor's own buffer, exported (protocol.md §6, "Zero-copy readback"):
  # the mapping kept on the tensor's token by its last readback, if it is of
  # this file and range (its pages are mapped in this VM already, so reading
  # it costs no page faults), else the file mapped now, and kept. The worker
  # answered first, so every check of the id (poisoned, released) came
  # before. Only such mappings are kept: the pages are the worker's buffer,
  # alive anyway while the tensor is.
  defp read_pinned(shared, %{offset: offset, inode: inode, file_bytes: file_bytes, bytes: bytes} = meta, handle) do
    token = token(handle)
    key = {inode, file_bytes, offset, bytes}

    case token && Finalizer.kept(token) do
      {^key, data} ->
        {:ok, data}

      _ ->
        with {:ok, data} <- Shared.read_pinned(shared, meta) do
          if token, do: Finalizer.keep(token, {key, data})
          {:ok, data}
        end
    end
  end

  defp read_pinned(shared, meta, _handle), do: Shared.read_pinned(shared, meta)

  defp token(%Moat.Ref{token: token}) when is_reference(token), do: token
  defp token(_handle), do: nil
end

defmodule Moat.Protocol do
  @moduledoc """
  The frame codec of `protocol.md`, the Elixir half.

  A frame is `<<header_len::32, header::binary-size(header_len), payload::binary>>`
  inside a `{:packet, 4}` packet. The header is an Erlang term written with
  `minor_version: 2` (the canonical form the worker writes too); the payload is
  raw tensor bytes and is never copied here: outgoing frames are iodata and
  incoming payloads are sub-binaries of the packet.
  """

  @version 1

  @typedoc "A tensor id chosen by the client."
  @type id :: pos_integer()

  @doc "The protocol version this client speaks."
  @spec version() :: pos_integer()
  def version, do: @version

  @doc "Encodes a header term the way protocol.md specifies."
  @spec encode_header(term()) :: binary()
  def encode_header(term), do: :erlang.term_to_binary(term, minor_version: 2)

  @doc "A request frame as iodata: `{seq, generation, op, outs, ins, attrs}` plus payload."
  @spec request(non_neg_integer(), pos_integer(), atom(), [id()], [id()], term(), iodata()) ::
          iodata()
  def request(seq, generation, op, outs, ins, attrs, payload \\ []) do
    header = encode_header({seq, generation, op, outs, ins, attrs})
    [<<byte_size(header)::32>>, header | payload]
  end

  @doc """
  A batch packet's body (protocol.md §1, "Batches"): a header length of 0,
  then each frame as `<<byte_size(frame)::32, frame>>`. The worker reads
  its frames one by one, as if each had come in a packet of its own.
  """
  @spec batch([iodata()]) :: iodata()
  def batch([_ | _] = frames), do: [<<0::32>> | Enum.map(frames, &[<<IO.iodata_length(&1)::32>> | &1])]

  @doc """
  The atoms a worker may send besides op names (which the client sent
  first). Listing them here creates them when this module loads, so replies
  decode with `:safe`.
  """
  @spec worker_atoms() :: [atom()]
  def worker_atoms do
    ~w(hello ack progress ok more hook id value of error protocol stale_generation blas openblas reference
       chunk_bytes device device_info kind name memory compute_capability devices cpu gpu generation
       max_frame_bytes mlx os_pid bytes dtype shape u s f bf c pred shared_memory address nonce path inode
       message invalid memory_limit need in_use limit system avx512 avx2 scalar)a
  end

  @doc """
  Splits a frame received from the worker into its header term and payload.

  Decoding is `:safe`: a worker (possibly on another machine) cannot create
  atoms in this VM.
  """
  @spec decode(binary()) :: {:ok, term(), binary()} | {:error, String.t()}
  def decode(<<len::32, header::binary-size(len), payload::binary>>) do
    {:ok, :erlang.binary_to_term(header, [:safe]), payload}
  rescue
    ArgumentError -> {:error, "undecodable header of #{len} bytes"}
  end

  def decode(frame), do: {:error, "frame of #{byte_size(frame)} bytes is shorter than its header"}

  @doc """
  The sequence number of a reply frame whose header `decode/1` refused (for
  example for an atom this VM does not know): replies are
  `{tag, seq, ...}` tuples, so the tag and seq are read without decoding the
  rest.
  """
  @spec peek_seq(binary()) :: {:ok, non_neg_integer()} | :error
  def peek_seq(<<len::32, 131, 104, arity, rest::binary>>) when arity >= 2 and len >= 3 do
    with {:ok, rest} <- skip_atom(rest), do: read_uint(rest)
  end

  def peek_seq(_frame), do: :error

  defp skip_atom(<<tag, n, _::binary-size(n), rest::binary>>) when tag in [115, 119], do: {:ok, rest}
  defp skip_atom(<<tag, n::16, _::binary-size(n), rest::binary>>) when tag in [100, 118], do: {:ok, rest}
  defp skip_atom(_), do: :error

  defp read_uint(<<97, n, _::binary>>), do: {:ok, n}
  defp read_uint(<<98, n::32-signed, _::binary>>) when n >= 0, do: {:ok, n}
  defp read_uint(<<110, n, 0, digits::binary-size(n), _::binary>>), do: {:ok, :binary.decode_unsigned(digits, :little)}
  defp read_uint(_), do: :error
end

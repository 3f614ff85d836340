defmodule Moat.Backend do
  @moduledoc """
  `Nx.Backend` on MLX, run inside the `moat_port` worker.

      Nx.global_default_backend(Moat.Backend)
      Nx.global_default_backend({Moat.Backend, device: :cpu})

  Tensor data stays in the worker; an `Nx.Tensor` here holds a
  `t:Moat.Ref.t/0`. Ops are sent fire-and-forget and MLX evaluates lazily, so a
  chain of ops costs one pipe write each and no round trip until something
  reads values (`Nx.to_binary/1`, `inspect/2`, …).

  Every callback is one op in the worker, which applies Nx's semantics
  (type promotion, NaN handling, rounding) itself. Tensors from other
  backends or other workers that meet a Moat tensor in an op are copied into
  its worker first.

  Small tensors (at most 256 bytes) made from BEAM data keep a copy of their
  bytes, and so do the results of exact integer ops on such values (`add`,
  `subtract`, `multiply`, bitwise, logical, and `min`, `max` and the
  comparisons where both sides fit the type they are ordered in), which are
  computed on the BEAM as well as sent. Reading one (`Nx.to_number/1`, a
  `while` condition of `Nx.Defn.Evaluator`) takes no round trip; a handle
  that was deallocated, released by a closed `Moat.scope/1`, or is of an
  earlier worker incarnation takes it, and raises as always. Such a read
  answers with the value even where the worker refused to hold the tensor
  (its memory limit): the worker ops that use it fail, and say so when read.

  ## Across nodes

  A tensor belongs to one worker incarnation (one start of one worker, on
  one node; see `Moat.Ref`), checked on every use. A Moat tensor that
  reaches another node (in a message, or through `Nx.Serving`'s
  `{:distributed, name}` mode) is copied there at the boundary: each op
  that meets it fetches its bytes from its own node and uploads them to
  this node's worker (`Nx.backend_transfer(t, Moat.Backend)` does it once
  and releases the original), and `Nx.to_binary/1` reads it from its node.
  Copies of a handle on other nodes do not keep the tensor alive: once its
  own node has dropped it, using them raises a `Moat.Error` with reason
  `:foreign_tensor`, and `:worker_unreachable` where that node cannot be
  reached. A distributed `Nx.Serving` receives Moat inputs as they are,
  but the results it sends back are dropped on its node as soon as they
  are sent: give it `Nx.Serving.distributed_postprocessing(serving,
  &Nx.backend_transfer(&1, Nx.BinaryBackend))`, as Nx's documentation says
  for EXLA and Torchx. A handle read back with `:erlang.binary_to_term/1`
  in a later VM raises `:foreign_tensor`; it never reads the new worker's
  tensors.

  A tensor's data is freed in the worker once no process holds the tensor
  any more (see `Moat`, "Memory"), or at once with `Nx.backend_deallocate/1`
  (`:ok`, then `:already_deallocated`) or `Moat.scope/1`. The worker refuses
  what would exceed its memory limit (`Moat.set_memory_limit/2`) with a
  `Moat.Error` instead of running out of memory.

  ## Options

    * `:device` - `:cpu` or `:gpu`; by default the device the worker runs on
      (`Moat.Worker`'s `:device`: the best one it announces). A device the
      worker does not run on raises `ArgumentError` naming the ones it has.
      On `:gpu`, `{:f, 64}` raises `ArgumentError` (MLX's CUDA backend has no
      float64); it is never narrowed silently.
    * `:worker` - the `Moat.Worker` to use (default `Moat.Worker`)

  `inspect/2` shows the backend and device on a first line, like Torchx;
  `config :moat, inspect_backend: false` leaves it out.

  ## Checks

  MLX does not check indices, integer division or element counts, and on the
  CPU some of those inputs kill its process or corrupt memory. The worker
  checks them before MLX sees them, always: an op given out-of-range indices
  (`gather`, `take`, `take_along_axis`, `indexed_add`, `indexed_put`), an
  integer divisor of zero, or whose result would be larger than an address
  space fails, and reading its result raises a `Moat.Error` naming the op.
  The worker and every other tensor carry on. Checking indices and integer
  divisors evaluates them in the worker, within its memory limit (not the
  op's result, and with no round trip to the VM); only their lowest and
  highest values, or whether a zero is among them, are read.

  A debug check is off by default:

      config :moat, debug: [detect_non_finite: true]

  makes every op evaluate its float results and fail if they hold NaN or an
  infinity, so reading raises a `Moat.Error` naming the op that produced the
  first one. Evaluating every op forgoes MLX's lazy fusion; use it to find
  where NaN appears, not in production.

  ## Divergences from Nx.BinaryBackend

  Creation, conversion, shape and type ops, element-wise ops, reductions,
  cumulative ops and sorting:

    * Types MLX does not have (`{:f, 8}`, `{:f8_e4m3fn, 8}`, `{:s | :u, 2 |
      4}`, `{:c, 128}`) are held in a storage type and emulated or computed
      on Nx.BinaryBackend: see "Types MLX does not have" below. `{:f, 64}`
      is computed on the CPU.
    * f64 `exp`, `sigmoid`, `sin`, `cos`, `erf`, `erfc` and `erf_inv` are
      built from MLX primitives that are exact in f64 (MLX's own f64 kernels
      of these are single precision), within a few ulp of the correctly
      rounded result; `sin`/`cos` lose accuracy beyond |x| ≈ 10⁶. `erf_inv`
      is more accurate than Nx.BinaryBackend's approximation (~3e-8).
    * f32, f16 and bf16 `exp`, `expm1`, `log`, `log1p`, `tanh`, `sigmoid`,
      `erf`, `erfc`, `sin`, `cos`, `rsqrt` and `pow` run on the worker's own
      vectorized CPU kernels (SLEEF, with `tanh` and `erf` of their own;
      the set is chosen from what the CPU reports and named in the hello's
      `cpu`), computed in f32 over the
      whole range, denormals included: within 1 ulp of the exact result
      (`sigmoid` 3, `erfc` 2, `rsqrt` 1.5, `erf` 1.01; `sin`/`cos` at any
      magnitude);
      f16 and bf16 results are the f32 result rounded once. Other math
      follows MLX's kernels: in f32 within ~5e-7 relative of Erlang's
      `:math`.
    * bf16 results computed here are rounded to nearest (ties to even), as
      MLX, EXLA and Torchx round; Nx.BinaryBackend truncates (it keeps the
      high 16 bits of the f32), so its bf16 results are often one bf16 ulp
      lower in magnitude (`exp(-2)`: 0.1357 here, 0.1348 there; exact
      0.1353). Axon's bf16 activation doctests show it (docs/downstream.md).
    * Where Nx.BinaryBackend has no answer or a wrong one: `tanh` and `erf`
      of ±inf are ±1 (BinaryBackend: NaN); `sign` of NaN is NaN and of -inf
      is -1 (BinaryBackend: 1); `ceil`, `floor` and `round` return
      non-finite values unchanged (BinaryBackend raises).
    * Integer `pow` with a negative exponent gives the truncated result (1
      for base 1, ±1 for base -1, else 0); BinaryBackend raises.
    * Shifts by a negative amount or by the bit width or more shift
      everything out: 0, or the sign for signed `right_shift`; BinaryBackend
      raises on negative amounts, and so does Moat where the amounts are on
      the BEAM (see "Failures of asynchronous ops" below).
    * Operands of mixed types are converted to the output type before the
      op, as compilers do: an s64 beyond f16's range is infinite in an f16
      `divide`, where BinaryBackend divides the exact integer.
    * `min`, `max` and comparisons of a u64 with a signed integer run in
      their merged type, s64 (as compilers do), where BinaryBackend compares
      the exact integers.
    * `as_type` from float to integer maps NaN to 0 and ±inf to the type's
      max/min, and wraps other values like Nx, but values beyond the s64
      range are unspecified.
    * f32 `sum` accumulates in f32 (MLX's kernel), so long sums carry
      rounding error that BinaryBackend's exact sum does not (the sum of a
      1e6-element f32 iota is off by 1.2e-4 relative). f16 and bf16 sums,
      and cumulative ops on them, accumulate in f32 and round once.
    * A descending `sort` may order -0.0 and 0.0 differently (they compare
      equal); `argsort` is stable in both directions, as in Nx.
    * c64 `exp`, `log`, `sqrt`, `rsqrt`, `sigmoid`, trigonometric and
      hyperbolic functions and their inverses, `pow` and `product` are
      Nx.BinaryBackend's: the `Complex` library's formulas evaluated in f64
      with its clauses for infinite and NaN parts, rounded once (so
      `tanh(inf + 3i)` is NaN and `asinh(inf + 3i)` is `inf + pi/4 i`, as in
      Nx, not C99's limits; a complex `product` folds from `1 + 0i` with the
      textbook multiplication, pairwise). c64 `expm1` and `atan2` (no MLX
      kernel) are composed from MLX ops; `cbrt` takes Nx's root (the cube
      root of the modulus at a third of the phase; Nx.BinaryBackend raises).
      A complex `atan2` with a non-zero imaginary part raises
      `ArithmeticError` at the call where its values are on the BEAM (see
      below), else fails the op.
    * `to_pointer/2` and `from_pointer/5` raise `ArgumentError`: tensor data
      lives in the worker process, whose addresses mean nothing to the BEAM
      or to other processes, and a shared-memory IPC segment would outlive
      the tensor with nothing to release it.

  Indexing, dot, convolution, linear algebra, windows, FFT and integer
  division:

    * Failures of asynchronous ops (out-of-range indices, integer division by
      zero, singular matrices in `triangular_solve` and `solve`) raise a
      `Moat.Error` naming the op when the result is read, where
      Nx.BinaryBackend raises `ArgumentError` or `ArithmeticError` at the call.
      Values that are on the BEAM are checked at the call, with Nx's
      message and no round trip: a small tensor (up to 256 bytes) made by
      `Nx.tensor/2`, `Nx.from_binary/3` or from a number keeps its bytes in
      its handle, and Nx.BinaryBackend tensors are read, for the indices of
      `gather`, `indexed_add` and `indexed_put`, shift amounts (negative:
      `ArgumentError`) and complex `atan2` arguments.
    * `quotient` and `remainder` follow Nx (truncation; the remainder has the
      dividend's sign; `MIN / -1` wraps to `MIN`). A float `remainder` by zero
      is NaN (Nx.BinaryBackend raises).
    * `indexed_add`/`indexed_put` with updates smaller than the target's other
      axes write them as a block at the index (as EXLA does);
      Nx.BinaryBackend writes them contiguously from the index's offset.
    * FFTs along an axis before the last two of a tensor (`fft`, `ifft`, and
      `fft2`/`ifft2` over such an axis) transform along that axis;
      Nx.BinaryBackend 0.13 scrambles that result. FFTs of
      length 1 and windows whose last position overhangs the padded input
      (Nx's shape rule allows it) return the transform or the reduction over
      the part inside (the rest counts as padding); Nx.BinaryBackend returns
      tensors without data there.
    * Linear algebra comes from LAPACK (through MLX) in f32 (f64 for f64), not
      from Nx's iterative algorithms: results agree to rounding (the last
      digits of f32). Eigenvector and singular vector signs are normalised
      (each vector's largest component positive); QR signs follow Nx's
      Householder convention (r's diagonal is positive in every column Nx
      reflects) except in a column whose entries below the diagonal become
      zero only partway through the factorisation: Nx leaves it unreflected,
      Moat does not (for `[[2, -2, 18], [2, 1, 0], [1, 2, 0]]` Nx's
      `r[1][1]` is -3, Moat's 3, with q's column 1 negated; `q · r` is the
      same). In `qr(mode: :complete)` the columns of q past min(m, n), and
      in `svd` the singular vectors of zero singular values, are an
      orthonormal completion, not necessarily Nx's.
      `triangular_solve` computes in f64, as Nx.BinaryBackend does.
    * `cholesky` comes from LAPACK; a matrix of up to 256 rows with a pivot
      that is not positive is factored again by Nx's own algorithm (the
      pivots are checked in the worker, which evaluates the factor): a zero
      pivot gives Nx's result (`[[25, 25], [25, 25]]` is `[[5, 0], [5, 0]]`,
      and a singular covariance in `Nx.Random.multivariate_normal` gives no
      NaN), a negative one NaN from there on, where Nx.BinaryBackend raises.
      Larger matrices stay lazy and are NaN from the first non-positive
      pivot on.
    * `dot` and `conv` of f16/bf16 accumulate in f32 and round once; f32
      `dot` accumulates in f32 (BLAS), where Nx.BinaryBackend accumulates
      in f64 and rounds once (last-digit differences).

  ## Types MLX does not have

  MLX has no 8-bit floats, no 2- or 4-bit integers and no complex128.
  `Moat.Types` holds them in the worker in a storage type: f8 and
  f8_e4m3fn as their bytes (u8), 2- and 4-bit integers one value a byte
  (s8/u8, unpacked from Nx's bitstrings on upload and packed on readback),
  c128 as f64 with a hidden trailing axis of 2 (Nx's own byte layout).
  Per op: *native* runs MLX on the stored values as they are; *emulated*
  widens the inputs in the worker (f8 exactly to f64, sub-byte integers as
  their 8-bit storage), runs the op there and rounds (f8) or wraps (sub-byte
  integers) the result back, as Nx.BinaryBackend writes values of the type;
  *fallback* runs on Nx.BinaryBackend with `[:moat, :fallback, ...]`
  telemetry (a c128 computed in c64 would be wrong data).

  | ops | f8, f8_e4m3fn | s2, s4, u2, u4 | c128 |
  | --- | --- | --- | --- |
  | `reshape`, `squeeze`, `broadcast`, `transpose`, `reverse`, `slice`, `concatenate`, `stack`, `to_batched`, copies | native | native | native |
  | `pad`, `select`, `put_slice`, `gather`, `indexed_put` | native when the data inputs have the output's type, else emulated | native | fallback |
  | `as_type` | emulated | emulated | native from real types, else fallback |
  | `bitcast` | native (the bytes) | native, then wrapped | – |
  | `add`, `subtract`, `multiply`, `negate`, `conjugate`, `real`, `imag`, `abs` | emulated | emulated | native, from f64 parts as `Complex` computes them |
  | every other callback: element-wise math, comparisons, reductions, `argsort`/`sort`, `dot`, `conv`, windows, FFT, `quotient`/`remainder`, bit counts, `triangular_solve` | emulated | emulated | fallback |
  | blocks (`Nx.Block.*`: `take`, `top_k`, cumulative ops, linear algebra, `fft2`…) | Nx's default implementation, from the callbacks above | the same | fallback (the whole block) |
  | `constant`, `iota`, `eye` | made in f64 and rounded | made in s64 and wrapped | made in f64 (native) |

  Rounding follows Nx.BinaryBackend bit for bit where it writes one value:

    * f8 (E5M2) is Nx's: the value rounded to f16 (nearest, ties to even),
      then its high byte (so the low byte is truncated); NaN is `0x7E`.
    * f8_e4m3fn is `Nx.Floating.dump_f8_e4m3fn/1`'s, quirks included: the
      3-bit mantissa is rounded half away from zero and capped at 7 instead
      of carrying into the exponent (1.96 becomes 1.875), values beyond ±448
      and infinities saturate to ±448, NaN is `0x7F`, and -0.0 is `0x00`
      (Nx on OTP 25; on OTP 27 Nx writes `0x80`).
    * 2- and 4-bit integers wrap (the low bits, sign-extended); converting a
      float gives 0 for NaN and the type's limits for ±inf, as Nx does.

  f8 ops are computed in f64, as Nx.BinaryBackend computes them (in
  Elixir floats), and rounded once, so results match bit for bit except
  where the f64 results themselves differ (Moat's f64 math, above): e.g.
  `cbrt(64)` is 4.0 in e4m3fn here and 3.75 there, from Nx's
  3.9999999999999996 (f32 would differ far more often: e4m3fn's capped
  mantissa turns a value one f32 step below a power of two into a whole
  step). As all f64 work, f8 math runs on the CPU.
  `count_leading_zeros` of a 2- or 4-bit integer counts within its bits
  (Nx.BinaryBackend raises), and `inspect/2` prints 2- and 4-bit tensors
  (Nx 0.13's `Nx.Backend.inspect/3` cannot). c128 fallbacks behave as
  Nx.BinaryBackend does, its limits included: complex functions of
  non-finite or overflowing c128 values raise there (`exp` of 710 raises
  `ArithmeticError`), and FFTs of length 1 have no data (uploading the
  result raises). The fallbacks copy their inputs out of the worker and the
  result back, once per op.

  ## Fallbacks

  Creation, conversion, shape and type ops, element-wise ops, reductions,
  cumulative ops, sorting and the blocks `Nx.Block.LogicalNot`,
  `Nx.Block.Phase`, `Nx.Block.AllClose`, `Nx.Block.Cumulative*` (any axis,
  both directions) and `Nx.Block.TopK` all run natively in the worker; none
  of them falls back to Nx.BinaryBackend, except on c128 (see "Types MLX
  does not have"; the telemetry's metadata names the callback as `:op`, and
  a block's struct as `:block`).

  Indexing, dot, convolution, linear algebra, windows and FFT:

    * On Nx.BinaryBackend (inputs copied out of the worker and back; each
      emits `[:moat, :fallback, ...]` telemetry and obeys
      `config :moat, fallback: :silent | :warn | :raise`): `reduce` and
      `window_reduce` (a user function cannot run in the worker), `conv` over
      more than 3 spatial axes, complex `triangular_solve`.
    * Through Nx's default implementations, built from Moat's own ops (MLX's
      decompositions are real): complex QR, Cholesky, eigh, LU, solve and
      determinant.
  """

  @behaviour Nx.Backend

  @emulated Moat.Types.emulated()

  # The types MLX has (`Moat.check_type!/1` passes them), as map keys for guards.
  @mlx_types Map.new(Moat.supported_types(), &{&1, true})

  @enforce_keys [:ref]
  defstruct [:ref, device: :cpu, quant: nil, host: nil, host_scope: nil]

  # `quant`: a quantized weight's parameters (Moat.Quantized); `ref` is
  # then its packed bytes, never read as the tensor's values.
  # `host`: the tensor's bytes in Nx's layout when it was made from BEAM data
  # (`from_binary`, `constant`) and is small. The value checks Nx.BinaryBackend
  # makes at the call (indices in range, shift amounts, real atan2
  # arguments) read it, so they raise at the call with no round trip; so do
  # reads of the tensor (`host_bytes/1`), and exact integer ops on such
  # values compute theirs here too (`with_host/3`). `host_scope`: the
  # `Moat.scope/1` open when the bytes were kept (Moat.Scope.flag/0), or nil.
  @type t :: %__MODULE__{
          ref: Moat.Ref.t() | Moat.Compiler.Recorder.slot(),
          device: :cpu | :gpu,
          quant: Moat.Quantized.t() | nil,
          host: bitstring() | nil,
          host_scope: Moat.Scope.flag() | nil
        }

  # The largest tensor (in bits) whose bytes a handle keeps.
  @host_bits 256 * 8

  alias Moat.{Client, Handles, Ref, Types}
  alias Moat.Compiler.Recorder
  alias Nx.Tensor, as: T

  @impl true
  def init(opts) do
    opts = Keyword.validate!(opts, device: nil, worker: Moat.Worker)

    unless opts[:device] in [nil, :cpu, :gpu] do
      raise ArgumentError, "Moat.Backend: unknown device #{inspect(opts[:device])}, expected :cpu or :gpu"
    end

    opts
  end

  ## Creation and conversion

  @impl true
  def from_binary(%T{shape: shape, type: type} = out, binary, opts) do
    device = device!(worker(opts), opts)
    gpu_type!(type, device, :from_binary)
    {stored_binary, dims, stored} = Types.to_storage(binary, Tuple.to_list(shape), type)
    ref = Moat.from_binary(stored_binary, dims, stored, worker: worker(opts))
    data = %__MODULE__{ref: ref, device: device, host: host_copy(binary), host_scope: Moat.Scope.flag()}
    %{wrap(out, ref, device) | data: data}
  end

  defp host_copy(binary) when bit_size(binary) > @host_bits, do: nil
  defp host_copy(binary) when is_binary(binary), do: :binary.copy(binary)
  defp host_copy(bits), do: bits

  # Types MLX does not have (Moat.Types) are made in a type MLX has and
  # converted, or (constants) uploaded once and broadcast.
  @impl true
  def constant(%T{shape: shape, type: type} = out, number, opts) when type in @emulated do
    value = Nx.BinaryBackend.constant(%{out | shape: {}}, number, []) |> Nx.to_binary()
    scalar = from_binary(%{out | shape: {}}, value, opts)
    if shape == {}, do: scalar, else: broadcast(out, scalar, shape, [])
  end

  def constant(%T{shape: shape, type: type} = out, number, opts) do
    value = Nx.BinaryBackend.constant(%{out | shape: {}}, number, []) |> Nx.to_binary()
    t = create(out, :constant, %{value: value, shape: Tuple.to_list(shape), type: Moat.check_type!(type)}, opts)

    size = Nx.size(out)
    host = if size * bit_size(value) <= @host_bits, do: :binary.copy(value, size)
    %{t | data: %{t.data | host: host, host_scope: Moat.Scope.flag()}}
  end

  @impl true
  def eye(%T{type: type} = out, opts) when type in @emulated, do: as_type(out, eye(%{out | type: made_as(type)}, opts))

  def eye(%T{shape: shape, type: type} = out, opts) do
    create(out, :eye, %{shape: Tuple.to_list(shape), type: Moat.check_type!(type)}, opts)
  end

  @impl true
  def iota(%T{type: type} = out, axis, opts) when type in @emulated,
    do: as_type(out, iota(%{out | type: made_as(type)}, axis, opts))

  def iota(%T{shape: shape, type: type} = out, axis, opts) do
    create(out, :iota, %{shape: Tuple.to_list(shape), axis: axis, type: Moat.check_type!(type)}, opts)
  end

  # eye and iota of the types MLX does not have are made in these, then converted.
  defp made_as({:c, 128}), do: {:f, 64}
  defp made_as({:s, _}), do: {:s, 64}
  defp made_as({:u, _}), do: {:u, 64}
  defp made_as(_f8), do: {:f, 64}

  @impl true
  def to_binary(%T{data: %__MODULE__{quant: %Moat.Quantized{}}} = tensor, limit),
    do: read_and_release([Moat.Quantized.dense(tensor, :to_binary, &op/4)], &to_binary(&1, limit))

  def to_binary(%T{type: {_, bits}} = tensor, limit) do
    binary =
      cond do
        # The values are here (see `host`): no round trip.
        host = host_bytes(tensor) ->
          host

        limit < Nx.size(tensor) ->
          # Only the first `limit` elements leave the worker.
          flat = reshape(%{tensor | shape: {Nx.size(tensor)}}, tensor)
          head = slice(%{flat | shape: {limit}}, flat, [0], [limit], [1])
          read_and_release([flat, head])

        true ->
          read(tensor)
      end

    size = min(bit_size(binary), limit * bits)
    <<head::bitstring-size(size), _::bitstring>> = binary
    head
  end

  # The tensor's `host` bytes where a read may answer from them: a type MLX
  # has, and a handle whose release would make the round trip raise — one
  # of its worker's running incarnation (a stale, remote or foreign handle
  # is not), with a live token not released (`Nx.backend_deallocate/1`, a
  # handle rebuilt without its token), made outside any `Moat.scope/1` or
  # in one still open (a closed scope released its ids without marking
  # their tokens). Otherwise the round trip, which raises as it should. The
  # reader must be a creator its worker's releaser knows (Moat.Handles
  # announces them under this key), so that its garbage is collected when
  # it goes idle: a process that only reads handles others made takes the
  # round trip, which announces it.
  defp host_bytes(%T{type: type, shape: shape, data: %__MODULE__{host: host, ref: %Ref{} = ref} = data})
       when is_bitstring(host) and type not in @emulated do
    %Ref{worker: worker, incarnation: inc, token: token} = ref

    if bit_size(host) == elem(type, 1) * Nx.size(shape) and Process.get({Moat.Releaser, worker}) != nil and
         match?(%Client{incarnation: ^inc}, Client.current(worker)) and unreleased_token?(token) and
         not Moat.Scope.closed?(data.host_scope),
       do: host
  end

  defp host_bytes(_tensor), do: nil

  defp unreleased_token?(nil), do: false

  defp unreleased_token?(token) do
    not Moat.Finalizer.released?(token)
  rescue
    ArgumentError -> false
  end

  defp read_and_release(tensors, read \\ &read/1) do
    binary = read.(List.last(tensors))
    Enum.each(tensors, &backend_deallocate/1)
    binary
  end

  # The tensor's data in Nx's layout; its size in the worker tells the read
  # whether it can take the shared-memory path at all.
  defp read(%T{type: type} = tensor),
    do: tensor |> ref() |> Moat.to_binary(Nx.size(tensor) * Types.stored_bytes(type)) |> Types.from_storage(type)

  @impl true
  def inspect(%T{data: %__MODULE__{device: device, quant: quant}} = tensor, inspect_opts) do
    limit = if inspect_opts.limit == :infinity, do: :infinity, else: inspect_opts.limit + 1
    binary = to_binary(tensor, min(limit, Nx.size(tensor)))
    # Nx.Backend.inspect/3 reads whole bytes: sub-byte integers print from theirs.
    {type, binary} = Types.printable(tensor.type, binary)
    doc = Nx.Backend.inspect(%{tensor | type: type}, binary, inspect_opts)

    # `config :moat, inspect_backend: false` leaves the signature out.
    if Moat.Config.get(:inspect_backend) do
      label = if quant, do: Moat.Quantized.label(quant), else: ""
      Inspect.Algebra.concat(["Moat.Backend(#{device}#{label})", Inspect.Algebra.line(), doc])
    else
      doc
    end
  end

  # A quantized weight stays quantized within Moat (its packed bytes move);
  # other backends receive its dense values.
  @impl true
  def backend_copy(%T{data: %__MODULE__{quant: %Moat.Quantized{}}} = tensor, backend, opts) do
    if backend == __MODULE__,
      do: Moat.Quantized.rewrap(backend_copy(Moat.Quantized.packed(tensor), __MODULE__, opts), tensor),
      else: read_and_release([Moat.Quantized.dense(tensor, :backend_copy, &op/4)], &backend_copy(&1, backend, opts))
  end

  def backend_copy(%T{} = tensor, __MODULE__, opts) do
    if here?(tensor, opts) do
      # MLX arrays are immutable: the copy is a new id for the same array.
      op(tensor, :copy, [tensor], %{})
    else
      from_binary(tensor, values(tensor), opts)
    end
  end

  def backend_copy(tensor, backend, opts) do
    backend.from_binary(tensor, values(tensor), opts)
  end

  # The tensor's data in Nx's layout, from its `host` bytes where a read may
  # take them (`host_bytes/1`), else from the worker.
  defp values(tensor), do: host_bytes(tensor) || read(tensor)

  # A tensor of another node's worker is copied into this node's, once.
  @impl true
  def backend_transfer(tensor, __MODULE__, opts) do
    if here?(tensor, opts) do
      tensor
    else
      transfer(tensor, __MODULE__, opts)
    end
  end

  def backend_transfer(tensor, backend, opts), do: transfer(tensor, backend, opts)

  defp transfer(tensor, backend, opts) do
    result = backend_copy(tensor, backend, opts)
    backend_deallocate(tensor)
    result
  end

  @impl true
  def backend_deallocate(%T{data: %__MODULE__{ref: %Ref{} = ref}}), do: Moat.deallocate(ref)

  # A stream, as in Nx: each batch is sliced out in the worker when the
  # stream reaches it. With `leftover: :repeat` the last batch wraps around
  # to the first rows.
  @impl true
  def to_batched(%T{shape: shape} = out, %T{shape: in_shape} = tensor, opts) do
    {size, n} = {elem(shape, 0), elem(in_shape, 0)}
    full = div(n, size)
    last = if rem(n, size) != 0 and opts[:leftover] == :repeat, do: full, else: full - 1

    Stream.map(0..last//1, fn
      ^full ->
        available = n - full * size
        tail = rows(out, tensor, full * size, available)
        head = rows(out, tensor, 0, size - available)
        batch = concatenate(out, [tail, head], 0)
        Enum.each([tail, head], &backend_deallocate/1)
        batch

      i ->
        rows(out, tensor, i * size, size)
    end)
  end

  defp rows(%T{shape: shape} = out, tensor, start, count) do
    rank = tuple_size(shape)
    lengths = [count | tl(Tuple.to_list(shape))]
    starts = [start | List.duplicate(0, rank - 1)]
    slice(%{out | shape: put_elem(shape, 0, count)}, tensor, starts, lengths, List.duplicate(1, rank))
  end

  @impl true
  def to_pointer(%T{}, opts) do
    case Keyword.get(opts, :mode, :local) do
      :ipc ->
        raise ArgumentError,
              "Moat.Backend does not export IPC handles: a shared-memory segment written by the " <>
                "moat_port worker would outlive the tensor with nothing to release it; copy the data " <>
                "out with Nx.to_binary/1 instead"

      mode ->
        raise ArgumentError,
              "Moat.Backend does not support to_pointer (mode: #{inspect(mode)}): tensor data lives in " <>
                "the moat_port worker, another OS process, so its address means nothing here; copy " <>
                "the data out with Nx.to_binary/1 instead"
    end
  end

  @impl true
  def from_pointer(_pointer, _type, _shape, _backend_opts, _opts) do
    raise ArgumentError,
          "Moat.Backend does not support from_pointer: the moat_port worker is another OS process " <>
            "and cannot adopt memory of the BEAM or of a third process; build the tensor with " <>
            "Nx.from_binary/3 instead"
  end

  ## Shape and type

  @impl true
  def as_type(%T{type: type} = out, tensor), do: op(out, :astype, [tensor], %{type: type})

  @impl true
  def bitcast(%T{type: type} = out, tensor), do: op(out, :bitcast, [tensor], %{type: type})

  @impl true
  def reshape(%T{shape: shape} = out, tensor), do: op(out, :reshape, [tensor], %{shape: Tuple.to_list(shape)})

  @impl true
  def squeeze(out, tensor, _axes), do: reshape(out, tensor)

  @impl true
  def broadcast(out, tensor, shape, axes) do
    op(out, :broadcast, [tensor], %{shape: Tuple.to_list(shape), axes: axes})
  end

  @impl true
  def transpose(out, tensor, axes), do: op(out, :transpose, [tensor], %{axes: axes})

  @impl true
  def reverse(out, tensor, axes), do: op(out, :reverse, [tensor], %{axes: axes})

  @impl true
  def pad(out, tensor, pad_value, config) do
    config = for {low, high, interior} <- config, do: [low, high, interior]
    op(out, :pad, [tensor, pad_value], %{config: config, type: out.type})
  end

  @impl true
  def concatenate(out, tensors, axis), do: op(out, :concatenate, tensors, %{axis: axis, type: out.type})

  @impl true
  def stack(out, tensors, axis), do: op(out, :stack, tensors, %{axis: axis, type: out.type})

  @impl true
  def select(out, pred, on_true, on_false), do: op(out, :select, [pred, on_true, on_false], %{type: out.type})

  @impl true
  def clip(out, tensor, min, max), do: op(out, :clip, [tensor, min, max], %{type: out.type})

  ## Element-wise

  # Every one is one worker op of the same name; the worker converts the
  # inputs to the output type first, as Nx does.
  @unary_ops [:exp, :expm1, :log, :log1p, :sigmoid, :cos, :sin, :tan, :cosh, :sinh, :tanh] ++
               [:acos, :asin, :atan, :acosh, :asinh, :atanh, :sqrt, :rsqrt, :cbrt] ++
               [:erf, :erfc, :erf_inv, :abs, :bitwise_not, :ceil, :conjugate, :floor] ++
               [:negate, :round, :sign, :real, :imag, :is_nan, :is_infinity]

  for name <- @unary_ops do
    @impl true
    def unquote(name)(out, tensor), do: op(out, unquote(name), [tensor], %{type: out.type})
  end

  @binary_ops [:add, :subtract, :multiply, :pow, :divide, :min, :max] ++
                [:bitwise_and, :bitwise_or, :bitwise_xor] ++
                [:logical_and, :logical_or, :logical_xor]

  for name <- @binary_ops do
    @impl true
    def unquote(name)(out, a, b),
      do: op(out, unquote(name), [a, b], %{type: out.type}) |> with_host(unquote(name), [a, b])
  end

  # Nx.BinaryBackend raises at the call on a negative shift amount and on a
  # complex atan2 argument with an imaginary part; where the values are
  # here (see `host`), so does Moat. Otherwise the worker shifts everything
  # out, or fails the op (`Moat.Error` when read).
  for {name, word} <- [left_shift: "left", right_shift: "right"] do
    @impl true
    def unquote(name)(out, a, b) do
      with bits when is_bitstring(bits) <- local(b),
           negative when negative != nil <- Enum.find(numbers(bits, b.type), &(&1 < 0)) do
        raise ArgumentError, "cannot #{unquote(word)} shift by #{negative}"
      end

      op(out, unquote(name), [a, b], %{type: out.type})
    end
  end

  @impl true
  def atan2(%T{type: {:c, _}} = out, a, b) do
    if Enum.any?([a, b], &imaginary_part?/1) do
      raise ArithmeticError, "Complex.atan2 only accepts real numbers as arguments"
    end

    op(out, :atan2, [a, b], %{type: out.type})
  end

  def atan2(out, a, b), do: op(out, :atan2, [a, b], %{type: out.type})

  # Whether a complex tensor's values are here and one has an imaginary
  # part other than ±0.
  defp imaginary_part?(%T{type: {:c, bits}} = t) do
    half = div(bits, 2)
    negative_zero = Bitwise.bsl(1, half - 1)

    case local(t) do
      nil -> false
      data -> Enum.any?(for <<_::size(half), im::native-size(half) <- data>>, do: im not in [0, negative_zero])
    end
  end

  defp imaginary_part?(_real), do: false

  # The bytes of a tensor whose values are here: a small one made from BEAM
  # data, or a small Nx.BinaryBackend one.
  defp local(%T{data: %__MODULE__{host: host}}), do: host
  defp local(%T{data: %Nx.BinaryBackend{state: state}}) when bit_size(state) <= @host_bits, do: state
  defp local(_tensor), do: nil

  defp numbers(bits, {:s, size}), do: for(<<x::signed-native-size(size) <- bits>>, do: x)
  defp numbers(bits, {:u, size}), do: for(<<x::unsigned-native-size(size) <- bits>>, do: x)
  defp numbers(_bits, _float), do: []

  # Both sides are compared in their merged type; the result is u8.
  @comparison_ops [:equal, :not_equal, :greater, :less, :greater_equal, :less_equal]

  for name <- @comparison_ops do
    @impl true
    def unquote(name)(out, a, b) do
      op(out, unquote(name), [a, b], %{type: out.type, input_type: Nx.Type.merge(a.type, b.type)})
      |> with_host(unquote(name), [a, b])
    end
  end

  # Integer ops whose results Nx.BinaryBackend and MLX compute bit for bit
  # alike, by how each is exact (test/moat/host_ops_test.exs runs each both
  # ways over every integer type's edge values):
  #   * ring ops: the worker converts each input to the output type, then
  #     computes modulo 2^bits; Nx.BinaryBackend computes on the exact values,
  #     then wraps into the output type. Conversion and wrapping are both
  #     reduction modulo 2^bits, which these ops commute with: any integer
  #     types.
  #   * order ops (min, max: in the output type; comparisons: in the merged
  #     input type): only where every input's values all fit the type the
  #     worker converts them to (u64 into s64 does not), so both order the
  #     same numbers.
  #   * logical ops: the worker tests each input for non-zero as it is, so
  #     does Nx.BinaryBackend: any integer types.
  # Not here: quotient and remainder (division by zero, MIN / -1, the sign
  # of a remainder), shifts (amounts beyond the width), pow, and anything
  # producing floats: they stay on the worker.
  @host_ring_ops [:add, :subtract, :multiply, :bitwise_and, :bitwise_or, :bitwise_xor]
  @host_order_ops [:min, :max]
  @host_logical_ops [:logical_and, :logical_or, :logical_xor]

  # When every input's values are here (see `host`), one of those ops on
  # integers is computed here as well, and the result keeps its bytes: a
  # later read of it (a `while` condition in Nx.Defn.Evaluator, a loop
  # counter's `Nx.to_number`) takes no round trip. The op still goes to the
  # worker, which holds the tensor for everything else.
  # (A result that is not an integer never keeps bytes: one match.)
  defp with_host(%T{type: {kind, _}} = result, _name, _inputs) when kind not in [:s, :u], do: result

  defp with_host(%T{type: type, data: %__MODULE__{ref: %Ref{}}} = result, name, [a, b] = inputs) do
    with true <- host_integer?(type) and host_integer?(a.type) and host_integer?(b.type),
         true <- host_exact?(name, type, a.type, b.type),
         true <- Nx.size(result) * elem(type, 1) <= @host_bits,
         [_, _] = bits <- hosts(inputs, []) do
      [a, b] = Enum.zip_with(inputs, bits, &%{&1 | data: %Nx.BinaryBackend{state: &2}})
      %T{data: %Nx.BinaryBackend{state: host}} = apply(Nx.BinaryBackend, name, [%{result | data: nil}, a, b])
      %{result | data: %{result.data | host: host, host_scope: Moat.Scope.flag()}}
    else
      _ -> result
    end
  end

  defp with_host(result, _name, _inputs), do: result

  defp host_exact?(name, _out, _a, _b) when name in @host_ring_ops or name in @host_logical_ops, do: true
  defp host_exact?(name, out, a, b) when name in @host_order_ops, do: fits?(a, out) and fits?(b, out)

  defp host_exact?(name, _out, a, b) when name in @comparison_ops do
    merged = Nx.Type.merge(a, b)
    fits?(a, merged) and fits?(b, merged)
  end

  defp host_exact?(_name, _out, _a, _b), do: false

  # Whether every value of integer type `from` is one of type `to`.
  defp fits?({kind, from}, {kind, to}), do: from <= to
  defp fits?({:u, from}, {:s, to}), do: from < to
  defp fits?(_from, _to), do: false

  defp host_integer?({kind, bits}) when kind in [:s, :u], do: bits >= 8 and not Types.emulated?({kind, bits})
  defp host_integer?(_type), do: false

  # Every input's bytes, or nil: a Moat input's only where a read of it may
  # take them (`host_bytes/1`: a released input must not lend its values to
  # a result that reads without a round trip), a small Nx.BinaryBackend
  # one's; bytes held for another type (Moat.Types retypes handles) do not
  # count.
  defp hosts([%T{type: {_, size}} = t | rest], acc) do
    bits = if match?(%__MODULE__{}, t.data), do: host_bytes(t), else: local(t)

    if is_bitstring(bits) and bit_size(bits) == size * Nx.size(t),
      do: hosts(rest, [bits | acc]),
      else: nil
  end

  defp hosts([], acc), do: Enum.reverse(acc)

  ## Reductions, cumulative ops and sorting

  for name <- [:sum, :product, :reduce_max, :reduce_min, :all, :any] do
    @impl true
    def unquote(name)(out, tensor, opts), do: op(out, unquote(name), [tensor], reduce_attrs(out, tensor, opts))
  end

  defp reduce_attrs(out, tensor, opts) do
    %{axes: opts[:axes] || Nx.axes(tensor), keep_axes: flag(opts[:keep_axes]), type: out.type}
  end

  for name <- [:argmax, :argmin] do
    @impl true
    def unquote(name)(out, tensor, opts) do
      axis = opts[:axis]
      keep = axis != nil and flag(opts[:keep_axis])
      attrs = %{axis: axis, tie_break: opts[:tie_break] || :low, keep_axes: keep, type: out.type}
      op(out, unquote(name), [tensor], attrs)
    end
  end

  @impl true
  def sort(out, tensor, opts) do
    op(out, :sort, [tensor], %{axis: opts[:axis], direction: opts[:direction] || :asc})
  end

  @impl true
  def argsort(out, tensor, opts) do
    op(out, :argsort, [tensor], %{axis: opts[:axis], direction: opts[:direction] || :asc, type: out.type})
  end

  ## Indexing

  # Indices are checked in the worker before MLX sees them; out-of-range
  # indices fail the op (Moat.Error when the result is read), as they raise
  # in Nx.BinaryBackend.

  @impl true
  def gather(out, tensor, indices, opts) do
    check_indices!(tensor, indices, opts[:axes])
    op(out, :gather, [tensor, indices], %{axes: opts[:axes]})
  end

  for name <- [:indexed_add, :indexed_put] do
    @impl true
    def unquote(name)(out, target, indices, updates, opts) do
      check_indices!(target, indices, opts[:axes])
      op(out, unquote(name), [target, indices, updates], %{axes: opts[:axes], type: out.type})
    end
  end

  # Indices whose values are here (see `host`) are checked at the call, with
  # Nx.BinaryBackend's message (axes counted in the index, the shape with
  # the indexed axes first); the others in the worker.
  defp check_indices!(tensor, %T{shape: index_shape} = indices, axes) do
    with bits when is_bitstring(bits) <- local(indices) do
      all = Nx.axes(tensor)
      axes = axes || all
      order = if List.starts_with?(all, axes), do: all, else: axes ++ (all -- axes)
      shape = List.to_tuple(for a <- order, do: elem(tensor.shape, a))
      dims = Tuple.to_list(shape)
      depth = elem(index_shape, tuple_size(index_shape) - 1)

      for index <- Enum.chunk_every(numbers(bits, indices.type), max(depth, 1)),
          {i, {dim, axis}} <- Enum.zip(index, Enum.with_index(dims)),
          i < 0 or i >= dim do
        raise ArgumentError, "index #{i} is out of bounds for axis #{axis} in shape #{inspect(shape)}"
      end
    end

    :ok
  end

  # Start indices may be scalar tensors (Nx's dynamic slices); the worker
  # clamps every start into the tensor, as Nx does.
  @impl true
  def slice(out, tensor, starts, lengths, strides) do
    {starts, tensors} = split_starts(starts)
    attrs = %{starts: starts, lengths: lengths, strides: strides}
    op(out, :slice, [tensor | tensors], attrs)
  end

  @impl true
  def put_slice(out, tensor, starts, slice) do
    {starts, tensors} = split_starts(starts)
    op(out, :put_slice, [tensor, slice | tensors], %{starts: starts, type: out.type})
  end

  # Integer starts travel as attributes, tensor starts as inputs (nil marks
  # their places).
  defp split_starts(starts) do
    {attrs, tensors} =
      Enum.map_reduce(starts, [], fn
        start, acc when is_integer(start) -> {start, acc}
        %T{} = start, acc -> {nil, [start | acc]}
      end)

    {attrs, Enum.reverse(tensors)}
  end

  ## Dot, convolution and linear algebra

  @impl true
  def dot(out, a, contract_a, batch_a, b, contract_b, batch_b) do
    attrs = %{contract_a: contract_a, batch_a: batch_a, contract_b: contract_b, batch_b: batch_b}
    op(out, :dot, [a, b], Map.put(attrs, :type, out.type))
  end

  # MLX convolves over 1 to 3 spatial axes.
  @impl true
  def conv(out, input, kernel, opts) when tuple_size(input.shape) in 3..5 do
    keys =
      [:strides, :input_dilation, :kernel_dilation, :feature_group_size, :batch_group_size] ++
        [:input_permutation, :kernel_permutation, :output_permutation]

    attrs = opts |> Keyword.take(keys) |> Map.new() |> Map.merge(%{padding: opts[:padding], type: out.type})
    op(out, :conv, [input, kernel], attrs)
  end

  def conv(out, input, kernel, opts), do: via_binary(:conv, out, [input, kernel, opts])

  # MLX solves real systems only.
  @impl true
  def triangular_solve(%T{type: {:c, _}} = out, a, b, opts),
    do: via_binary(:triangular_solve, out, [a, b, opts])

  def triangular_solve(out, a, b, opts) do
    attrs = %{left_side: flag(opts[:left_side]), lower: flag(opts[:lower]), transform_a: opts[:transform_a]}
    op(out, :triangular_solve, [a, b], Map.put(attrs, :type, out.type))
  end

  ## Windows

  for name <- [:window_sum, :window_product, :window_max, :window_min] do
    @impl true
    def unquote(name)(out, tensor, window_dimensions, opts) do
      op(out, unquote(name), [tensor], window_attrs(out, window_dimensions, opts))
    end
  end

  for name <- [:window_scatter_max, :window_scatter_min] do
    @impl true
    def unquote(name)(out, tensor, source, init_value, window_dimensions, opts) do
      attrs = window_attrs(out, window_dimensions, opts)
      op(out, unquote(name), [tensor, source, init_value], attrs)
    end
  end

  defp window_attrs(out, window_dimensions, opts) do
    %{
      window_dimensions: Tuple.to_list(window_dimensions),
      strides: opts[:strides],
      padding: opts[:padding],
      window_dilations: opts[:window_dilations] || List.duplicate(1, tuple_size(window_dimensions)),
      type: out.type
    }
  end

  # A user function cannot run in the worker. It runs on Nx.BinaryBackend,
  # with that as the default backend for the tensors it creates.
  @impl true
  def reduce(out, tensor, acc, opts, fun) do
    Nx.with_default_backend(Nx.BinaryBackend, fn ->
      via_binary(:reduce, out, [tensor, acc, opts, fun], backend_options(tensor))
    end)
  end

  @impl true
  def window_reduce(out, tensor, acc, window_dimensions, opts, fun) do
    Nx.with_default_backend(Nx.BinaryBackend, fn ->
      args = [tensor, acc, window_dimensions, opts, fun]
      via_binary(:window_reduce, out, args, backend_options(tensor))
    end)
  end

  defp backend_options(%T{data: %__MODULE__{ref: ref, device: device}}),
    do: [worker: ref.worker, device: device]

  defp backend_options(_tensor), do: []

  ## FFT

  for name <- [:fft, :ifft] do
    @impl true
    def unquote(name)(out, tensor, opts) do
      attrs = %{axis: opts[:axis], length: opts[:length], eps: opts[:eps], type: out.type}
      op(out, unquote(name), [tensor], attrs)
    end
  end

  ## Integer division and bit counts

  # Nx's semantics (truncating quotient, remainder with the dividend's sign)
  # are applied in the worker, which also keeps `MIN / -1` away from MLX.
  for name <- [:quotient, :remainder] do
    @impl true
    def unquote(name)(out, a, b), do: op(out, unquote(name), [a, b], %{type: out.type})
  end

  for name <- [:population_count, :count_leading_zeros] do
    @impl true
    def unquote(name)(out, tensor), do: op(out, unquote(name), [tensor], %{type: out.type})
  end

  ## Blocks

  # Nx.block/4 structs (linear algebra, cumulative ops, take, top_k, fft2...)
  # run natively as one worker op each where `native_block/3` has a clause;
  # otherwise Nx's default implementation runs, built from the callbacks above.
  # Types MLX does not have: a block runs Nx's default implementation
  # (its callbacks emulate f8 and sub-byte integers), or, with complex128,
  # on Nx.BinaryBackend.
  @impl true
  def block(struct, output, args, fun) do
    if Moat.Quantized.any?(args),
      do: Moat.Quantized.callback(__MODULE__, &op/4, :block, struct, [output, args, fun]),
      else: routed_block(struct, output, args, fun)
  end

  defp routed_block(struct, output, args, fun) do
    case Types.route(:block, output, args) do
      :native -> native_or_default(struct, output, args, fun)
      :default -> apply(fun, [struct | args])
      :fallback -> block_via_binary(struct, output, args, fun)
    end
  end

  # Nx's default function builds its tensors on Nx.BinaryBackend too.
  defp block_via_binary(struct, output, args, fun) do
    Nx.with_default_backend(Nx.BinaryBackend, fn ->
      via_binary(:block, output, [struct, args, fun], home_options(args))
    end)
  end

  # A fallback's result goes to the worker of its first Moat input.
  defp home_options(args),
    do: args |> List.flatten() |> Enum.find(&match?(%T{data: %__MODULE__{}}, &1)) |> backend_options()

  defp native_or_default(struct, output, args, fun) do
    with :default <- native_block(struct, output, args) do
      apply(fun, [struct | args])
    end
  end

  @cumulative_blocks %{
    Nx.Block.CumulativeSum => :cumulative_sum,
    Nx.Block.CumulativeProduct => :cumulative_product,
    Nx.Block.CumulativeMin => :cumulative_min,
    Nx.Block.CumulativeMax => :cumulative_max
  }

  alias Nx.Block.LinAlg

  @doc false
  # The block as one worker op, or `:default` when Moat has none for it
  # (Moat.Compiler then lowers the block's default implementation).
  def native_block(%Nx.Block.LogicalNot{}, out, [t]), do: op(out, :logical_not, [t], %{type: out.type})

  def native_block(%Nx.Block.Phase{}, out, [t]), do: op(out, :phase, [t], %{type: out.type})

  def native_block(%Nx.Block.AllClose{} = o, out, [a, b]) do
    input_type =
      if Nx.Type.integer?(a.type) and Nx.Type.integer?(b.type),
        do: {:f, 64},
        else: Nx.Type.merge(a.type, b.type)

    attrs = %{input_type: input_type, rtol: o.rtol, atol: o.atol, equal_nan: flag(o.equal_nan), type: out.type}
    op(out, :all_close, [a, b], attrs)
  end

  def native_block(%block{axis: axis, reverse: reverse}, out, [t]) when is_map_key(@cumulative_blocks, block) do
    op(out, Map.fetch!(@cumulative_blocks, block), [t], %{axis: axis, reverse: flag(reverse), type: out.type})
  end

  def native_block(%Nx.Block.TopK{k: k}, {_, indices} = out, [t]) do
    multi_op(out, :top_k, [t], %{k: k, index_type: indices.type})
  end

  def native_block(%Nx.Block.Take{axis: axis}, out, [tensor, indices]),
    do: op(out, :take, [tensor, indices], %{axis: axis})

  def native_block(%Nx.Block.TakeAlongAxis{axis: axis}, out, [tensor, indices]),
    do: op(out, :take_along_axis, [tensor, indices], %{axis: axis})

  # MLX's decompositions are real (f32/f64); complex inputs take Nx's
  # default implementations (the last clause).
  def native_block(%LinAlg.QR{mode: mode, eps: eps}, {%T{type: {k, _}} = q, _} = out, [t]) when k != :c,
    do: multi_op(out, :qr, [t], %{mode: mode, eps: eps, type: q.type})

  def native_block(%LinAlg.Cholesky{}, %T{type: {k, _}} = out, [t]) when k != :c,
    do: op(out, :cholesky, [t], %{type: out.type})

  def native_block(%LinAlg.Eigh{eps: eps}, {%T{type: {k, _}}, v} = out, [t]) when k != :c,
    do: multi_op(out, :eigh, [t], %{eps: eps, type: v.type})

  def native_block(%LinAlg.SVD{full_matrices?: full}, {%T{type: {k, _}} = u, _, _} = out, [t])
      when k != :c,
      do: multi_op(out, :svd, [t], %{full_matrices: flag(full), type: u.type})

  def native_block(%LinAlg.LU{}, {p, %T{type: {k, _}} = l, _} = out, [t]) when k != :c,
    do: multi_op(out, :lu, [t], %{p_type: p.type, type: l.type})

  def native_block(%LinAlg.Solve{}, %T{type: {k, _}} = out, [a, b]) when k != :c,
    do: op(out, :solve, [a, b], %{type: out.type})

  def native_block(%LinAlg.Determinant{}, %T{type: {k, _}} = out, [t]) when k != :c,
    do: op(out, :determinant, [t], %{type: out.type})

  def native_block(%Nx.Block.FFT2{} = s, out, [t]),
    do: op(out, :fft2, [t], %{axes: s.axes, lengths: s.lengths, eps: s.eps, type: out.type})

  def native_block(%Nx.Block.IFFT2{} = s, out, [t]),
    do: op(out, :ifft2, [t], %{axes: s.axes, lengths: s.lengths, eps: s.eps, type: out.type})

  def native_block(%Nx.Block.RFFT{} = s, out, [t]),
    do: op(out, :rfft, [t], %{axis: s.axis, length: s.length, eps: s.eps, type: out.type})

  def native_block(%Nx.Block.IRFFT{} = s, out, [t]),
    do: op(out, :irfft, [t], %{axis: s.axis, length: s.length, eps: s.eps, type: out.type})

  # Moat.Quantized's ops; the packed weight is computed at once, so that the
  # dense one can be freed.
  def native_block(%Moat.Quantized.Op{name: :quantize, attrs: attrs}, out, [w]) do
    packed = op(out, :quantize, [w], attrs)
    unless Recorder.active?(), do: Moat.eval(ref(packed))
    packed
  end

  def native_block(%Moat.Quantized.Op{name: :dequantize, attrs: attrs}, out, [packed]),
    do: op(out, :dequantize, [packed], attrs)

  def native_block(%Moat.Quantized.Op{name: :gather_qmm, attrs: attrs}, out, args),
    do: op(out, :gather_qmm, args, attrs)

  # Moat.Fast's kernels (one `mlx::core::fast` op each).
  def native_block(struct, output, args), do: fast_block(struct, output, args)

  # Moat.Fast: one mlx::core::fast kernel each; Moat.Fast has converted the
  # inputs to the output type and checked their shapes. MLX's kernels compute
  # f64 in f32, so f64 takes the reference composition instead.
  defp fast_block(_struct, %T{type: {:f, 64}}, _args), do: :default

  defp fast_block(%Moat.Fast.RMSNorm{eps: eps}, out, args),
    do: op(out, :fast_rms_norm, args, %{eps: eps, type: out.type})

  defp fast_block(%Moat.Fast.LayerNorm{eps: eps}, out, args),
    do: op(out, :fast_layer_norm, args, %{eps: eps, type: out.type})

  defp fast_block(%Moat.Fast.Rope{positions: true}, _out, _args), do: :default

  defp fast_block(%Moat.Fast.Rope{} = r, out, args) do
    attrs = %{
      dims: r.dims,
      traditional: r.traditional,
      base: r.base,
      scale: r.scale,
      offset: r.offset,
      seq_axis: r.seq_axis,
      type: out.type
    }

    op(out, :fast_rope, args, attrs)
  end

  defp fast_block(%Moat.Fast.SDPA{scale: scale, causal: causal, extras: extras}, out, args),
    do: op(out, :fast_sdpa, args, %{scale: scale, causal: causal, extras: extras, type: out.type})

  defp fast_block(%Moat.KVCache.Write{axis: axis}, out, args), do: op(out, :kv_write, args, %{axis: axis})

  defp fast_block(_struct, _output, _args), do: :default

  ## Fallbacks

  @doc false
  # Runs `op` on Nx.BinaryBackend: inputs are read back, the result is
  # uploaded again. Emits [:moat, :fallback, :start | :stop | :exception] and
  # obeys `config :moat, fallback: :silent | :warn | :raise`.
  def via_binary(op, out, args, opts \\ []) do
    # Inside Moat.Compiler's lowering there is nothing to copy yet: the op
    # cannot be part of a program.
    if Recorder.active?(), do: Recorder.unsupported!(op)

    # Tensors in lists (concatenate's, a block's arguments) count too.
    tensors = for %T{} = t <- List.flatten(args), do: t
    meta = %{op: op, input_shapes: Enum.map(tensors, & &1.shape), input_types: Enum.map(tensors, & &1.type)}
    meta = if op == :block, do: Map.put(meta, :block, hd(args).__struct__), else: meta

    policy = Moat.Config.get(:fallback)
    fallback_policy(policy, op)

    :telemetry.span([:moat, :fallback], meta, fn ->
      args = Enum.map(args, &to_binary_backend/1)
      result = apply(Nx.BinaryBackend, op, binary_args(op, out, args))
      {from_binary_backend(result, opts), meta}
    end)
  end

  # Nx.BinaryBackend.block/4 takes the struct before the output.
  defp binary_args(:block, out, [struct, args, fun]), do: [struct, out, args, fun]

  defp binary_args(_op, out, args), do: [out | args]

  defp fallback_policy(:silent, _op), do: :ok

  defp fallback_policy(:warn, op) do
    key = {__MODULE__, :warned, op}

    unless :persistent_term.get(key, false) do
      :persistent_term.put(key, true)

      require Logger

      Logger.warning(
        "Moat.Backend: #{op} has no MLX implementation; it runs on Nx.BinaryBackend " <>
          "(inputs copied out of the worker and back; warned once per op)"
      )
    end
  end

  defp fallback_policy(:raise, op) do
    raise ArgumentError,
          "Moat.Backend: #{op} has no MLX implementation and `config :moat, fallback: :raise` forbids " <>
            "running it on Nx.BinaryBackend"
  end

  defp to_binary_backend(%T{data: %__MODULE__{}} = t), do: Nx.backend_copy(t, Nx.BinaryBackend)
  defp to_binary_backend(list) when is_list(list), do: Enum.map(list, &to_binary_backend/1)
  defp to_binary_backend(other), do: other

  defp from_binary_backend(%T{} = t, opts), do: Nx.backend_transfer(t, {__MODULE__, opts})

  defp from_binary_backend(tuple, opts) when is_tuple(tuple),
    do: tuple |> Tuple.to_list() |> Enum.map(&from_binary_backend(&1, opts)) |> List.to_tuple()

  ## Plumbing

  # Boolean options mean what they mean to Nx: nil and false are false,
  # anything else is true (Nx's own helpers pass `equal_nan: nil`).
  defp flag(value), do: value not in [nil, false]

  defp worker(opts), do: Keyword.get(opts, :worker, Moat.Worker)

  defp wrap(out, %Ref{} = ref, device) do
    %{out | data: %__MODULE__{ref: ref, device: device}}
  end

  # The device must be the one the worker runs its ops on (see its hello).
  defp device!(worker, opts) do
    info = Client.conn(worker).info
    # Workers older than the :device key ran every op on the CPU.
    running = Map.get(info, :device, :cpu)
    device = Keyword.get(opts, :device) || running

    cond do
      device == running ->
        device

      device not in info.devices ->
        raise ArgumentError,
              "Moat.Backend: device #{inspect(device)} is not available on worker #{inspect(worker)} " <>
                "(its MLX #{info.mlx} has #{inspect(info.devices)})"

      true ->
        raise ArgumentError,
              "Moat.Backend: worker #{inspect(worker)} runs its ops on #{inspect(running)}, not " <>
                "#{inspect(device)}; start one with {Moat.Worker, name: ..., device: #{inspect(device)}} " <>
                "and pass it as worker:"
    end
  end

  # MLX's CUDA backend has no float64: refuse it rather than narrow it.
  defp gpu_type!({:f, 64}, :gpu, op) do
    raise ArgumentError,
          "Moat.Backend: #{op} with type {:f, 64} on the GPU: MLX's CUDA backend has no float64 " <>
            "(use {:f, 32}, or a worker with device: :cpu)"
  end

  defp gpu_type!(_type, _device, _op), do: :ok

  defp ref(%T{data: %__MODULE__{ref: ref}}), do: ref

  defp ref(%T{data: %other{}}) do
    raise ArgumentError, "expected a Moat.Backend tensor, got one on #{inspect(other)}"
  end

  # Whether the tensor is in the worker `opts` names on this node (a stale
  # one counts: using it raises).
  defp here?(tensor, opts) do
    ref = ref(tensor)
    worker(opts) == ref.worker and not match?({:remote, _}, Handles.locate(ref))
  end

  # Sends one graph-building op and returns `out` bound to its result.
  # Types MLX does not have are held and computed as Moat.Types says.
  #
  # The common case first, in one pattern match: one or two inputs, Moat
  # tensors of one worker incarnation's handles (a Recorder slot is no
  # `Moat.Ref`), of types MLX has, an output type MLX has (so
  # `Moat.check_type!/1` would pass) and not f64 on the GPU (so `gpu_type!/3`
  # would pass). Anything else takes the clauses after these, which check
  # and raise as always.
  defp op(
         %T{type: type} = out,
         name,
         [%T{type: a_type, data: %__MODULE__{ref: %Ref{worker: worker} = a, device: device}}] = inputs,
         attrs
       )
       when is_map_key(@mlx_types, type) and is_map_key(@mlx_types, a_type) and
              (device == :cpu or type != {:f, 64}) do
    # Recording takes the tensors (a captured one becomes a program input),
    # not their handles.
    if Recorder.active?(),
      do: native_op(out, name, inputs, attrs),
      else: sent_op(out, name, worker, device, [a], attrs)
  end

  defp op(
         %T{type: type} = out,
         name,
         [
           %T{type: a_type, data: %__MODULE__{ref: %Ref{worker: worker} = a, device: device}},
           %T{type: b_type, data: %__MODULE__{ref: %Ref{worker: worker} = b}}
         ] = inputs,
         attrs
       )
       when is_map_key(@mlx_types, type) and is_map_key(@mlx_types, a_type) and
              is_map_key(@mlx_types, b_type) and (device == :cpu or type != {:f, 64}) do
    if Recorder.active?(),
      do: native_op(out, name, inputs, attrs),
      else: sent_op(out, name, worker, device, [a, b], attrs)
  end

  defp op(%T{type: type} = out, name, inputs, attrs) when type in @emulated do
    {result} = multi_op({out}, name, inputs, attrs)
    result
  end

  defp op(out, name, inputs, attrs) do
    if emulated_input?(inputs) do
      {result} = multi_op({out}, name, inputs, attrs)
      result
    else
      native_op(out, name, inputs, attrs)
    end
  end

  defp emulated_input?([%T{type: type} | _]) when type in @emulated, do: true
  defp emulated_input?([_ | rest]), do: emulated_input?(rest)
  defp emulated_input?([]), do: false

  # The common case, every input on one worker, skips multi_op's copying.
  # While Moat.Compiler lowers a graph, the op becomes a step of its program
  # instead (see Moat.Compiler.Recorder): the same name and attrs either way.
  defp native_op(
         %T{} = out,
         name,
         [%T{data: %__MODULE__{ref: %Ref{worker: worker}, device: device}} | _] = inputs,
         attrs
       ) do
    if Enum.all?(inputs, &match?(%T{data: %__MODULE__{ref: %Ref{worker: ^worker}}}, &1)) and
         not Recorder.active?() do
      Moat.check_type!(out.type)
      gpu_type!(out.type, device, name)
      sent_op(out, name, worker, device, Enum.map(inputs, &ref/1), attrs)
    else
      single_op(out, name, inputs, attrs)
    end
  end

  defp native_op(%T{} = out, name, inputs, attrs), do: single_op(out, name, inputs, attrs)

  # native_op's send, for handles `refs` of `worker` whose types op/4 has
  # checked.
  defp sent_op(out, name, worker, device, refs, attrs) do
    conn = Client.conn(worker)
    ids = Handles.ids!(conn, refs, name)
    id = Client.new_id()
    # The handle exists before the frame that defines its id (see multi_op).
    handle = Handles.ref(conn, id)
    Client.cast(conn, name, [id], ids, attrs)
    %{out | data: %__MODULE__{ref: handle, device: device}}
  end

  defp single_op(out, name, inputs, attrs) do
    {result} = native_multi_op({out}, name, inputs, attrs)
    result
  end

  # Sends one graph-building op that defines several tensors (a tuple of
  # templates, in the order the worker returns them). Inputs from other
  # backends or workers are copied into the worker of the first Moat input;
  # those copies are released once the op holds them.
  defp multi_op(outs, name, inputs, attrs) when is_tuple(outs) do
    if Enum.any?(Tuple.to_list(outs) ++ inputs, &(&1.type in @emulated)) do
      {worker, _device} = home(inputs)
      moved = Enum.map(inputs, &to_worker(&1, worker))
      Types.run(outs, name, moved, attrs, &checked_op/4)
    else
      native_multi_op(outs, name, inputs, attrs)
    end
  end

  # What Moat.Types sends: its inputs must hold MLX types.
  defp checked_op(outs, name, inputs, attrs) do
    Enum.each(inputs, &Moat.check_type!(&1.type))
    native_multi_op(outs, name, inputs, attrs)
  end

  defp native_multi_op(outs, name, inputs, attrs) when is_tuple(outs) do
    if Recorder.active?(),
      do: recorded(outs, name, inputs, attrs),
      else: sent(outs, name, inputs, attrs)
  end

  defp recorded(outs, name, inputs, attrs) do
    outs = Tuple.to_list(outs)
    Enum.each(outs, &Moat.check_type!(&1.type))
    # A program refuses what the eager op would (f64 on the GPU), while it is lowered.
    Enum.each(outs, &gpu_type!(&1.type, Recorder.device(), name))
    slots = Recorder.record(name, inputs, attrs, length(outs))
    outs |> Enum.zip_with(slots, &%{&1 | data: %__MODULE__{ref: &2}}) |> List.to_tuple()
  end

  defp sent(outs, name, inputs, attrs) do
    outs = Tuple.to_list(outs)
    Enum.each(outs, &Moat.check_type!(&1.type))
    {worker, device} = home(inputs)
    Enum.each(outs, &gpu_type!(&1.type, device, name))
    moved = Enum.map(inputs, &to_worker(&1, worker))
    conn = Client.conn(worker)
    ids = Handles.ids!(conn, Enum.map(moved, &ref/1), name)
    out_ids = Client.new_ids(length(outs))
    # Handles (and their release tokens) exist before the frame that defines
    # their ids: a process that dies in between leaves no tensor behind.
    refs = Enum.map(out_ids, &Handles.ref(conn, &1))
    Client.cast(conn, name, out_ids, ids, attrs)

    case for {m, i} <- Enum.zip(moved, inputs), m != i, do: ref(m).id do
      [] -> :ok
      copies -> Client.cast(conn, :release, [], copies, nil)
    end

    outs
    |> Enum.zip_with(refs, &%{&1 | data: %__MODULE__{ref: &2, device: device}})
    |> List.to_tuple()
  end

  defp home(inputs) do
    case Enum.find(inputs, &match?(%T{data: %__MODULE__{}}, &1)) do
      %T{data: %__MODULE__{ref: ref, device: device}} -> {ref.worker, device}
      nil -> {Moat.Worker, device!(Moat.Worker, [])}
    end
  end

  defp to_worker(%T{data: %__MODULE__{ref: %Ref{worker: worker}}} = t, worker), do: t
  defp to_worker(%T{} = t, worker), do: Nx.backend_copy(t, {__MODULE__, worker: worker})

  # Sends one op without inputs (creation) to the worker named in `opts`.
  defp create(%T{} = out, name, attrs, opts) do
    if Recorder.active?(),
      do: elem(recorded({out}, name, [], attrs), 0),
      else: sent_create(out, name, attrs, opts)
  end

  defp sent_create(out, name, attrs, opts) do
    device = device!(worker(opts), opts)
    gpu_type!(out.type, device, name)
    conn = Client.conn(worker(opts))
    id = Client.new_id()
    ref = Handles.ref(conn, id)
    Client.cast(conn, name, [id], [], attrs)
    wrap(out, ref, device)
  end

  ## Types MLX does not have

  # Every tensor callback first asks Moat.Types how to run with the types it
  # was given: natively (emulated types go through Moat.Types.run/5 in op/4)
  # or on Nx.BinaryBackend (complex128 beyond data movement).
  @unrouted [init: 1, from_binary: 3, constant: 3, eye: 2, iota: 3, to_binary: 2, inspect: 2] ++
              [backend_copy: 3, backend_transfer: 3, backend_deallocate: 1, to_pointer: 2] ++
              [from_pointer: 5, reduce: 5, window_reduce: 6, block: 4]

  # Callbacks whose leading arguments are tensors (the output first), by
  # how many, and whose other arguments never hold one (axes, shapes,
  # options of integers and booleans). Where those tensors are Moat tensors
  # that are not quantized and all of types MLX has, the checks below answer
  # :native without walking the arguments: one pattern match decides.
  @tensor_args Map.new(
                 (@unary_ops ++ @binary_ops ++ @comparison_ops) ++
                   [:left_shift, :right_shift, :atan2, :quotient, :remainder] ++
                   [:population_count, :count_leading_zeros, :as_type, :bitcast, :reshape],
                 &{&1, :all}
               )
               |> Map.merge(
                 Map.new(
                   [:squeeze, :broadcast, :transpose, :reverse, :sum, :product, :reduce_max] ++
                     [:reduce_min, :all, :any, :argmax, :argmin],
                   &{&1, 2}
                 )
               )

  for {name, arity} <- Nx.Backend.behaviour_info(:callbacks) -- @unrouted do
    args = Macro.generate_arguments(arity, __MODULE__)
    defoverridable [{name, arity}]

    if leading = @tensor_args[name] do
      {tensor_args, other_args} = Enum.split(args, if(leading == :all, do: arity, else: leading))
      [out_arg | input_args] = tensor_args
      types = Macro.generate_unique_arguments(length(tensor_args), __MODULE__)
      [out_type | input_types] = types

      patterns =
        [
          quote(do: %T{type: unquote(out_type)} = unquote(out_arg))
          | Enum.zip_with(input_args, input_types, fn arg, type ->
              quote(do: %T{type: unquote(type), data: %__MODULE__{quant: nil}} = unquote(arg))
            end)
        ] ++ other_args

      guard =
        types
        |> Enum.map(&quote(do: is_map_key(@mlx_types, unquote(&1))))
        |> Enum.reduce(&quote(do: unquote(&2) and unquote(&1)))

      @impl true
      def unquote(name)(unquote_splicing(patterns)) when unquote(guard), do: super(unquote_splicing(args))
    end

    @impl true
    def unquote(name)(unquote_splicing(args)) do
      [out | rest] = unquote(args)

      # A quantized weight is dequantized first, except where Moat.Quantized
      # has a quantized op (dot).
      if Moat.Quantized.any?(rest) do
        Moat.Quantized.callback(__MODULE__, &op/4, unquote(name), out, rest)
      else
        case Types.route(unquote(name), out, rest) do
          :native -> super(unquote_splicing(args))
          :fallback -> via_binary(unquote(name), out, rest, home_options(rest))
        end
      end
    end
  end
end

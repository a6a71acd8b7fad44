"""Type stub for the compiled ``edgepack.native._kernels`` (see native/src/module.cpp)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from edgepack.runtime_shim.errors import NumericError as NumericError

def quantize_int8_channel(
    w: npt.ArrayLike, *, threads: int = 2
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]: ...
def dequantize_int8_channel(
    codes: npt.NDArray[np.int8],
    scales: npt.NDArray[np.float32],
    *,
    out: npt.NDArray[np.float32] | None = None,
    threads: int = 2,
) -> npt.NDArray[np.float32]: ...
def quantize_int4_group(
    w: npt.ArrayLike, group_size: int, symmetric: bool, *, threads: int = 2
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float16], npt.NDArray[np.float16] | None]: ...
def dequantize_int4_group(
    codes: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float16],
    mins: npt.NDArray[np.float16] | None,
    group_size: int,
    *,
    out: npt.NDArray[np.float32] | None = None,
    threads: int = 2,
) -> npt.NDArray[np.float32]: ...
def cpu_features() -> dict[str, bool]: ...
def available_isas() -> list[str]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...

# ISA names: "scalar", "avx2", "avx512", "amx" (the avx512 kernels with the int8-activation
# GEMM on AMX-INT8 tiles, bit-identical to scalar), "neon".  EDGEPACK_ISA=<name> in the
# environment replaces the default pick at import (ImportError if not usable here).

# Status numbering of the kernels ({"ok": 0, "non_finite": 1, ...}); mirrored by
# edgepack.runtime_shim.errors.KernelStatus.  EncodingError raised here carries it as .code.
STATUS_CODES: dict[str, int]

# ======================================================================================
# Inference kernels (native/src/infer/, native/src/arch/<isa>/infer_<isa>.cpp)
# ======================================================================================
#
# Conventions
# -----------
# * Dtypes are exact: a wrong dtype raises TypeError, a wrong shape / layout / value
#   ValueError; nothing is silently converted or copied.  Activations are float32 and
#   C-contiguous unless a function says it accepts row-strided views.  Outputs are new
#   C-contiguous arrays unless `out=` is given (then it must be writeable, C-contiguous,
#   of the exact dtype and shape, and must not overlap the inputs except where noted).
# * The GIL is released while kernels run.  Work runs on one persistent pool
#   (set_threads); results are bit-identical for any thread count.  set_isa() switches
#   these kernels together with the quantization kernels above.
# * Activation quantization (quantize_act, rmsnorm_quant, swiglu_quant) follows
#   edgepack.format.codecs int8 rules per row and group of `group` columns:
#       d = max|x| / 127;  q = clip(rint(x * (1/d)), -127, 127)   (1/d = 0 when d == 0)
#   group = 0 means one scale per row (group = K).  Bit-identical on every ISA.
#   NaN/Inf in the values being quantized raises NumericError (nothing else is checked:
#   a scale > 65504 is the caller's overflow policy).
# * RMSNorm, SwiGLU, RoPE, attention are bit-identical across ISAs (canonical 16-lane
#   sums, no FMA, one exp polynomial) and within a few float32 ulp of float64 math.
# * matmuls: exact int32 block sums; float combination may differ between ISAs by at
#   most 1e-5 * sum|terms| (tested), except matmul_q8 on AVX-512 and NEON, which follows
#   the scalar reference's order and is bit-identical to it (tested); for one ISA a
#   token's row is bit-identical whether it is computed alone (GEMV) or within a batch
#   (GEMM).

# edgepack.runtime_shim.errors.NumericError (an EdgepackError and a FloatingPointError):
# .code (KernelStatus), .kind ("non_finite" | "scale_overflow"), .op ("quantize_act",
# "rmsnorm_quant", "swiglu_quant", "attention_decode", ...), .row (token), .col (element /
# kv head (k: h, v: n_kv_heads + h) / V group).
# (re-exported at the top of this stub).

def set_threads(n: int, spin_us: int | None = None) -> None:
    """Pool size (caller included; default min(hardware threads, 8)).  Workers spin
    `spin_us` microseconds (default 1000) after each job before sleeping, so a decode loop
    never pays a wake-up per op.  When other processes keep the cores busy the pool backs
    off to running jobs on the caller for a while (results are identical either way)."""

def get_threads() -> int: ...
def _read_probe(a: npt.NDArray[np.generic]) -> int:
    """Read every byte of a C-contiguous array with the pool (bandwidth probe)."""

# ---- elementwise ----------------------------------------------------------------------

def argmax_rows(x: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    """Each row's argmax as numpy's (the first maximum, or the first NaN): Stack.run's picks."""

def quantize_act(
    x: npt.NDArray[np.float32], group: int = 0
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """x [T, K] (row stride free) -> (q int8 [T, K], s float32 [T, K // group])."""

def rmsnorm(
    x: npt.NDArray[np.float32],
    w: npt.NDArray[np.float32],
    eps: float,
    out: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """y = (x * (1 / sqrt(mean(x^2) + eps))) * w.  x [T, K] (row stride free), w [K];
    out may be x itself (in place)."""

def rmsnorm_quant(
    x: npt.NDArray[np.float32], w: npt.NDArray[np.float32], eps: float, group: int = 0
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """quantize_act(rmsnorm(x, w, eps), group) bit for bit, in one pass over x."""

def swiglu(
    gate: npt.NDArray[np.float32],
    up: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """gate / (1 + exp(-gate)) * up.  gate, up [T, F], row-strided views allowed (e.g. the
    two halves of a fused [T, 2F] projection); out may be gate or up (contiguous)."""

def gated_act(
    gate: npt.NDArray[np.float32], up: npt.NDArray[np.float32], act: str
) -> npt.NDArray[np.float32]:
    """act(gate) * up for act "gelu" (exact, erf), "gelu_tanh" or "relu", as the numpy
    reference computes it: act in double, rounded to float32, times up (float32)."""

def swiglu_quant(
    gate: npt.NDArray[np.float32], up: npt.NDArray[np.float32], group: int = 0
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """quantize_act(swiglu(gate, up), group) bit for bit."""

def rope(
    x: npt.NDArray[np.float32],
    positions: npt.NDArray[np.integer],
    *,
    theta: float = 10000.0,
    inv_freq: npt.NDArray[np.float32] | None = None,
    cos: npt.NDArray[np.float32] | None = None,
    sin: npt.NDArray[np.float32] | None = None,
) -> None:
    """NeoX / rotate-half RoPE IN PLACE on x [T, H, D] (any token stride, [H, D] contiguous
    per token: a reshaped view of a fused qkv output works).  For i < D/2 with c, s of
    angle a = float32(positions[t]) * inv_freq[i]:
        x[i] <- x[i] c - x[i + D/2] s;   x[i + D/2] <- x[i + D/2] c + x[i] s.
    Angles: given tables cos/sin [P, D/2] (row positions[t]); else inv_freq [D/2] (e.g.
    Llama-3 scaled frequencies computed by the caller); else theta ** (-2i/D) rounded
    once to float32.  cos/sin of the float32 angle are evaluated in double.  For prefill
    pass tables (computing sin/cos per call costs ~T*D/2 libm calls)."""

def rope_table(
    positions: npt.NDArray[np.integer],
    head_dim: int,
    *,
    theta: float = 10000.0,
    inv_freq: npt.NDArray[np.float32] | None = None,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """(cos, sin) float32 [len(positions), head_dim // 2] as rope() computes them."""

# ---- matmuls ----------------------------------------------------------------------------

class Weight:
    """A weight matrix [N, K] validated once and bound without copying (keeps the numpy
    parts alive, e.g. views of a package's read-only mmap).  Parts are exactly the
    package's stored layout (edgepack.format.layout):
        "f32"  codes float32 [N, K]        "f16" codes float16 [N, K]
        "bf16" codes uint16 [N, K]          (bf16 bits)
        "int8" codes int8 [N, K], scales float32 [N]                w = c * s[n]
        "int4_sym"  codes uint8 [N, K/2] (low nibble = even k), scales float16 [N, K/g]
                                                                     w = (nib - 8) * d
        "int4_asym" + zeros (mins) float16 [N, K/g]                  w = nib * d + m
    encoding may also be the edgepack.format.Encoding value (0, 1, 2, 10, 20, 21).
    group: the int4 group g (multiple of 8 dividing K); 0 otherwise.  int8 needs K <= 65536."""

    def __init__(
        self,
        codes: npt.NDArray[np.generic],
        scales: npt.NDArray[np.generic] | None = None,
        zeros: npt.NDArray[np.float16] | None = None,
        encoding: str | int = "f32",
        group: int = 0,
    ) -> None: ...
    @property
    def shape(self) -> tuple[int, int]: ...
    @property
    def encoding(self) -> str: ...
    @property
    def group(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Weight bytes one full matmul reads (codes + scales + zeros)."""
    def q8_prep_bytes(self, act_group: int) -> int:
        """Bytes per token the active kernels lay an int8 input of ``act_group`` out in
        before their matmul (0: they read it as it is); decoder_layer's ``*.prep`` slot."""

def linear_q8(
    xq: npt.NDArray[np.int8],
    xs: npt.NDArray[np.float32],
    act_group: int,
    w: Weight,
    residual: npt.NDArray[np.float32] | None = None,
    out: npt.NDArray[np.float32] | None = None,
    *,
    bias: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """int8-activation x integer-weight GEMV (T = 1) / GEMM (T > 1) -> float32 [T, N]:
        y = sum over blocks b of (xs[t, b] * scale_w[n, b]) * isum_b  (+ asym: m * sum x)
    with isum_b the exact int32 dot of block b (act_group for int8 weights,
    min(act_group, g) for int4; the two groups must divide one another), then
    y = (y + bias[n]) + residual[t, n].  xq [T, K] C-contiguous with values in
    [-127, 127] (as quantize_act makes them; -128 is rejected), xs [T, K // act_group]
    (act_group 0 = K).  out may be residual itself (in-place residual add).
    Fast paths: K, act_group and g multiples of 32 (else the portable kernel)."""

def linear_f32(
    x: npt.NDArray[np.float32],
    w: Weight,
    residual: npt.NDArray[np.float32] | None = None,
    out: npt.NDArray[np.float32] | None = None,
    *,
    bias: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """Float-activation matmul (the precision fallback, and f32/f16/bf16 weights):
    y = x @ dequantize(W).T (+ bias) (+ residual), weights dequantized in registers
    exactly as edgepack.format.codecs does (int8: scale applied once per row)."""

def matmul_q8(
    xq: npt.NDArray[np.int8],
    xs: npt.NDArray[np.float32],
    act_group: int,
    w_codes: npt.NDArray[np.generic],
    w_scales: npt.NDArray[np.generic] | None,
    w_zeros: npt.NDArray[np.float16] | None,
    weight_encoding: str | int,
    w_group: int,
    residual: npt.NDArray[np.float32] | None = None,
    out: npt.NDArray[np.float32] | None = None,
    *,
    bias: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """linear_q8 with the weight given as parts (validated on every call)."""

def matmul_f32(
    x: npt.NDArray[np.float32],
    w_codes: npt.NDArray[np.generic],
    w_scales: npt.NDArray[np.generic] | None = None,
    w_zeros: npt.NDArray[np.float16] | None = None,
    weight_encoding: str | int = "f32",
    w_group: int = 0,
    residual: npt.NDArray[np.float32] | None = None,
    out: npt.NDArray[np.float32] | None = None,
    *,
    bias: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """linear_f32 with the weight given as parts."""

def lowrank(
    x: npt.NDArray[np.float32],
    u: Weight,
    v: Weight,
    residual: npt.NDArray[np.float32] | None = None,
    out: npt.NDArray[np.float32] | None = None,
    *,
    bias: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """y = U (V x) (+ bias) (+ residual) in one call: V [r, K], U [N, r] (any encodings);
    the [T, r] intermediate stays native."""

# ---- paged, quantized KV cache + attention ------------------------------------------------
#
# Memory layout (one layer; NB blocks of BS positions, H = n_kv_heads, D = head_dim):
#     k_cache  int8    [NB, BS, H, D]       k = k_cache * k_scale
#     k_scale  float32 [NB, BS, H]          one scale per token per head (d = max|k| / 127)
#     v_cache  uint8   [NB, BS, H, D // 2]  int4, low nibble = even element of D
#     v_scale  float16 or float32 [NB, BS, H, D // g]
#                                           v = (nib - 8) * v_scale, group g along D,
#                                           d = peak / -8 (+0), peak = first max-|v| value
#                                           (codecs int4-sym rule; rounded to float16 when
#                                           the scale pool is float16)
# The int5-V layout ("int8-v5" of runtime_shim.kv_cache.KV_LAYOUTS) is chosen by a
# float16 k_scale and a float16 v_scale and adds the keyword arrays v_high and v_mins:
#     k_scale  float16 [NB, BS, H]          d = f16(max|k| / 127), k = q * d
#     v_cache  uint8   [NB, BS, H, D // 2]  low 4 bits of c, low nibble = even element
#     v_high   uint8   [NB, BS, H, D // 8]  bit 4 of c for element i: bit i % 8 of byte i // 8
#     v_scale, v_mins float16 [NB, BS, H, D // g]
#                                           v = c * v_scale + v_mins, group g along D,
#                                           m = f16(min), d = f16((max - m) / 31),
#                                           c = clip(rint((v - m) * (1/d)), 0, 31)
# The int6-V layout ("int8", with rotate=True) is chosen by a float16 k_scale and a uint8
# v_scale and adds v_high (no v_mins):
#     v_cache  uint8   [NB, BS, H, D // 2]  low 4 bits of c, low nibble = even element
#     v_high   uint8   [NB, BS, H, D // 4]  bits 4-5 of c for element i: bits 2 (i % 4),
#                                           2 (i % 4) + 1 of byte i // 4
#     v_scale  uint8   [NB, BS, H, D // g]  d = the float16 with bits v_scale << 7
#                                           (f16(max|v| / 31) rounded up to 8 bits),
#                                           v = (c - 32) * d, c = clip(rint(v/d), -31, 31) + 32
# A float cache is k_cache, v_cache float32 [NB, BS, H, D] with k_scale = v_scale = None.
# block_table: int32 [n] — logical block i of the sequence is physical block
# block_table[i]; position p lives at (block_table[p // BS], p % BS).  All pool arrays
# must be writeable and C-contiguous (a per-layer view [l] of a [L, NB, BS, H, D] pool
# is).  The V group g = D // v_scale.shape[3] must be a multiple of 8.  rotate=True (layout
# "int8"): the cache holds the orthonormal Walsh-Hadamard rotation of K and V along D (in
# blocks of the largest power of two dividing D; runtime_shim.kv_cache.rotate_heads):
# kv_write rotates before quantizing, attention rotates q and its output, kv_read rotates
# back.  Blocks may be shared between sequences (prefix sharing): the kernels only write
# positions >= start_pos.

def kv_write(
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.generic],
    k_scale: npt.NDArray[np.float32] | None,
    v_cache: npt.NDArray[np.generic],
    v_scale: npt.NDArray[np.generic] | None,
    block_table: npt.NDArray[np.int32],
    start_pos: int,
    *,
    v_high: npt.NDArray[np.uint8] | None = None,
    v_mins: npt.NDArray[np.float16] | None = None,
    rotate: bool = False,
) -> None:
    """Quantize-on-write T tokens k, v [T, H, D] at positions start_pos.. (all or
    nothing: NumericError before any write on NaN/Inf or a float16 V-scale overflow)."""

def attention_decode(
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.generic],
    k_scale: npt.NDArray[np.float32] | None,
    v_cache: npt.NDArray[np.generic],
    v_scale: npt.NDArray[np.generic] | None,
    block_table: npt.NDArray[np.int32],
    pos: int,
    *,
    scale: float | None = None,
    out: npt.NDArray[np.float32] | None = None,
    v_high: npt.NDArray[np.uint8] | None = None,
    v_mins: npt.NDArray[np.float16] | None = None,
    rotate: bool = False,
    window: int = 0,
    softcap: float = 0.0,
) -> npt.NDArray[np.float32]:
    """One token: writes k, v ([H, D] or [1, H, D]) at `pos` (quantize on write), then
    q [n_heads, D] (or [1, n_heads, D]) attends over positions 0..pos of the dequantized
    cache: softmax((q . k_p) * scale) v_p, scale default 1/sqrt(D); softcap > 0 maps each
    score s to softcap * tanh(s / softcap) first; window > 0 keeps only positions
    > pos - window.  GQA: query head h reads kv head h // (n_heads // H).  Returns
    [n_heads, D]."""

def attention_prefill(
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.generic],
    k_scale: npt.NDArray[np.float32] | None,
    v_cache: npt.NDArray[np.generic],
    v_scale: npt.NDArray[np.generic] | None,
    block_table: npt.NDArray[np.int32],
    start_pos: int,
    *,
    scale: float | None = None,
    out: npt.NDArray[np.float32] | None = None,
    v_high: npt.NDArray[np.uint8] | None = None,
    v_mins: npt.NDArray[np.float16] | None = None,
    rotate: bool = False,
    window: int = 0,
    softcap: float = 0.0,
) -> npt.NDArray[np.float32]:
    """T tokens (q [T, n_heads, D], k/v [T, H, D], token-strided views allowed): writes
    positions start_pos..start_pos+T-1, then causal attention (query t sees positions
    <= start_pos + t), reading every position back from the cache.  Bit-identical to T
    successive attention_decode calls.  Returns [T, n_heads, D]."""

def kv_read(
    k_cache: npt.NDArray[np.generic],
    k_scale: npt.NDArray[np.float32] | None,
    v_cache: npt.NDArray[np.generic],
    v_scale: npt.NDArray[np.generic] | None,
    block_table: npt.NDArray[np.int32],
    length: int,
    *,
    v_high: npt.NDArray[np.uint8] | None = None,
    v_mins: npt.NDArray[np.float16] | None = None,
    rotate: bool = False,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Dequantized (k, v) float32 [length, H, D] of positions 0..length-1."""

# ---- whole layer ----------------------------------------------------------------------

# The fallback reasons decoder_layer returns, by stable code (native/src/infer/fallback.h);
# mirrored by edgepack.runtime_shim.kernels.Fallback.
FALLBACK_REASONS: dict[int, str]
# decoder_layer applies ctx.lora itself (runtime_shim.adapters.LayerLora: per slot a LoraPair,
# A as stored, int8/f16/f32 [r, K]; B^T int8 [r, N] with per-output scales, or float32)
DECODER_LAYER_LORA: bool

def decoder_layer(
    lw: object, x: npt.NDArray[np.float32], ctx: object
) -> tuple[npt.NDArray[np.float32] | None, str | None]:
    """One Llama decoder layer per call over pre-bound weights: the contract of
    edgepack.runtime_shim.kernels.Kernels.decoder_layer, op for op the same as its
    composite layer built from the functions above (tested bit-identical).
    lw: attn_norm, ffn_norm float32 [hidden]; q, k, v, o, gate, up, down with .native
    (a Weight) or .factors (U, V with .native), .bias (float32 [N] | None),
    .is_quantized, .act_group, .rows; .qkv_group / .gate_up_group (int | None); optional
    (missing or None: the plain Llama layer) .q_norm / .k_norm float32 [head_dim] (per-head
    RMSNorm of q and k before RoPE), .attn_post_norm / .ffn_post_norm float32 [hidden]
    (x + rmsnorm(projection) instead of x + projection).
    ctx: num_heads, num_kv_heads, head_dim, eps, cos, sin (float32 [T, head_dim/2]),
    positions (consecutive), n_ctx (= positions[-1] + 1), block_table, act_int8,
    kv (.mode "float", or "int8-legacy" / "int8-v5" / "int8" with .v_group a multiple of
    8, .k, .k_scales, .v, .v_scales, for the int5 ones .v_high, .v_mins, and .layout.rotate);
    optional: activation ("silu", "gelu", "gelu_tanh", "relu"), window, attn_scale,
    attn_softcap (None: none; as attention_prefill's window / scale / softcap), arena (a
    LayerArena: every buffer at its planned offset; None: each in its own region).
    x [T, hidden] float32.  Returns (x_out, None) on success; on the int8-activation
    path (None, "activation scale overflow (<where>)") / (None, "non-finite K/V") ask for
    a float recompute, and (x_out, "non-finite layer output") flags the output; any other
    KV layout (runtime_shim.kv_cache.KV_LAYOUTS) returns (None, "KV cache layout not in
    the native kernels") before doing anything, for the caller to run the layer itself.
    Raises TypeError when an object lacks an attribute or a native Weight (call bind
    first), NumericError for non-finite K/V on the float path."""

class LayerArena:
    """The one activation buffer of decoder_layer (ctx.arena), allocated at construction,
    with the memory plans of runtime_shim.memory_plan: [(tokens, {slot: (offset, size)})],
    offsets 64-byte aligned inside nbytes; a call of T tokens uses the smallest plan with
    tokens >= T (none: ValueError).  A slot the layer takes beyond its size: ValueError."""

    SLOTS: tuple[str, ...]  # the slot names, in the native enum's order (layer_arena.h)
    def __init__(
        self, nbytes: int, plans: list[tuple[int, dict[str, tuple[int, int]]]]
    ) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...

class Stack:
    """The whole forward of a chunk in one call, over weights read and validated once
    (layers as decoder_layer's lw, ctx for the heads, final norm float32 [hidden], eps,
    head: a Linear as decoder_layer's q, or None); the weights must not change after."""

    def __init__(
        self, layers: Sequence[object], ctx: object, norm: npt.NDArray[np.float32], eps: float,
        head: object | None = None,
    ) -> None: ...
    def run(
        self,
        x: npt.NDArray[np.float32],
        ctx: object,
        kvs: Sequence[object],
        windows: Sequence[int | None],
        head: bool = True,
        loras: Sequence[object | None] | None = None,
        rows: int = 1,
        picks: npt.NDArray[np.int64] | None = None,
    ) -> tuple[npt.NDArray[np.float32], int, str | None, npt.NDArray[np.float32] | None]:
        """decoder_layer(layers[i], x_i, ctx with kvs[i] and windows[i]) in turn, then the
        final RMSNorm and (head) the logits [rows, vocab] of the last ``rows`` rows (1..T;
        their float32 argmax, numpy's, into ``picks``: int64 [rows], when given and the
        head ran), the GIL released once for all of it; loras[i]: layer i's adapter
        (LayerLora or None; ctx.lora is not read, and must be None without loras).
        Returns (x_normed, len(layers), None, logits | None) when every layer ran (logits
        None without a head or when its int8 input overflows: the caller's head runs
        then), else (x_in_of_layer_d, d, reason, None): layer d asked for a fallback
        (decoder_layer's reasons, kv_layout included) and the caller runs layers d..
        itself."""

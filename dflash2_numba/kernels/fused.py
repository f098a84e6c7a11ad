"""The fused CPU engine: ONE numba call per decoder layer (Qwen3 / Llama targets, DFlash and
DFlash2 draft layers), instead of ~15 kernel calls with numpy glue between them.

    decoder_layer(h [n, H] f32 (updated in place), weights, norms, conv, kbuf, vbuf,
                  start, q_pos [n], k_pos [T], cos [n, hd], sin [n, hd], layer_args)

One layer, pre-norm (spec §2.1; the draft's conv call sites of spec §4.1 when `conv` is given):
    a = rms(h, ln1);  a, d1 = conv_prepare(a)                       (DFlash2 only)
    q, k, v = a Wq^T, a Wk^T, a Wv^T;  q, k = rope(qk_norm(q, k))      (qk norm: Qwen3, drafts)
    K/V of the n rows -> kbuf / vbuf at positions start..start+n-1
    h = h + conv_finish(attention(q, K, V) Wo^T, d1)
    m = rms(h, ln2);  m, d2 = conv_prepare(m)
    h = h + conv_finish(down(silu(m Wg^T) * (m Wu^T)), d2)

It is the op-by-op path (families/qwen3.py `_layer`, models/draft.py `block_forward`) with the
Python between the kernels removed, and it calls THE SAME kernels in the same order: the panel
GEMV of kernels/panels.py, RMSNorm / RoPE / SwiGLU of kernels/rowwise.py, attention of
kernels/attention.py, the grouped conv of kernels/conv.py. So its output is bit-identical to
the op-by-op path in both run modes (f32; bf16 with the per-op rounding of spec §6), which
stays the reference it is tested against (tests/test_fused.py, array_equal).

Threads: each product (GEMV, attention) is split over numba's threads inside this call when it
is at least `par_min_macs` multiply-adds (the measured threshold of kernels/linear.py, or
"never" with one thread); everything else runs on the calling thread.

Compile time (docs/cold_start.md): the run mode (f32 / bf16) and "may any product go parallel"
are compile-time constants of the kernel, not arguments: `decoder_layer` / `context_update`
pick one of up to four variants (`_layer_kernel(bf16, parallel)`), each a closure over two
bools that numba's dead-branch pruning folds before typing. So a one-thread f32 run never
types, let alone compiles, the bf16 rounding loops, the bf16 conv or the parallel (parfor)
drivers of the GEMV and attention, which were more than half of a cold start. The variants run
the same code on the same kernels as before: the same bits.

Rows: 1..GEMV_MAX_ROWS (decode, verify, draft block). A longer prefill takes the op-by-op path
(the same panel GEMV, any row count). Weights: bf16 packed into panels (kernels/panels.py);
a float32 checkpoint runs op by op. A new layer kind (the hybrid targets' Gated DeltaNet)
slots in as another fused layer function beside this one.
"""

import functools

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from ..numerics import bf16_to_f32, f32_to_bf16, kv_store, round_bf16
from .attention import NO_SINKS, _attention_par, _attention_ser
from .conv import _grouped_conv_bf16, _grouped_conv_f32, uses_and_arm
from .linear import GEMV_MAX_ROWS
from ..quant.weights import gemv_weights, in_features, panel_columns, weight_size
from .panels import group_panels
from .rowwise import _rms_norm_rows, _rope_rows, _swiglu_rows

NEVER = np.iinfo(np.int64).max  # par_min_macs with one thread: no product goes parallel
NO_CONV = (np.empty((0, 0, 32), np.uint16),) * 2 + (np.empty((0, 0, 0), np.float32),) * 2  # v1 / targets


def parallel_min_macs() -> int:
    """The size from which a product is split over threads: the GEMV's measured threshold when
    numba runs more than one thread, else never (read at every call: tests and the warm-up
    lower the threshold to reach the parallel drivers)."""
    from . import linear

    return linear.PARALLEL_MIN_MACS if linear.threads_now() > 1 else NEVER


# ------------------------------------------------------------------ pieces
@intrinsic
def _runtime_bool(typingctx, flag):
    """flag as a plain bool. A variant's closure constant reaches a called kernel as
    Literal[bool], which numba would compile as a SECOND specialisation beside the bool one the
    op-by-op path uses; passed through this, the fused layer and the op-by-op path share one."""
    if not isinstance(flag, (types.Boolean, types.BooleanLiteral)):
        return None

    def codegen(context, builder, signature, args):
        return context.cast(builder, args[0], signature.args[0], types.boolean)

    return types.boolean(flag), codegen


# The bf16-mode loops below are CALLED (plain @njit, compiled once in a bf16 variant), not
# written into the inlined pieces: numba expands every inlined call before it prunes the dead
# branches, so in an f32 variant each inlined copy of the rounding helpers was expanded for
# nothing (~80 expansions a layer). A call or an inlined copy gives the same bits.
@njit(nogil=True)
def _round_in_place(x):
    """x = rnd(x) elementwise; x C-contiguous, any rank."""
    flat = x.reshape(x.size)
    for i in range(flat.size):
        flat[i] = round_bf16(flat[i])


@njit(nogil=True)
def _add_residual_bf16(h, y):
    """h = rnd(h + y) in place; h, y [n, H]."""
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[i, j] = round_bf16(h[i, j] + y[i, j])


@njit(nogil=True)
def _conv_bf16(x, delta, base, out, group_size, block_len, and_arm):
    """out [n, H] f32 = the bf16 kernel on x [n, H], delta [n, taps, G] (f32, rounded to bf16
    bits here) and base [taps, H] (bf16 bits)."""
    n, H = x.shape
    xb = np.empty((n, H), np.uint16)  # the kernel takes all-bf16 bits in bf16 mode
    for i in range(n):
        for c in range(H):
            xb[i, c] = f32_to_bf16(x[i, c])
    db = np.empty(delta.shape, np.uint16)
    for i in range(delta.shape[0]):
        for t in range(delta.shape[1]):
            for g in range(delta.shape[2]):
                db[i, t, g] = f32_to_bf16(delta[i, t, g])
    ob = np.empty((n, H), np.uint16)
    _grouped_conv_bf16(xb, db, base, ob, group_size, block_len, and_arm)
    for i in range(n):
        for c in range(H):
            out[i, c] = bf16_to_f32(ob[i, c])


@njit(inline="always")
def _rnd(x, bf16):
    """x = rnd(x) in place in bf16 mode (x C-contiguous, any rank); nothing in f32 mode."""
    if bf16:
        _round_in_place(x)


@njit(inline="always")
def _linear(x, panels, N, par_min_macs, parallel, bf16):
    """rnd?(x @ w.T): x [M, K] f32, w [N, K] given as its panels [NP, K, 32] -> [M, N] f32,
    with the kernel ops.linear runs on a packed weight (kernels/panels.py). parallel: a
    compile-time constant; False = the parallel driver is never typed (a literal False argument
    prunes gemv_weights' branch to it). Quantized panels (quant/weights.py) take the same call."""
    y = np.empty((x.shape[0], N), np.float32)  # [M, N]
    if parallel:
        gemv_weights(x, panels, y, x.shape[0] * N * x.shape[1] >= par_min_macs)
    else:
        gemv_weights(x, panels, y, False)
    _rnd(y, bf16)
    return y


@njit(inline="always")
def _rms(x, w, eps, bf16):
    """RMSNorm over the last axis of x [rows, D] -> new [rows, D]."""
    out = np.empty(x.shape, np.float32)
    _rms_norm_rows(x, w, eps, _runtime_bool(bf16), out)
    return out


@njit(inline="always")
def _add_residual(h, y, bf16):
    """h = rnd?(h + y) in place; h, y [n, H]."""
    if bf16:
        _add_residual_bf16(h, y)
        return
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[i, j] = h[i, j] + y[i, j]


@njit(inline="always")
def _conv(x, delta, base, group_size, block_len, and_arm, bf16):
    """The grouped dynamic conv (spec §4.2) on x [n, H] with delta [n, taps, G] and base
    [taps, H] (f32, or bf16 bits in bf16 mode) -> [n, H] f32, as DFlash2Draft._conv."""
    out = np.empty(x.shape, np.float32)  # [n, H]
    if bf16:
        _conv_bf16(x, delta, base, out, group_size, block_len, and_arm)
    else:
        _grouped_conv_f32(x, delta, base, out, group_size, block_len, and_arm)
    return out


@njit(inline="always")
def _conv_prepare(x, proj, base, taps, group_size, block_len, and_arm, par_min_macs, parallel, bf16):
    """-> (conv(x, delta[:, 0], base[0]), delta[:, 1]) with delta = rnd?(x proj^T) viewed
    [n, side, tap, group]: DFlash2Draft.conv_prepare. proj: panels of [2*taps*G, H]."""
    n = x.shape[0]
    delta = _linear(x, proj, 2 * taps * (x.shape[1] // group_size), par_min_macs, parallel, bf16)  # [n, 2*taps*G]
    delta = delta.reshape(n, 2, taps, delta.shape[1] // (2 * taps))  # [n, side, tap, group]
    # C-contiguous copies, as kernels/conv.grouped_conv makes: one kernel specialisation
    return (_conv(x, np.ascontiguousarray(delta[:, 0]), base[0], group_size, block_len, and_arm, bf16),
            np.ascontiguousarray(delta[:, 1]))


@njit(inline="always")
def _attention(q, kbuf, vbuf, q_pos, k_pos, first, causal, window, par_min_macs, parallel, bf16):
    """kernels/attention.attention on q [n, nh, hd] over rows first..T-1 of kbuf / vbuf
    (parallel: compile-time constant, as in `_linear`)."""
    out = np.empty(q.shape, np.float32)
    T = k_pos.shape[0]
    if parallel and q.size * T >= par_min_macs:
        _attention_par(q, kbuf, vbuf, q_pos, k_pos, first, T, causal, window, _runtime_bool(bf16), NO_SINKS, out)
    else:
        _attention_ser(q, kbuf, vbuf, q_pos, k_pos, first, T, causal, window, _runtime_bool(bf16), NO_SINKS, out)
    return out


@njit(inline="always")
def _write_kv(kbuf, vbuf, start, k, v):
    """K/V of row i (k, v [n, nkv, hd]) at position start+i of kbuf / vbuf [nkv, T, hd]
    (f32, or bf16 bits rounded to nearest even: --kv-dtype bf16)."""
    n, nkv, hd = k.shape
    for i in range(n):
        for g in range(nkv):
            for j in range(hd):
                kbuf[g, start + i, j] = kv_store(kbuf, k[i, g, j])
                vbuf[g, start + i, j] = kv_store(vbuf, v[i, g, j])


# ------------------------------------------------------------------ the layer
@njit(inline="always")
def attention_half(h, wqkv, wo, ln1, q_norm, k_norm, att_proj, att_base, kbuf, vbuf, start, q_pos, k_pos, cos, sin,
                   nh, nkv, hd, conv_shape, k_at, v_at, causal, window, eps, par_min_macs, parallel, bf16, first):
    """h = h + conv_finish(attention(rope(qk_norm(q, k)), K, V) Wo^T) with q, k, v from
    conv_prepare(rms(h, ln1)) (no conv when att_proj is empty), in place on h [n, H]; writes
    the block's K/V into kbuf / vbuf. The first half of every fused layer (the MoE layer of
    kernels/fused_moe.py too). conv_shape = (taps, group_size, block_len, and_arm), zeros without
    the conv. Keys: rows first..len(k_pos)-1 of kbuf / vbuf (first > 0: the draft window)."""
    n, H = h.shape
    taps, group_size, block_len, and_arm = conv_shape
    has_conv = weight_size(att_proj) > 0
    if start + n > kbuf.shape[1] or start + n > vbuf.shape[1] or k_pos.shape[0] > kbuf.shape[1]:
        raise ValueError("decoder_layer: the K/V buffer has no room for the block (reserve first)")
    a = _rms(h, ln1, eps, bf16)  # [n, H]
    if has_conv:
        a, d_att = _conv_prepare(a, att_proj, att_base, taps, group_size, block_len, and_arm != 0,
                                 par_min_macs, parallel, bf16)
    qkv = _linear(a, wqkv, panel_columns(wqkv), par_min_macs, parallel, bf16)  # [n, q | k | v padded]
    q = np.ascontiguousarray(qkv[:, :nh * hd]).reshape(n * nh, hd)  # [n*nh, hd]
    k = np.ascontiguousarray(qkv[:, k_at:k_at + nkv * hd]).reshape(n * nkv, hd)  # [n*nkv, hd]
    v = np.ascontiguousarray(qkv[:, v_at:v_at + nkv * hd]).reshape(n, nkv, hd)  # [n, nkv, hd]
    if q_norm.size > 0:  # per-head RMSNorm over hd, before RoPE
        q = _rms(q, q_norm, eps, bf16)
        k = _rms(k, k_norm, eps, bf16)
    qr = np.empty((n, nh, hd), np.float32)  # [n, nh, hd]
    kr = np.empty((n, nkv, hd), np.float32)  # [n, nkv, hd]
    _rope_rows(q.reshape(n, nh, hd), cos, sin, _runtime_bool(bf16), qr)
    _rope_rows(k.reshape(n, nkv, hd), cos, sin, _runtime_bool(bf16), kr)
    _write_kv(kbuf, vbuf, start, kr, v)

    o = _attention(qr, kbuf, vbuf, q_pos, k_pos, first, causal, window, par_min_macs, parallel, bf16)  # [n, nh, hd]
    _rnd(o, bf16)
    y = _linear(o.reshape(n, nh * hd), wo, H, par_min_macs, parallel, bf16)  # [n, H]
    if has_conv:
        y = _conv(y, d_att, att_base[1], group_size, block_len, and_arm != 0, bf16)
    _add_residual(h, y, bf16)


def _make_decoder_layer(bf16: bool, parallel: bool):
    """The decoder layer kernel for one run mode (bf16) and thread policy (parallel: may a
    product go parallel); both are closure constants, folded before typing (module docstring)."""

    @njit(cache=True, nogil=True)
    def decoder_layer_kernel(h, weights, norms, conv, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape,
                             causal, window, eps, par_min_macs, first):
        """One pre-norm decoder layer on h [n, H] (in place); arguments as `decoder_layer`."""
        wqkv, wo, wgu, wd = weights
        ln1, ln2, q_norm, k_norm = norms
        att_proj, mlp_proj, att_base, mlp_base = conv
        nh, nkv, hd, taps, group_size, block_len, and_arm, k_at, v_at, u_at = shape
        n, H = h.shape
        inter = in_features(wd)  # I: the down projection's input features
        has_conv = weight_size(att_proj) > 0
        attention_half(h, wqkv, wo, ln1, q_norm, k_norm, att_proj, att_base, kbuf, vbuf, start, q_pos, k_pos, cos,
                       sin, nh, nkv, hd, (taps, group_size, block_len, and_arm), k_at, v_at, causal, window, eps,
                       par_min_macs, parallel, bf16, first)

        m = _rms(h, ln2, eps, bf16)  # [n, H]
        if has_conv:
            m, d_mlp = _conv_prepare(m, mlp_proj, mlp_base, taps, group_size, block_len, and_arm != 0,
                                     par_min_macs, parallel, bf16)
        gu = _linear(m, wgu, panel_columns(wgu), par_min_macs, parallel, bf16)  # [n, gate | up padded]
        s = np.empty((n, inter), np.float32)  # [n, I]
        _swiglu_rows(np.ascontiguousarray(gu[:, :inter]), np.ascontiguousarray(gu[:, u_at:u_at + inter]),
                     _runtime_bool(bf16), s)
        y = _linear(s, wd, H, par_min_macs, parallel, bf16)  # [n, H]
        if has_conv:
            y = _conv(y, d_mlp, mlp_base[1], group_size, block_len, and_arm != 0, bf16)
        _add_residual(h, y, bf16)

    return decoder_layer_kernel


# ------------------------------------------------------------------ the draft's context update
def _make_context_update(bf16: bool, parallel: bool):
    """The draft's context update kernel for one run mode / thread policy (as `_make_decoder_layer`)."""

    @njit(cache=True, nogil=True)
    def context_update_kernel(x, fc, hidden_norm, wk, wv, k_norm, kcache, vcache, start, cos, sin, nkv, hd, eps,
                              par_min_macs):
        """The draft's context K/V; arguments as `context_update`."""
        n = x.shape[0]
        H = hidden_norm.shape[0]
        if start + n > kcache.shape[2]:
            raise ValueError("context_update: the context cache has no room for the tokens (reserve first)")
        c = _rms(_linear(x, fc, H, par_min_macs, parallel, bf16), hidden_norm, eps, bf16)  # [n, H]
        for l in range(len(wk)):
            k = _rms(_linear(c, wk[l], nkv * hd, par_min_macs, parallel, bf16).reshape(n * nkv, hd), k_norm[l], eps, bf16)
            kr = np.empty((n, nkv, hd), np.float32)  # [n, nkv, hd]
            _rope_rows(k.reshape(n, nkv, hd), cos, sin, _runtime_bool(bf16), kr)
            v = _linear(c, wv[l], nkv * hd, par_min_macs, parallel, bf16).reshape(n, nkv, hd)  # [n, nkv, hd]
            _write_kv(kcache[l], vcache[l], start, kr, v)

    return context_update_kernel


# ------------------------------------------------------------------ Python side
# numba's cache keys a closure's compiled code on its closure values as well, so the variants
# share one cache index file (fused._make_decoder_layer.locals.decoder_layer_kernel-*.nbi) and
# never collide; each compiles only when first called.
_layer_kernel = functools.cache(_make_decoder_layer)
_context_kernel = functools.cache(_make_context_update)


def kernel_variants() -> list:
    """Every variant's dispatcher (made, not compiled): for kernels/cache_check.py."""
    return [make(bf16, par) for make in (_layer_kernel, _context_kernel)
            for bf16 in (False, True) for par in (False, True)]


def decoder_layer(h, weights, norms, conv, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape,
                  causal, window, eps, bf16, par_min_macs, first=0):
    """One pre-norm decoder layer on h [n, H] (in place); see the module docstring.

    weights (wqkv, wo, wgu, wd): panels (kernels/panels.py); wqkv = q [nh*hd, H], k, v [nkv*hd, H]
            grouped (panels.group_panels: ONE product), wo [H, nh*hd], wgu = gate, up [I, H]
            grouped, wd [H, I]
    norms   (ln1 [H], ln2 [H], q_norm [hd], k_norm [hd]); q_norm of size 0 = no qk norm (Llama)
    conv    (att_proj, mlp_proj: panels of [2*taps*G, H]; att_base, mlp_base [2, taps, H]);
            0-size = none
    kbuf, vbuf [nkv, >= start+n, hd]: the layer's K/V buffer; rows start..start+n-1 are written
    shape   (nh, nkv, hd, taps, group_size, block_len, and_arm, k_at, v_at, u_at) ints; *_at: the
            first column of k / v / up in its group's output
    first   the first key row attended (rows before it are masked: the draft window)
    bf16 and par_min_macs < NEVER pick the compiled variant (module docstring)."""
    _layer_kernel(bool(bf16), par_min_macs < NEVER)(h, weights, norms, conv, kbuf, vbuf, start, q_pos, k_pos,
                                                    cos, sin, shape, causal, window, eps, par_min_macs, int(first))


def context_update(x, fc, hidden_norm, wk, wv, k_norm, kcache, vcache, start, cos, sin, nkv, hd, eps, bf16,
                   par_min_macs):
    """The draft's context K/V of n committed tokens (spec §3), all layers in one call, as
    DFlashDraft.extend_context computes them op by op:
        c = rms(rnd?(x fc^T), hidden_norm);  per layer l: K = rope(k_norm(c Wk_l^T)), V = c Wv_l^T
    x [n, n_taps*H] the taps; fc: panels of [H, n_taps*H]; wk, wv, k_norm: tuples over layers
    (panels of [nkv*hd, H], [hd]); kcache / vcache [L, nkv, T, hd]: rows start..start+n-1 written."""
    _context_kernel(bool(bf16), par_min_macs < NEVER)(x, fc, hidden_norm, wk, wv, k_norm, kcache, vcache, start,
                                                      cos, sin, nkv, hd, eps, par_min_macs)


def layer_args(nh: int, nkv: int, hd: int, offsets: tuple, taps: int = 0, group_size: int = 0,
               block_len: int = 0):
    """The `shape` tuple of decoder_layer; offsets = (k_at, v_at, u_at) from fuse_weights; conv
    fields 0 for layers without the conv."""
    and_arm = int(uses_and_arm(block_len)) if block_len else 0
    return (int(nh), int(nkv), int(hd), int(taps), int(group_size), int(block_len), and_arm,
            *(int(o) for o in offsets))


def fuse_weights(layer: dict) -> tuple[tuple, tuple]:
    """A layer's weights for decoder_layer -> ((wqkv, wo, wgu, wd) panels, (k_at, v_at, u_at)).
    q / k / v and gate / up are grouped into one product each (their own `.panels` become views
    of the group, so the op-by-op path reads the same memory)."""
    qkv, (_, k_at, v_at) = group_panels([layer["q"], layer["k"], layer["v"]])
    gu, (_, u_at) = group_panels([layer["gate"], layer["up"]])
    return (qkv, layer["o"].panels, gu, layer["down"].panels), (k_at, v_at, u_at)


def can_fuse(n_rows: int, weights: tuple = ()) -> bool:
    """The fused layer takes 1..GEMV_MAX_ROWS rows and weights packed into panels (bf16
    checkpoints on the CPU device: kernels/panels.PackedBF16); anything else runs op by op."""
    return 1 <= n_rows <= GEMV_MAX_ROWS and all(getattr(w, "panels", None) is not None for w in weights)

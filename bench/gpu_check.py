"""One-command GPU acceptance check (spec §4.2, §6, §8): CUDA kernels vs the CPU kernels.

    python bench/gpu_check.py            # on a CUDA machine (one H200: well under 5 minutes)
    python bench/gpu_check.py --small    # tiny shapes on numba's CUDA simulator (no GPU needed)

Checks, each a row of the summary table:
  conv       bit-identity of the @cuda.jit grouped conv with the @njit CPU kernel at the published
             shapes (H=5120 Q=8, H=6656 Q=16; group size 16; taps 2 and 3; both sides; f32 and
             bf16; --rows rows, a partial last block included). NaN compared by NaN-ness.
  attention  target verify block (causal over cache ++ block), draft block (context ++ block,
             non-causal), sliding window, bf16 probabilities: |gpu - cpu| <= 1e-5*max|cpu| + 1e-6
             (bf16 probabilities: all within 1 bf16 ulp, and the fraction of (query, head) rows within
             that tolerance at most 5 points under the same fraction for the GPU's arithmetic order
             modelled in numpy: one weight's bf16 rounding flips with ulp-level score differences).
  linear     bf16 GEMV (M = a 16-row block) vs the CPU kernel, relative to sum|x||w|.
  gdn        Gated DeltaNet kernels at the Qwen3.8-27B shape (C = 10240 conv channels, K = 4;
             Hk 16 / Hv 48 heads of 128, a 16-row block, device-resident state): short conv f32 / bf16
             and the delta rule vs the CPU kernels, |gpu - cpu| <= 1e-5 * max|cpu| (+ 1 bf16 ulp).
  decode     greedy speculative decode of a tiny target + DFlash2 draft, device cuda vs cpu: the
             same token ids; the same for a tiny Qwen3.5 hybrid target (recurrent-state rollback
             on the device).
Throughput (GB/s) for conv / attention / linear: unique bytes read + written per call over the
best-of-k device time (arrays already resident; launches synchronised).
Exit status 0 when every row passes, 1 on any mismatch, 2 when no CUDA device is available.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if "--small" in sys.argv[1:]:  # must precede the first numba import
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from numba import cuda  # noqa: E402

FULL = dict(conv_shapes=[(5120, 8), (6656, 16)], conv_taps=(2, 3), group_size=16, rows=480,
            attention=dict(nh=32, nkv=8, hd=128, nq=16, ctx=2032), linear=(16, 4096, 5120),
            tiny=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, tokenizer_vocab_size=1000),
            draft_block=8, draft_layers=2, new_tokens=48, repeat=10,
            gdn=dict(C=10240, K=4, n=16, Hk=16, Hv=48, dk=128, dv=128))
SMALL = dict(conv_shapes=[(16, 8), (16, 16)], conv_taps=(2, 3), group_size=4, rows=None,
             attention=dict(nh=4, nkv=2, hd=16, nq=4, ctx=12), linear=(3, 24, 32),
             tiny=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, tokenizer_vocab_size=300),
             draft_block=4, draft_layers=1, new_tokens=3, repeat=0,
             gdn=dict(C=24, K=4, n=3, Hk=1, Hv=2, dk=4, dv=4))


def device_time(fn, repeat: int) -> float:
    """Best wall time of `repeat` synchronised calls after one warm-up (JIT compile); with
    repeat 0 (simulator) the warm-up's own time."""
    t0 = time.perf_counter()
    fn()
    cuda.synchronize()
    best = time.perf_counter() - t0 if repeat == 0 else float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def same_bits_nan_aware(a: np.ndarray, b: np.ndarray) -> int:
    """Number of mismatching elements: bit patterns must agree, except that NaN == NaN."""
    view = np.uint32 if a.dtype == np.float32 else np.uint16
    nan_a = np.isnan(a) if a.dtype == np.float32 else (a & 0x7FFF) > 0x7F80
    nan_b = np.isnan(b) if b.dtype == np.float32 else (b & 0x7FFF) > 0x7F80
    return int(np.sum((a.view(view) != b.view(view)) & ~(nan_a & nan_b)))


# ------------------------------------------------------------------ checks
def check_conv(cfg, rng, rows):
    from dflash2_numba.kernels import conv
    from dflash2_numba.kernels.cuda_conv import launch_conv
    from dflash2_numba.numerics import f32_to_bf16_array

    S = cfg["group_size"]
    for hidden, Q in cfg["conv_shapes"]:
        n_rows = cfg["rows"] or 2 * Q + 3
        if n_rows % Q == 0:
            n_rows += 3  # a partial last block, as a truncated last step has
        G = hidden // S
        for taps in cfg["conv_taps"]:
            for dtype in ("f32", "bf16"):
                x = rng.standard_normal((n_rows, hidden)).astype(np.float32)  # [N, H]
                x[rng.random(x.shape) < 1e-3] = np.inf  # specials: inf, and NaN through inf*0 / inf-inf
                proj = (0.5 * rng.standard_normal((n_rows, 2 * taps * G))).astype(np.float32)
                base = rng.standard_normal((2, taps, hidden)).astype(np.float32)  # [side, tap, H]
                if dtype == "bf16":
                    x, proj, base = f32_to_bf16_array(x), f32_to_bf16_array(proj), f32_to_bf16_array(base)
                delta_both = proj.reshape(n_rows, 2, taps, G)
                bad, moved, t = 0, 0, 0.0
                for side in (0, 1):
                    delta = np.ascontiguousarray(delta_both[:, side])  # [N, taps, G]
                    want = conv.grouped_conv(x, delta, base[side], S, Q)
                    dx, dd, db = cuda.to_device(x), cuda.to_device(delta), cuda.to_device(base[side])
                    dout = cuda.device_array(x.shape, x.dtype)
                    and_arm = conv.uses_and_arm(Q)
                    t += device_time(lambda: launch_conv(dx, dd, db, dout, S, Q, and_arm), cfg["repeat"])
                    bad += same_bits_nan_aware(dout.copy_to_host(), want)
                    moved += 2 * x.nbytes + delta.nbytes + base[side].nbytes
                rows.append(("conv", f"H={hidden} Q={Q} taps={taps} {dtype} N={n_rows}", bad == 0,
                             f"{bad} of {2 * x.size} elements differ", moved / t / 1e9))


def check_attention(cfg, rng, rows):
    from dflash2_numba.kernels.attention import attention
    from dflash2_numba.kernels.cuda_attention import attention_cuda

    a = cfg["attention"]
    nh, nkv, hd, nq, ctx = a["nh"], a["nkv"], a["hd"], a["nq"], a["ctx"]
    T = ctx + nq
    cases = [  # name, q_pos, k_pos, causal, window, bf16_probs
        ("target verify (causal)", np.arange(ctx, T), np.arange(T), True, 0, False),
        ("draft block (non-causal)", np.arange(ctx, T), np.arange(T), False, 0, False),
        ("sliding window", np.arange(ctx, T), np.arange(T), False, max(2, ctx // 4), False),
        ("verify, bf16 probs", np.arange(ctx, T), np.arange(T), True, 0, True),
    ]
    for name, q_pos, k_pos, causal, window, bf16_probs in cases:
        q = rng.standard_normal((nq, nh, hd)).astype(np.float32)
        k = rng.standard_normal((nkv, T, hd)).astype(np.float32)
        v = rng.standard_normal((nkv, T, hd)).astype(np.float32)
        want = attention(q, k, v, q_pos, k_pos, causal, window, bf16_probs)
        dq, dk, dv = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
        res = {}

        def call():
            res["out"] = attention_cuda(dq, dk, dv, q_pos, k_pos, causal, window, bf16_probs)

        t = device_time(call, cfg["repeat"])
        got = res["out"].copy_to_host()  # [nq, nh, hd]
        tol = 1e-5 * float(np.abs(want).max()) + 1e-6
        err = np.abs(got - want)  # [nq, nh, hd]
        if bf16_probs:
            rows_ok = np.all(err <= tol, axis=-1).mean()
            floor = np.all(np.abs(gpu_order_bf16_attention(q, k, v, q_pos, k_pos, causal) - want) <= tol, axis=-1).mean()
            ok = rows_ok >= floor - 0.05 and np.all(err <= 2e-2 * np.abs(want) + 2e-2)
            detail = (f"{rows_ok:.1%} rows within {tol:.1e} (the GPU's order modelled in numpy: {floor:.1%}), "
                      f"max err {err.max():.2e}")
        else:
            ok, detail = bool(np.all(err <= tol)), f"max err {err.max():.2e} (tol {tol:.1e})"
        moved = q.nbytes + k.nbytes + v.nbytes + got.nbytes
        rows.append(("attention", f"{name} nq={nq} nh={nh} nkv={nkv} hd={hd} T={T}", ok, detail, moved / t / 1e9))


def gpu_order_bf16_attention(q, k, v, q_pos, k_pos, causal):
    """bf16-probability attention in the CUDA kernel's arithmetic order, in numpy: each score one
    sequential f32 dot product over hd, f32 exp, weights rounded to bf16 against their 256-key tile's
    max. It differs from the CPU kernel (16-lane scores, its own exp) only by rounding, and how often
    one weight's bf16 rounding flips grows with the keys a row sees: at T = 2048 only ~89 % of rows
    stay within the f32 tolerance, against ~100 % at T <= 256. That model fraction is the check's
    floor for the GPU; rounding against the row's global max instead (the kernel before the fix)
    left 0 % of rows within it."""
    from dflash2_numba.kernels.attention import TILE
    from dflash2_numba.numerics import round_bf16_array

    nq, nh, hd = q.shape
    g = nh // k.shape[0]
    kh, vh = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)  # [nh, T, hd]
    acc = np.zeros((nq, nh, len(k_pos)), np.float32)  # [nq, nh, T]
    for j in range(hd):  # key by key in feature order, f32 after every step
        acc = (acc + (q[:, :, j, None] * kh[None, :, :, j]).astype(np.float32)).astype(np.float32)
    s = (acc * np.float32(1.0 / np.sqrt(np.float32(hd)))).astype(np.float32)
    d = q_pos[:, None] - k_pos[None, :]  # [nq, T]
    s = np.where(((d >= 0) | (not causal))[:, None, :], s, np.float32(-np.inf))
    mx = s.max(-1, keepdims=True)  # [nq, nh, 1]
    w, total = np.zeros_like(s), np.zeros(mx.shape, np.float32)
    for t0 in range(0, s.shape[-1], TILE):
        st = s[..., t0:t0 + TILE]
        mb = st.max(-1, keepdims=True)
        seen = np.isfinite(mb)
        c = np.where(seen, np.exp(np.where(seen, mb - mx, 0).astype(np.float32)), 0).astype(np.float32)
        e = np.exp((st - np.where(seen, mb, 0)).astype(np.float32)).astype(np.float32)  # 0 where unseen
        w[..., t0:t0 + TILE] = (round_bf16_array(e) * c).astype(np.float32)
        total += (e * c).astype(np.float32).sum(-1, keepdims=True, dtype=np.float32)
    return (np.einsum("qht,htd->qhd", w, vh) / total).astype(np.float32)  # [nq, nh, hd]


def check_linear(cfg, rng, rows):
    from dflash2_numba.kernels.cuda_linear import linear_cuda
    from dflash2_numba.kernels.linear import linear
    from dflash2_numba.numerics import bf16_to_f32_array, f32_to_bf16_array

    M, N, K = cfg["linear"]
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = f32_to_bf16_array(0.02 * rng.standard_normal((N, K)))  # [N, K] bf16
    want = linear(x, w)
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    res = {}
    t = device_time(lambda: res.__setitem__("y", linear_cuda(dx, dw)), cfg["repeat"])
    got = res["y"].copy_to_host()  # [M, N]
    scale = np.abs(x) @ np.abs(bf16_to_f32_array(w)).T  # [M, N]
    err = float(np.max(np.abs(got - want) / (scale + 1e-30)))
    rows.append(("linear", f"bf16 M={M} N={N} K={K}", err <= 1e-5, f"max err / sum|x||w| = {err:.1e}",
                 (w.nbytes + x.nbytes + 4 * M * N) / t / 1e9))


def check_gdn(cfg, rng, rows):
    from dflash2_numba.kernels import gdn
    from dflash2_numba.kernels.cuda_gdn import gated_delta_cuda, short_conv_cuda
    from dflash2_numba.numerics import round_bf16_array

    g = cfg["gdn"]
    C, K, n = g["C"], g["K"], g["n"]
    window = round_bf16_array(rng.standard_normal((K - 1 + n, C)).astype(np.float32))  # [K-1+n, C]
    w = round_bf16_array(0.5 * rng.standard_normal((C, K)).astype(np.float32))  # [C, K]
    for bf16 in (False, True):
        want = gdn.short_conv(window, w, bf16)
        res = {}
        t = device_time(lambda: res.__setitem__("y", short_conv_cuda(window, w, bf16)), cfg["repeat"])
        err = float(np.abs(res["y"] - want).max())
        tol = (2.0**-7 if bf16 else 1e-5) * float(np.abs(want).max())  # bf16: one ulp of a rounding flip
        rows.append(("gdn", f"short conv C={C} K={K} n={n} {'bf16' if bf16 else 'f32'}", err <= tol,
                     f"max err {err:.2e} (tol {tol:.1e})", (window.nbytes + w.nbytes + want.nbytes) / t / 1e9))
    Hk, Hv, dk, dv = g["Hk"], g["Hv"], g["dk"], g["dv"]
    q, k = (rng.standard_normal((n, Hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((n, Hv, dv)).astype(np.float32)
    gate = -rng.uniform(0.01, 1.0, (n, Hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (n, Hv)).astype(np.float32)
    s0 = rng.standard_normal((Hv, dk, dv)).astype(np.float32)
    s_cpu = np.empty_like(s0)
    o_cpu = gdn.gated_delta_rule(q, k, v, gate, beta, s0, s_cpu)
    d_in, d_out = cuda.to_device(s0), cuda.device_array(s0.shape, np.float32)  # resident states
    res = {}
    t = device_time(lambda: res.__setitem__("o", gated_delta_cuda(q, k, v, gate, beta, d_in, d_out)), cfg["repeat"])
    err = max(float(np.abs(res["o"] - o_cpu).max() / np.abs(o_cpu).max()),
              float(np.abs(d_out.copy_to_host() - s_cpu).max() / np.abs(s_cpu).max()))
    rows.append(("gdn", f"delta rule n={n} Hk={Hk} Hv={Hv} dk={dk} dv={dv}", err <= 1e-5,
                 f"max err / max|cpu| = {err:.1e} (output and state)", 2 * s0.nbytes / t / 1e9))


def check_hybrid_decode(cfg, rows):
    import dflash2_numba as dn
    from dflash2_numba import tiny
    from dflash2_numba.tiny_hybrid import write_qwen3_5_target

    c = cfg["tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        t = write_qwen3_5_target(Path(tmp) / "target", hidden_size=c["hidden_size"],
                                 intermediate_size=c["intermediate_size"], num_hidden_layers=2 * c["num_hidden_layers"],
                                 num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
                                 head_dim=c["head_dim"], linear_num_key_heads=1, linear_num_value_heads=2,
                                 linear_key_head_dim=c["head_dim"] // 2, linear_value_head_dim=c["head_dim"] // 2,
                                 full_attention_interval=2, tokenizer_vocab_size=c["tokenizer_vocab_size"],
                                 seed=1, init_std=0.5)
        d = tiny.write_draft(Path(tmp) / "draft", t, kind="dflash2", num_hidden_layers=cfg["draft_layers"],
                             block_size=cfg["draft_block"], conv_kernel_size=3, seed=2, init_std=0.5,
                             conv_group_size=16, target_layer_ids=[0])
        out = {}
        for device in ("cpu", "cuda"):
            target = dn.load_target(t, device=device)
            draft = dn.load_draft(d, target) if device == "cuda" else None  # cpu: the target's own greedy
            out[device] = dn.generate(target, draft, prompt_ids=[5, 6, 7, 8], max_new_tokens=cfg["new_tokens"]).output_ids
        ok = out["cuda"] == out["cpu"] and len(out["cpu"]) == cfg["new_tokens"]
        rows.append(("decode", f"tiny Qwen3.5 hybrid + DFlash2 H={c['hidden_size']} greedy", ok,
                     f"{len(out['cuda'])} tokens, cuda speculative == cpu target-only: {ok}", None))


def check_decode(cfg, rows):
    import dflash2_numba as dn
    from dflash2_numba import tiny

    with tempfile.TemporaryDirectory() as tmp:
        t = tiny.write_target(Path(tmp) / "target", seed=1, init_std=0.5, **cfg["tiny"])
        d = tiny.write_draft(Path(tmp) / "draft", t, kind="dflash2", num_hidden_layers=cfg["draft_layers"],
                             block_size=cfg["draft_block"], conv_kernel_size=3, seed=2, init_std=0.5,
                             conv_group_size=16)
        out, secs = {}, {}
        for device in ("cpu", "cuda"):
            target = dn.load_target(t, device=device)
            draft = dn.load_draft(d, target)
            t0 = time.perf_counter()
            out[device] = dn.generate(target, draft, prompt_ids=[5, 6, 7, 8], max_new_tokens=cfg["new_tokens"]).output_ids
            secs[device] = time.perf_counter() - t0
        ok = out["cuda"] == out["cpu"] and len(out["cpu"]) == cfg["new_tokens"]
        first = next((i for i, (a, b) in enumerate(zip(out["cpu"], out["cuda"])) if a != b), None)
        detail = (f"{len(out['cuda'])} tokens identical" if ok else f"first difference at token {first}")
        rows.append(("decode", f"tiny DFlash2 pair H={cfg['tiny']['hidden_size']} greedy", ok,
                     f"{detail}; cpu {secs['cpu']:.1f}s, cuda {secs['cuda']:.1f}s", None))


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes; runs on the CUDA simulator")
    ap.add_argument("--rows", type=int, default=None, help="conv rows N (default 480; --small: 2Q+3)")
    args = ap.parse_args(argv)
    cfg = dict(SMALL if args.small else FULL)
    if args.rows:
        cfg["rows"] = args.rows

    from dflash2_numba.kernels.cuda_ops import cuda_available
    from dflash2_numba.kernels.cuda_common import SIMULATOR

    if not cuda_available():
        print("gpu_check: no CUDA device is available (numba.cuda.is_available() is False); "
              "run with --small to exercise the checks on the CUDA simulator", file=sys.stderr)
        return 2
    name = "" if SIMULATOR else cuda.get_current_device().name
    where = "CUDA simulator" if SIMULATOR else (name.decode() if isinstance(name, bytes) else str(name))
    if SIMULATOR:
        sys.setswitchinterval(5e-5)  # the simulator busy-polls its threads
    print(f"gpu_check on {where} ({'small' if args.small else 'full'} shapes)", flush=True)

    rng = np.random.default_rng(0)
    rows: list[tuple] = []
    t0 = time.perf_counter()
    for check in (check_conv, check_attention, check_linear, check_gdn):
        check(cfg, rng, rows)
        print(f"  {check.__name__} done ({time.perf_counter() - t0:.0f}s)", flush=True)
    check_decode(cfg, rows)
    check_hybrid_decode(cfg, rows)

    w_kind, w_shape = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    header = f"{'check':<{w_kind}}  {'shape':<{w_shape}}  result  {'GB/s':>7}  detail"
    print(header)
    print("-" * len(header))
    for kind, shape, ok, detail, gbps in rows:
        rate = f"{gbps:7.1f}" if gbps is not None else f"{'-':>7}"
        print(f"{kind:<{w_kind}}  {shape:<{w_shape}}  {'PASS' if ok else 'FAIL':<6}  {rate}  {detail}")
    failed = sum(not r[2] for r in rows)
    note = " (GB/s on the simulator are meaningless)" if SIMULATOR else ""
    print(f"{len(rows) - failed}/{len(rows)} passed in {time.perf_counter() - t0:.0f}s{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

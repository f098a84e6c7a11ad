"""Roofline of the product kernels: each one's speed against the machine's read bandwidth and the
measured compute peak of the instruction path it runs on.

    python bench/roofline.py [--threads 1,2] [--rows 1,2,4,8,16] [--rounds 5] [--out PATH]
    DFLASH2_ISA=avx2 python bench/roofline.py ...      # a lower path on this host (kernels/isa.py)
    python bench/roofline.py --pipes                    # the AVX2 integer instructions' rates

Peaks, measured here by probe loops in LLVM IR (12 independent chains, so throughput and not
latency bounds them; the operands live in registers):
  f32 FMA      llvm.fma on <16 x float> (AVX-512) or <8 x float> (AVX2), a multiply and an add
               on <4 x float> on the generic path (SSE2): what the bf16 panel GEMV's
               multiply-adds run on (a MAC = one lane of one FMA);
  int8 avx2    vpmaddubsw + vpmaddwd + vpaddd per 32 u8 x s8 products (q4_0's unsigned nibbles
               on quant/kernels_int8.py's AVX2 path): 32 MACs per step;
  int8 avx2 sign  the same after vpsignb: q8_0's signed weights x signed activations by
               llama.cpp's sign trick (|w| x sign(w) x), the sequence the AVX2 q8_0 kernel needs;
  int8 vnni    vpdpbusd (zmm on avx512_vnni: 64 MACs, ymm on avx_vnni: 32).
Each chain feeds its own result back (the int8 avx2 chain bitcasts its int32 sum to the next
step's u8 operand), so LLVM can hoist nothing out of the loop. On 2 threads each thread runs the
probe (numba prange): the peak of the cores, not of one.

Read bandwidth: bench/bandwidth.py's four-stream sum over 1 GiB, per thread count.

Kernels: the bf16 panel GEMV (kernels/panels.py) and the q8_0 / q4_0 integer GEMV
(quant/kernels_int8.py; the activations are quantized once outside the timing) on [2048, 2048]
weights, cycled over enough distinct copies (~320 MB) that they stream from memory whatever the
caches hold. Per (format, rows, threads): GB/s of weight bytes, GMAC/s, the memory time
bytes / bandwidth, the compute time MACs / peak, and **fraction = max(the two) / measured time**:
1.0 is on the roof, whichever bound applies. Best of --rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numba  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from acceptance import machine_info  # noqa: E402
from bandwidth import read_bandwidth  # noqa: E402
from dflash2_numba.kernels import isa  # noqa: E402
from dflash2_numba.kernels import panels as P  # noqa: E402
from dflash2_numba.numerics import f32_to_bf16_array  # noqa: E402
from dflash2_numba.quant import kernels_int8 as K8  # noqa: E402
from dflash2_numba.quant.weights import quantize_weight  # noqa: E402

CHAINS = 12  # independent accumulators: > latency x ports of every probed instruction
SHAPE = (2048, 2048)  # [N, K] of the timed weights
STREAM_BYTES = 320 << 20  # distinct copies cycled per call round: well past the L3


# ------------------------------------------------------------------ peak probes (LLVM IR)
def _probe(kind: str):
    """An njit function probe(n) -> int64: n steps of CHAINS chains of `kind`; its MACs per step."""
    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    if kind == "fma":
        W = isa.vector_bits() // 32
        vt, macs = ir.VectorType(f32, W), W
    elif kind in ("int8_avx2", "int8_avx2_sign"):
        vt, macs = ir.VectorType(i32, 8), 32
    elif kind == "vnni512":
        vt, macs = ir.VectorType(i32, 16), 64
    elif kind.startswith("pipe_"):  # one instruction (or a pair of kinds) per chain and step: a count of them
        vt, macs = ir.VectorType(i32, 8), 1
    else:  # vnni256
        vt, macs = ir.VectorType(i32, 8), 32

    @intrinsic
    def steps(typingctx, n):
        def codegen(context, builder, signature, args):
            (n,) = args
            mod = builder.module

            def fn(name, ret, argtys):
                from numba.core import cgutils
                return cgutils.get_or_insert_function(mod, ir.FunctionType(ret, argtys), name)

            if kind == "fma":
                f = fn(f"llvm.fma.v{vt.count}f32", vt, [vt, vt, vt])
                m, c = ir.Constant(vt, [0.999] * vt.count), ir.Constant(vt, [1e-3] * vt.count)
                init = [ir.Constant(vt, [float(k)] * vt.count) for k in range(CHAINS)]

                def step(acc):
                    if isa.selected() == "generic":  # SSE2 has no FMA (llvm.fma would be a libm call)
                        return builder.fadd(builder.fmul(acc, m), c)
                    return builder.call(f, [acc, m, c])
            elif kind == "int8_avx2":
                vb, vh = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
                maddubs = fn("llvm.x86.avx2.pmadd.ub.sw", vh, [vb, vb])
                maddwd = fn("llvm.x86.avx2.pmadd.wd", vt, [vh, vh])
                w, ones = ir.Constant(vb, [(3 * j) % 127 - 60 for j in range(32)]), ir.Constant(vh, [1] * 16)
                init = [ir.Constant(vt, [k + j for j in range(8)]) for k in range(CHAINS)]

                def step(acc):
                    prod = builder.call(maddubs, [builder.bitcast(acc, vb), w])
                    return builder.add(acc, builder.call(maddwd, [prod, ones]))
            elif kind == "int8_avx2_sign":  # signed x signed (q8_0): the sign trick's vpsignb first
                vb, vh = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
                psign = fn("llvm.x86.avx2.psign.b", vb, [vb, vb])
                maddubs = fn("llvm.x86.avx2.pmadd.ub.sw", vh, [vb, vb])
                maddwd = fn("llvm.x86.avx2.pmadd.wd", vt, [vh, vh])
                wv = [(3 * j) % 127 - 60 for j in range(32)]
                w, absw = ir.Constant(vb, wv), ir.Constant(vb, [abs(v) for v in wv])
                ones = ir.Constant(vh, [1] * 16)
                init = [ir.Constant(vt, [k + j for j in range(8)]) for k in range(CHAINS)]

                def step(acc):
                    sx = builder.call(psign, [builder.bitcast(acc, vb), w])  # sign(w) * x
                    prod = builder.call(maddubs, [absw, sx])  # |w| * sign(w) x
                    return builder.add(acc, builder.call(maddwd, [prod, ones]))
            elif kind.startswith("pipe_"):  # pipe_<op>[_<op>]: the ops alternate over the chains
                vb, vh = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
                ops = {"maddwd": (fn("llvm.x86.avx2.pmadd.wd", vt, [vh, vh]), vh),
                       "maddubs": (fn("llvm.x86.avx2.pmadd.ub.sw", vh, [vb, vb]), vb),
                       "psign": (fn("llvm.x86.avx2.psign.b", vb, [vb, vb]), vb)}
                names = kind[5:].split("_")
                init = [ir.Constant(vt, [k + j for j in range(8)]) for k in range(CHAINS)]

                def step_k(k, accs):  # acc op= a constant (add: the next chain's acc, nothing to fold)
                    acc, name = accs[k], names[k % len(names)]
                    if name == "add":
                        return builder.add(acc, accs[(k + 1) % CHAINS])
                    f, t = ops[name]
                    c = ir.Constant(t, [(3 * j) % 127 - 60 for j in range(t.count)])
                    return builder.bitcast(builder.call(f, [builder.bitcast(acc, t), c]), vt)
            else:
                vb = ir.VectorType(i8, 4 * vt.count)
                dp = fn(f"llvm.x86.avx512.vpdpbusd.{32 * vt.count}", vt, [vt, vb, vb])
                a = ir.Constant(vb, [(5 * j) % 255 for j in range(vb.count)])
                b = ir.Constant(vb, [(3 * j) % 127 - 60 for j in range(vb.count)])
                init = [ir.Constant(vt, [k] * vt.count) for k in range(CHAINS)]

                def step(acc):
                    return builder.call(dp, [acc, a, b])

            pre = builder.block
            loop = builder.append_basic_block("probe_loop")
            done = builder.append_basic_block("probe_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            i = builder.phi(i64)
            accs = [builder.phi(vt) for _ in range(CHAINS)]
            new = [step_k(k, accs) for k in range(CHAINS)] if kind.startswith("pipe_") else [step(a) for a in accs]
            i1 = builder.add(i, ir.Constant(i64, 1))
            i.add_incoming(ir.Constant(i64, 0), pre)
            i.add_incoming(i1, loop)
            for acc, x0, x1 in zip(accs, init, new):
                acc.add_incoming(x0, pre)
                acc.add_incoming(x1, loop)
            builder.cbranch(builder.icmp_signed("<", i1, n), loop, done)
            builder.position_at_end(done)
            out = ir.Constant(i64, 0)
            for x in new:  # every chain's lane 0 reaches the result: nothing is dead
                lane = builder.extract_element(x, ir.Constant(i32, 0))
                bits = builder.bitcast(lane, i32) if kind == "fma" else lane
                out = builder.xor(out, builder.zext(bits, i64))
            return out

        return types.int64(types.int64), codegen

    @njit(nogil=True)
    def probe(n):
        return steps(n)

    @njit(parallel=True, nogil=True)
    def probe_threads(n, threads):
        s = 0
        for t in prange(threads):
            s += steps(n)
        return s

    return probe, probe_threads, macs


def peak_gmacs(kind: str, threads: int, seconds: float = 0.25, rounds: int = 5) -> float:
    """Measured peak of `kind` in GMAC/s summed over `threads` threads (best of `rounds`)."""
    one, many, macs = _probe(kind)
    run = (lambda n: one(n)) if threads == 1 else (lambda n: many(n, threads))
    run(1000)  # compile
    n = 1 << 20
    while True:  # size the run to ~`seconds`
        t = time.perf_counter()
        run(n)
        dt = time.perf_counter() - t
        if dt > seconds / 4:
            break
        n *= 4
        if n > 1 << 40:  # the loop's time does not grow with n: LLVM removed the work
            raise RuntimeError(f"probe {kind}: {n} steps in {dt:.2e} s, the loop does no work")
    n = int(n * seconds / dt)
    best = np.inf
    for _ in range(rounds):
        t = time.perf_counter()
        run(n)
        best = min(best, time.perf_counter() - t)
    return n * CHAINS * macs * threads / best / 1e9


def peak_kinds() -> dict:
    """The probes this path can run (an instruction the target lacks would abort LLVM):
    format -> the probe its kernel's multiply-adds run on."""
    path = isa.selected()
    kinds = {"bf16": "fma"}
    if path == "avx512_vnni":
        kinds.update(q8_0="vnni512", q4_0="vnni512")
    elif path == "avx_vnni":
        kinds.update(q8_0="vnni256", q4_0="vnni256")
    elif path == "avx2":
        kinds.update(q8_0="int8_avx2_sign", q4_0="int8_avx2")  # q8_0's signed weights need vpsignb
    return kinds  # generic: no integer peak (plain vector IR, no single instruction to probe)


PIPES = ("maddwd", "maddubs", "psign", "add", "maddwd_psign", "maddwd_maddubs", "maddwd_add")


def pipes() -> int:
    """--pipes: G instructions/s on one thread of each AVX2 integer instruction the q8_0 / q4_0
    tiles issue, alone and in pairs (which ones share execution pipes: a pair's rate no higher
    than one alone). docs/roofline.md "Session 19"."""
    if isa.selected() == "generic":
        print("--pipes: the generic path has no AVX2 instructions to probe")
        return 1
    print(f"{machine_info(1)['cpu_model']} | path {isa.selected()} | G instructions/s, 1 thread")
    for kind in PIPES:
        print(f"  {kind:16s} {peak_gmacs('pipe_' + kind, 1):6.2f}", flush=True)
    return 0


# ------------------------------------------------------------------ the kernels
def weights(fmt: str, rng) -> tuple[list, int]:
    """Distinct copies of one [N, K] weight in `fmt` (~STREAM_BYTES in all) and the bytes of one."""
    w = f32_to_bf16_array(rng.standard_normal(SHAPE).astype(np.float32) * 0.05)
    if fmt == "bf16":
        one = P.pack_panels(w)
        nbytes = one.nbytes
        copies = [one] + [one.copy() for _ in range(max(1, STREAM_BYTES // nbytes) - 1)]
    else:
        qw, ws = quantize_weight(w, fmt).panels
        nbytes = qw.nbytes + ws.nbytes
        copies = [(qw, ws)] + [(qw.copy(), ws.copy()) for _ in range(max(1, STREAM_BYTES // nbytes) - 1)]
    return copies, nbytes


def time_kernel(fmt: str, copies: list, M: int, threads: int, rounds: int, rng) -> float:
    """Seconds per product of M rows (best round; each round runs every copy once)."""
    N, K = SHAPE
    x = rng.standard_normal((M, K)).astype(np.float32)
    y = np.empty((M, N), np.float32)
    if fmt == "bf16":
        kern = P._gemv_panels_par if threads > 1 else P._gemv_panels_ser

        def call(c):
            kern(x, c, y)
    else:
        xq, xs, xc = K8.quantize_rows_entry(x, K)
        kern = K8._gemv_quant_par if threads > 1 else K8._gemv_quant_ser

        def call(c):
            kern(xq, xs, xc, c[0], c[1], y)
    call(copies[0])  # compile / warm
    best = np.inf
    for _ in range(rounds):
        t = time.perf_counter()
        for c in copies:
            call(c)
        best = min(best, (time.perf_counter() - t) / len(copies))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--formats", default="bf16,q8_0,q4_0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--pipes", action="store_true", help="only the AVX2 integer instructions' rates (1 thread)")
    args = ap.parse_args(argv)
    if args.pipes:
        return pipes()
    threads = [int(t) for t in args.threads.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    fmts = args.formats.split(",")
    rng = np.random.default_rng(0)
    info = {"machine": machine_info(max(threads)), "isa": isa.describe(), "shape": list(SHAPE),
            "stream_bytes": STREAM_BYTES, "rounds": args.rounds}
    print(f"{info['machine']['cpu_model']} | path {isa.selected()} ({info['isa']['cpu_name']}) | "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    bw = {t: read_bandwidth([t])[str(t)]["best_gbs"] for t in threads}
    kinds = peak_kinds()
    peaks = {t: {k: peak_gmacs(k, t) for k in sorted(set(kinds.values()))} for t in threads}
    for t in threads:
        print(f"{t} thread(s): read {bw[t]:.1f} GB/s; peaks " + ", ".join(f"{k} {v:.0f} GMAC/s"
                                                                          for k, v in peaks[t].items()), flush=True)
    cells = []
    print(f"{'format':6s} {'thr':>3s} {'rows':>4s} | {'us':>8s} {'x1':>5s} {'GB/s':>6s} {'GMAC/s':>7s} | "
          f"{'mem us':>7s} {'cmp us':>7s} bound | fraction")
    N, K = SHAPE
    for fmt in fmts:
        copies, nbytes = weights(fmt, rng)
        for t in threads:
            numba.set_num_threads(t)
            one = None
            for M in rows:
                s = time_kernel(fmt, copies, M, t, args.rounds, rng)
                one = s if one is None else one
                t_mem = nbytes / (bw[t] * 1e9)
                kind = kinds.get(fmt)
                t_cmp = M * N * K / (peaks[t][kind] * 1e9) if kind else None
                bound = max(t_mem, t_cmp or 0.0)
                cell = {"format": fmt, "threads": t, "rows": M, "seconds": s, "x_one_row": s / one,
                        "gb_s": nbytes / s / 1e9, "gmac_s": M * N * K / s / 1e9, "memory_s": t_mem,
                        "compute_s": t_cmp, "peak": kind, "bound": "compute" if (t_cmp or 0) > t_mem else "memory",
                        "fraction": bound / s}
                cells.append(cell)
                print(f"{fmt:6s} {t:3d} {M:4d} | {1e6 * s:8.1f} {s / one:5.2f} {cell['gb_s']:6.1f} {cell['gmac_s']:7.1f} | "
                      f"{1e6 * t_mem:7.1f} {'-' if t_cmp is None else f'{1e6 * t_cmp:7.1f}':>7s} {cell['bound'][:3]}   | "
                      f"{cell['fraction']:.2f}", flush=True)
        del copies
    out = dict(info, read_gb_s={str(t): v for t, v in bw.items()},
               peaks_gmac_s={str(t): v for t, v in peaks.items()}, peak_of_format=kinds, cells=cells,
               load_end=os.getloadavg()[0])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

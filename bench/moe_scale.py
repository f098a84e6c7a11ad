"""A Qwen3-30B-A3B-shaped MoE target at real scale without a download: loading, peak memory and
decode speed against the machine's read bandwidth.

    python bench/moe_scale.py [--dir /tmp/qwen3-30b-a3b-sparse] [--quantize q4_0] [--tokens 16]
        [--threads 2] [--out bench/results/moe_scale_q4_0.json]

1. Writes (once) a SPARSE checkpoint with Qwen3-Coder-30B-A3B-Instruct's exact config.json
   (tests/data/moe/), the Hub's tensor names (per-expert `mlp.experts.E.{gate,up,down}_proj`,
   router `mlp.gate`), shapes and 16 shards with model.safetensors.index.json: 61 GB apparent,
   every tensor zero (holes in the files) except the embedding and the head (random, so each
   decoded token differs and routes differently), the routers (random: 8 of 128 experts per
   token, different per token) and the norms (ones). A tiny tokenizer is written beside it (the
   decode below feeds token ids).
2. In a fresh process: load_target(dir, quantize=...) (quantized at load, layer by layer, the
   bf16 pages handed back: quant/weights.release_pages), getrusage's PEAK resident set and the
   load time; then a greedy decode of --tokens tokens over the KV cache after a 16-token prompt
   (one row per step: the fused MoE layer), seconds per token.
3. The machine's read bandwidth two ways: bench/bandwidth.py's four-stream numba sum at the same
   thread count (what the GEMV benches compare against) and a plain numpy read (`a.sum()`), and
   the bytes a decoded token reads at the format (models/moe.moe_facts: attention, the 8 picked
   experts per layer, the router, the head, one embedding row) x tok/s as a fraction of each.
Records the CPU, the instruction-set path (kernels/isa.py) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "tests" / "data" / "moe" / "qwen3-coder-30b-a3b.config.json"


def _bf16(a: np.ndarray) -> np.ndarray:
    from dflash2_numba.numerics import f32_to_bf16_array

    return f32_to_bf16_array(a.astype(np.float32))


def write_sparse(out: Path, shards: int = 16, seed: int = 0) -> Path:
    """The sparse checkpoint (module docstring); returns its directory. Skips when complete."""
    from dflash2_numba.families.qwen3_moe import expected_qwen3_moe_tensors, resolve_qwen3_moe_config

    raw = json.loads(CONFIG.read_text())
    cfg = resolve_qwen3_moe_config(raw, str(CONFIG))
    shapes = dict(expected_qwen3_moe_tensors(cfg).pick([]))  # the Hub's per-expert spelling
    tensors = {n: ("BF16", s) for n, s in shapes.items() if not n.endswith("rotary_emb.inv_freq")}

    def fill(name, shape, rng):
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return _bf16(rng.standard_normal(shape, np.float32) * 0.5)
        if name.endswith("mlp.gate.weight"):  # routers: 8 of 128 experts, different per token
            return _bf16(rng.standard_normal(shape, np.float32))
        if len(shape) == 1:  # norms
            return np.full(shape, 0x3F80, np.uint16)  # bf16 1.0
        return None

    return write_sparse_checkpoint(out, raw, tensors, fill, shards, seed)


DTYPE_BYTES = {"BF16": 2, "U8": 1}


def write_sparse_checkpoint(out: Path, raw: dict, tensors: dict, fill, shards: int, seed: int = 0) -> Path:
    """A sharded safetensors checkpoint of `tensors` {name: (dtype, shape)} (layer order, about
    equal shards, model.safetensors.index.json) whose tensors are holes (zeros) unless
    `fill(name, shape, rng)` returns their data; config.json = raw, a tiny tokenizer beside it.
    Skips when a complete one is there (DONE)."""
    from dflash2_numba import tiny

    if (out / "model.safetensors.index.json").exists() and (out / "DONE").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors, key=lambda n: (int(n.split(".")[2]) if n.startswith("model.layers.") else -1, n))
    sizes = {n: DTYPE_BYTES[tensors[n][0]] * int(np.prod(tensors[n][1])) for n in names}
    total, per = sum(sizes.values()), sum(sizes.values()) / shards
    groups, acc = [[]], 0
    for n in names:
        if acc >= per * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(n)
        acc += sizes[n]
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for n in group:
            header[n] = {"dtype": tensors[n][0], "shape": list(tensors[n][1]),
                         "data_offsets": [offset, offset + sizes[n]]}
            offset += sizes[n]
            weight_map[n] = fname
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        base = 8 + len(head)
        with open(out / fname, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            f.truncate(base + offset)  # holes: every tensor reads as zeros
            for n in group:
                data = fill(n, tuple(tensors[n][1]), rng)
                if data is None:
                    continue
                f.seek(base + header[n]["data_offsets"][0])
                f.write(np.ascontiguousarray(data).tobytes())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    tiny.write_tokenizer_files(out, tiny.train_tiny_tokenizer(1000), "qwen3", 4096, chat_template=False)
    (out / "DONE").write_text("ok\n")
    return out


CHILD = r"""
import json, os, resource, sys, time
import numpy as np
path, fmt, n_tokens, threads, rounds, gib = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")], int(sys.argv[5]), float(sys.argv[6])
sys.path.insert(0, "bench")
from bandwidth import read_bandwidth
from moe_scale import numpy_read_gbs
from dflash2_numba.kernels.backend import set_threads
set_threads(max(threads))
import dflash2_numba as dn
t0 = time.perf_counter()
target = dn.load_target(path, quantize=None if fmt in ("bf16", "stored") else fmt)
load_s = time.perf_counter() - t0
rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
cache = target.new_cache(64 + rounds * len(threads) * (n_tokens + 1))
logits, _ = target.forward(np.arange(100, 116), cache, last_only=True)
tok = int(np.argmax(logits[-1]))
ids, out = [tok], {str(t): {"step_s": [], "bandwidth_gbs": [], "load_avg": []} for t in threads}
for r in range(rounds):  # thread counts alternate, each beside its own bandwidth probe (same load)
    for t in threads:
        set_threads(t)
        rec = out[str(t)]
        rec["load_avg"].append(os.getloadavg()[0])
        rec["bandwidth_gbs"].append(read_bandwidth([t], gib=gib, repeats=3)[str(t)]["best_gbs"])
        for i in range(n_tokens):
            s = time.perf_counter()
            logits, _ = target.forward(np.array([tok]), cache)
            tok = int(np.argmax(logits[-1]))
            rec["step_s"].append(time.perf_counter() - s)
            ids.append(tok)
print(json.dumps({"load_s": load_s, "peak_rss_gib_after_load": rss_after_load,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "numpy_read_gbs": numpy_read_gbs(gib), "threads": out, "tokens": ids[:64]}))
"""


def numpy_read_gbs(gib: float, repeats: int = 5) -> float:
    """A plain numpy read of a large array (`a.sum()` over gib GiB of uint64: numpy's own
    single-threaded loop), best of `repeats`, in GB/s: the issue's yardstick, beside the
    multi-stream probe of bench/bandwidth.py that a GEMV is held to elsewhere."""
    a = np.ones(int(gib * (1 << 30)) // 8, np.uint64)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qwen3-30b-a3b-sparse"))
    ap.add_argument("--quantize", default="q4_0", choices=("q4_0", "q8_0", "bf16"))
    ap.add_argument("--tokens", type=int, default=12, help="decoded tokens per (round, thread count)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bw-gib", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or HERE / "results" / f"moe_scale_{args.quantize}.json"

    t = time.perf_counter()
    model = write_sparse(args.dir)
    write_s = time.perf_counter() - t
    from dflash2_numba.families.qwen3_moe import describe_qwen3_moe, resolve_qwen3_moe_config

    facts = describe_qwen3_moe(resolve_qwen3_moe_config(json.loads(CONFIG.read_text())))
    measure(model, args.quantize, args.quantize, facts, CONFIG, args, out, write_s)


def measure(model: Path, load_format: str, read_format: str, facts: dict, config: Path, args, out: Path,
            write_s: float) -> dict:
    """Load + decode in a fresh process (CHILD), the bandwidth probes, the JSON record: the
    bytes a token reads are facts["bytes_read_per_token"][read_format]."""
    threads = [int(x) for x in args.threads.split(",")]
    du = subprocess.run(["du", "-sb", "--apparent-size", str(model)], capture_output=True, text=True).stdout.split()[0]
    disk = subprocess.run(["du", "-sb", str(model)], capture_output=True, text=True).stdout.split()[0]
    env = dict(os.environ, NUMBA_NUM_THREADS=str(max(threads)))
    r = subprocess.run([sys.executable, "-c", CHILD, str(model), load_format, str(args.tokens), args.threads,
                        str(args.rounds), str(args.bw_gib)], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        sys.exit(f"child failed:\n{r.stderr[-4000:]}")
    child = json.loads(r.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(HERE))
    from acceptance import cpu_model
    from dflash2_numba.kernels import isa

    bytes_tok = facts["bytes_read_per_token"][read_format]
    per_threads = {}
    for tc, rec in child["threads"].items():
        step, bw = float(np.median(rec["step_s"])), float(np.median(rec["bandwidth_gbs"]))
        per_threads[tc] = {**rec, "step_s_median": step, "tokens_per_s": 1 / step, "weight_gbs": bytes_tok / step / 1e9,
                           "bandwidth_gbs_median": bw, "fraction_of_bandwidth": bytes_tok / step / 1e9 / bw,
                           "fraction_of_numpy_read": bytes_tok / step / 1e9 / child["numpy_read_gbs"]}
    result = {
        "machine": {"cpu": cpu_model(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "isa_path": isa.selected()},
        "checkpoint": {"dir": "OUT (sparse)", "apparent_bytes": int(du), "disk_bytes": int(disk), "write_s": write_s,
                       "config": str(config.relative_to(ROOT))},
        "format": read_format, "load_s": child["load_s"], "peak_rss_gib": child["peak_rss_gib"],
        "peak_rss_gib_after_load": child["peak_rss_gib_after_load"], "bytes_read_per_token": bytes_tok,
        "numpy_read_gbs": child["numpy_read_gbs"], "threads": per_threads,
        "total_parameters": facts["total_parameters"], "active_parameters_per_token": facts["active_parameters_per_token"],
        "tokens": child["tokens"],
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{read_format}, {result['machine']['cpu']} ({isa.selected()}): load {child['load_s']:.0f} s, "
          f"peak RSS {child['peak_rss_gib']:.2f} GiB; {bytes_tok / 1e9:.2f} GB read per token")
    for tc, p in per_threads.items():
        print(f"  {tc} thread(s): {p['tokens_per_s']:.2f} tok/s = {p['weight_gbs']:.1f} GB/s = "
              f"{p['fraction_of_bandwidth']:.2f} of bench/bandwidth.py's {p['bandwidth_gbs_median']:.1f} GB/s, "
              f"{p['fraction_of_numpy_read']:.2f} of a plain numpy read ({child['numpy_read_gbs']:.1f} GB/s); "
              f"load avg {np.median(p['load_avg']):.1f}")
    return result


if __name__ == "__main__":
    main()

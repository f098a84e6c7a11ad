"""A gpt-oss-20b-shaped target at real scale without a download: its MXFP4 experts kept as
stored, peak memory, and decode speed against the machine's read bandwidth.

    python bench/gpt_oss_scale.py [--dir /tmp/gpt-oss-20b-sparse] [--tokens 12] [--threads 1,2]
        [--out bench/results/gpt_oss_scale.json]

1. Writes (once) a SPARSE checkpoint with openai/gpt-oss-20b's config.json
   (tests/data/gpt-oss-20b.config.json), the Hub's tensor names, dtypes and shapes (experts as
   MXFP4 `*_blocks` U8 [32, out, in/32, 16] / `*_scales` U8 [32, out, in/32], everything else
   bf16) in 3 shards with model.safetensors.index.json (13.8 GB apparent): every tensor a hole
   (zeros) except the embedding and the head (random), the routers and their biases (random:
   4 of 32 experts per token, different per token), the norms (ones), the sinks (random) and the
   E8M0 scales (127 = 1.0, so no subnormal scale enters the kernel's arithmetic).
2. bench/moe_scale.py's measurement (a fresh process: load as stored, getrusage's peak resident
   set, a greedy decode of --tokens tokens per round and thread count beside a read-bandwidth
   probe at the same thread count; a plain numpy read), with the bytes a decoded token reads as
   stored (families/gpt_oss.describe_gpt_oss: attention and router bf16, the head, one embedding
   row, 4 of 32 experts per layer at 17 bytes a block of 32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
CONFIG = ROOT / "tests" / "data" / "gpt-oss-20b.config.json"

from moe_scale import _bf16, measure, write_sparse_checkpoint  # noqa: E402


def hub_tensors(cfg) -> dict:
    """{name: (dtype, shape)} as the Hub stores gpt-oss: the MXFP4 pairs, the rest BF16."""
    from dflash2_numba.families.gpt_oss import expected_gpt_oss_tensors

    inv = expected_gpt_oss_tensors(cfg)
    out = {n: ("BF16", s) for n, s in inv.items()}
    for _, (mxfp4, _dense) in inv.layouts:
        for name, (E, N, K) in mxfp4.items():
            out[name] = ("U8", (E, N, K // 32, 16))
            out[name[: -len("_blocks")] + "_scales"] = ("U8", (E, N, K // 32))
    return out


def fill(name, shape, rng):
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _bf16(rng.standard_normal(shape, np.float32) * 0.5)
    if name.endswith(("mlp.router.weight", "mlp.router.bias", "self_attn.sinks")):
        return _bf16(rng.standard_normal(shape, np.float32))
    if name.endswith("_scales"):
        return np.full(shape, 127, np.uint8)  # 2^0
    if name.endswith("norm.weight"):
        return np.full(shape, 0x3F80, np.uint16)  # bf16 1.0
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/gpt-oss-20b-sparse"))
    ap.add_argument("--tokens", type=int, default=8, help="decoded tokens per (round, thread count)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bw-gib", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpt_oss_scale.json")
    args = ap.parse_args(argv)
    from dflash2_numba.families.gpt_oss import describe_gpt_oss, resolve_gpt_oss_config

    raw = json.loads(CONFIG.read_text())
    cfg = resolve_gpt_oss_config(raw, str(CONFIG))
    t = time.perf_counter()
    model = write_sparse_checkpoint(args.dir, raw, hub_tensors(cfg), fill, shards=3)
    write_s = time.perf_counter() - t
    measure(model, "stored", "mxfp4 (as stored)", describe_gpt_oss(cfg), CONFIG, args, args.out, write_s)


if __name__ == "__main__":
    main()

"""Peak resident memory of a target loaded from a PRE-QUANTIZED checkpoint (quant/stored.py)
against the same weights' bf16 run, each in a fresh process.

    python bench/stored_memory.py [--dir DIR] [--formats fp8,awq,gptq_desc,ct_int4] [--tokens 8]
        [--out bench/results/stored_memory.json]

Writes (once, under --dir) a random Qwen3 whose matrices dominate its memory (~360M parameters
in the layers: hidden 2048, intermediate 5632, 8 layers, vocab 1024), then the same weights as
FP8 (Qwen's block-128 layout), AWQ int4 g128, GPTQ int4 g128 desc_act (tests/quant_ckpt.py's
packers) and compressed-tensors pack-quantized int4 g128 (written by the compressed-tensors
library; needs torch + compressed-tensors + transformers). Each run: load, prefill 16 tokens,
decode --tokens greedy tokens, report getrusage's ru_maxrss (the PEAK resident set, load
included) and the bytes the loaded matrices hold. `baseline` is the interpreter + numba + a
kernel compile, no model: in every row alike. Issue 24's figures: FP8 <= 0.6x bf16, int4 <= 0.35x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))  # the checkpoint packers (tests/quant_ckpt.py)

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128)

CHILD = r"""
import json, sys, numpy as np
def peak_rss_mb():  # VmHWM: this process image's peak (ru_maxrss would carry the parent's over exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
fmt, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {"format": fmt}
if fmt != "baseline":
    from dflash2_numba import generate, load_target
    t = load_target(path)
    ws = [L[k] for L in t.layers for k in ("q", "k", "v", "o", "gate", "up", "down")]
    def held(w):  # StoredWeight.nbytes: its stored arrays; a PackedBF16 holds its panel copy
        p = getattr(w, "panels", None)
        return w.nbytes if p is None else p.nbytes
    out["matrix_bytes"] = int(sum(held(w) for w in ws))
    out["stored_format"] = getattr(ws[0], "format", "bf16")
    out["tokens"] = generate(t, None, prompt_ids=list(range(1, 17)), max_new_tokens=n).output_ids[:8]
else:
    from dflash2_numba.kernels import linear
    linear.linear(np.ones((1, 32), np.float32), np.ones((32, 32), np.float32))
out["peak_rss_mb"] = peak_rss_mb()
print(json.dumps(out))
"""


def write_models(root: Path, formats: list[str]) -> dict[str, Path]:
    from dflash2_numba.tiny import write_target

    root.mkdir(parents=True, exist_ok=True)
    base = root / "bf16"
    if not (base / ".complete").exists():
        print(f"writing the bf16 model to {base} ...", file=sys.stderr)
        write_target(base, architecture="qwen3", dtype="bf16", seed=0, init_std=0.05, **SHAPE)
        (base / ".complete").write_text("ok\n")
    dirs = {"bf16": base}
    for fmt in formats:
        d = root / fmt
        dirs[fmt] = d
        if (d / ".complete").exists():
            continue
        print(f"writing {fmt} to {d} ...", file=sys.stderr)
        import quant_ckpt as qc

        if fmt == "fp8":
            qc.fp8_checkpoint(base, d, block=(128, 128))
        elif fmt == "awq":
            qc.awq_checkpoint(base, d, group=128)
        elif fmt == "gptq_desc":
            qc.gptq_checkpoint(base, d, group=128, desc_act=True)
        elif fmt == "ct_int4":
            write_ct(base, d)
        else:
            raise SystemExit(f"unknown format {fmt!r}")
        (d / ".complete").write_text("ok\n")
    return dirs


def write_ct(base: Path, dst: Path) -> None:
    """compressed-tensors pack-quantized int4 g128 symmetric, by the library (min/max qparams)."""
    import shutil

    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for _, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            N, K = m.weight.shape
            wg = m.weight.data.reshape(N, K // 128, 128)
            s, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
            m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
    comp = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    comp.compress_model(model)
    model.save_pretrained(dst)
    comp.update_config(dst)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
            shutil.copy(f, dst / f.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "dflash2_numba" / "stored_memory")
    ap.add_argument("--formats", default="fp8,awq,gptq_desc,ct_int4")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "stored_memory.json")
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    dirs = write_models(args.dir, formats)
    rows = []
    for fmt in ["baseline", "bf16"] + formats:
        r = subprocess.run([sys.executable, "-c", CHILD, fmt, str(dirs.get(fmt, "")), str(args.tokens)],
                           capture_output=True, text=True, cwd=HERE.parent)
        if r.returncode:
            raise SystemExit(f"{fmt}: child failed:\n{r.stderr[-3000:]}")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    bf16 = next(r["peak_rss_mb"] for r in rows if r["format"] == "bf16")
    base = rows[0]["peak_rss_mb"]
    print(f"  {'format':10s} {'peak RSS MB':>11s} {'x bf16':>7s} {'x bf16 - baseline':>17s} {'matrices MB':>11s}")
    for r in rows:
        r["x_bf16"] = r["peak_rss_mb"] / bf16
        r["x_bf16_above_baseline"] = (r["peak_rss_mb"] - base) / (bf16 - base)
        print(f"  {r['format']:10s} {r['peak_rss_mb']:11.0f} {r['x_bf16']:7.2f} {r['x_bf16_above_baseline']:17.2f} "
              f"{r.get('matrix_bytes', 0) / 1e6:11.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shape = {**SHAPE, "vocab_size": 1024}
    args.out.write_text(json.dumps({"shape": shape, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

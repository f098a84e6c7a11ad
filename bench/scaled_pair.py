"""A function-preserving WIDENED (and DEEPENED) copy of the embedded pair: the same trained
models, K times wider, the target D times deeper.

    python bench/scaled_pair.py 8 [--deepen 4] [--out /tmp/pair-k8]   # writes OUT/{target,dflash2,dflash}
    python bench/acceptance.py --target OUT/target --dflash2 OUT/dflash2 --dflash OUT/dflash

Why: the embedded target (8 MB of bf16) lives in the CPU caches, so a verify step is
compute-bound and speculation cannot pay off on it; real targets stream their weights from
memory. Widening every unit K times makes the weights K^2 larger while every token, logit and
acceptance length stays that of the trained pair, so speculation can be measured in the regime
real models live in, with a real trained tau.

How (every linear map W [out, in], y = x W^T):
- activations are replicated: a widened vector is K copies of the original laid end to end
  (hidden [K*H], heads [K*nh*hd] as K copies of the head list, MLP units [K*I]);
- W' = tile(W, rows K) with its input columns tiled K times and divided by K, so
  y'[a*out + i] = sum_b sum_j W[i, j] / K * x[j] = y[i];
- RMSNorm over K copies has the same mean square, so norms (weights tiled) are unchanged;
  query head a*nh + h reads kv head (a*nh + h) // g = a*nkv + h // g, a copy of its own;
- lookups (embedding rows, DFlash2 base kernels, codebooks) are tiled, not divided; the head is
  untied (the embedding is tiled, the head divided);
- DFlash2 conv groups: G' = K*G with group a*G + g a copy of group g, because the group size S
  is kept; the kernel projection's rows [2, taps, G] become [2, taps, K, G].
Dividing bf16 weights by a power of two is exact, so the widened model differs from the
original only by float summation order.

Deepening (--deepen D, the target only): the trained draft is about half its target's size,
where a published DFlash / DFlash2 draft is 5-13 %, so on the widened pair the draft's own cost
caps the speedup. Deepening gives the target the cost of a D-times deeper model and keeps every
token: after each original layer l come D-1 INERT copies of it whose output projections
(o_proj, down_proj) are zero, so each adds exactly +0 to the residual (x + 0 == x in any float
format) while costing a full layer's products and attention. Layer l moves to index l*D; the
drafts' taps are re-pointed to l*D + D-1, the last layer of its group (the same hidden state),
and their num_target_layers becomes D*L. The script checks that: logits, taps and one DFlash2
proposal against the original.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from dflash2_numba.checkpoint import open_checkpoint  # noqa: E402
from dflash2_numba.numerics import bf16_to_f32_array, f32_to_bf16_array  # noqa: E402
from dflash2_numba.tiny import save_safetensors  # noqa: E402

ASSETS = ROOT / "dflash2_numba" / "assets" / "default"
WIDENED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# ---------------------------------------------------------------- tensor maps
def linear(w: np.ndarray, K: int, in_blocks: int = 1) -> np.ndarray:
    """[out, in_blocks*n] -> [K*out, in_blocks*K*n]: rows tiled, each input block tiled and / K."""
    out = w.shape[0]
    x = w.reshape(out, in_blocks, -1)  # [out, blocks, n]
    x = np.tile(x, (1, 1, K)) / np.float32(K)  # [out, blocks, K*n]
    return np.tile(x.reshape(out, -1), (K, 1))  # [K*out, blocks*K*n]


def head_input(w: np.ndarray, K: int) -> np.ndarray:
    """A map whose OUTPUT is not widened ([V, H] head, [r, H] selector projection): columns only."""
    return np.tile(w, (1, K)) / np.float32(K)  # [out, K*H]


def conv_projection(w: np.ndarray, K: int, taps: int) -> np.ndarray:
    """[2*taps*G, H] -> [2*taps*K*G, K*H]: output rows [2, taps, G] -> [2, taps, K, G]."""
    G = w.shape[0] // (2 * taps)
    x = head_input(w, K).reshape(2, taps, 1, G, -1)  # [2, taps, 1, G, K*H]
    return np.tile(x, (1, 1, K, 1, 1)).reshape(2 * taps * K * G, -1)  # [2*taps*K*G, K*H]


def widen_tensor(name: str, w: np.ndarray, K: int, n_taps: int, conv_taps: int) -> np.ndarray:
    """f32 tensor of the original pair -> its widened f32 counterpart (see the module doc)."""
    if name.endswith(("q_norm.weight", "k_norm.weight")) or "codebook" in name:
        return w  # per-head [hd] norms and token-indexed codebooks are not widened
    if name.endswith("norm.weight"):
        return np.tile(w, K)  # [K*H]
    if name == "model.embed_tokens.weight":
        return np.tile(w, (1, K))  # [V, K*H]: a lookup, copies not divided
    if name in ("lm_head.weight", "candidate_selector.hidden_projection.weight"):
        return head_input(w, K)  # [V or r, K*H]
    if name.endswith("base_kernel"):
        return np.tile(w, (1, 1, K))  # [2, taps, K*H]
    if name.endswith("kernel_projection.weight"):
        return conv_projection(w, K, conv_taps)
    if name == "fc.weight":
        return linear(w, K, in_blocks=n_taps)  # input = n_taps target taps, each widened
    if w.ndim == 2:
        return linear(w, K)  # q/k/v/o, gate/up/down
    raise ValueError(f"{name}: no widening rule for shape {w.shape}")


# ---------------------------------------------------------------- directories
def widen_dir(src: Path, dst: Path, K: int, untie: bool = False) -> Path:
    config = json.loads((src / "config.json").read_text())
    dflash = config.get("dflash_config", {})
    n_taps = len(dflash.get("target_layer_ids", config.get("target_layer_ids", [])))
    ckpt = open_checkpoint(src)
    tensors = {}
    for name in ckpt.names():
        w = ckpt.get(name)
        f32 = bf16_to_f32_array(w) if w.dtype == np.uint16 else np.asarray(w, np.float32)
        out = widen_tensor(name, f32, K, n_taps, dflash.get("conv_kernel_size", 0))
        tensors[name] = f32_to_bf16_array(out) if w.dtype == np.uint16 else out.astype(w.dtype)
    if untie and config.get("tie_word_embeddings"):  # the head is the embedding divided by K
        emb = bf16_to_f32_array(ckpt.get("model.embed_tokens.weight"))
        tensors["lm_head.weight"] = f32_to_bf16_array(head_input(emb, K))
        config["tie_word_embeddings"] = False
    for key in WIDENED_KEYS:
        config[key] *= K
    dst.mkdir(parents=True, exist_ok=True)
    save_safetensors(dst / "model.safetensors", tensors)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for side in SIDE_FILES:
        if (src / side).exists():
            shutil.copy(src / side, dst / side)
    return dst


INERT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # zeroed in the inert copies


def deepen_target(dst: Path, D: int) -> None:
    """Rewrite the target in `dst` D times deeper (module doc): layer l -> l*D, followed by D-1
    copies whose INERT projections are zero."""
    config = json.loads((dst / "config.json").read_text())
    L = config["num_hidden_layers"]
    ckpt = open_checkpoint(dst)
    tensors = {}
    for name in ckpt.names():
        w = np.array(ckpt.get(name))
        if not name.startswith("model.layers."):
            tensors[name] = w
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        for j in range(D):
            inert = j > 0 and rest in INERT
            tensors[f"model.layers.{int(layer) * D + j}.{rest}"] = np.zeros_like(w) if inert else w
    del ckpt
    config["num_hidden_layers"] = L * D
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [t for t in config["layer_types"] for _ in range(D)]
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] *= D
    save_safetensors(dst / "model.safetensors", tensors)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def repoint_draft(dst: Path, D: int) -> None:
    """A draft's taps after target layer l -> after layer l*D + D-1 of the deepened target."""
    config = json.loads((dst / "config.json").read_text())
    for holder in (config, config.get("dflash_config") or {}):
        if "target_layer_ids" in holder:
            holder["target_layer_ids"] = [l * D + D - 1 for l in holder["target_layer_ids"]]
    if "num_target_layers" in config:
        config["num_target_layers"] *= D
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def check(src: Path, dst: Path, K: int) -> dict:
    """Widened vs original on one prompt, as max|diff| / max|value| of the first copy: the target's
    last-row logits and taps, and each draft's final-normed block states; plus the DFlash2
    proposal of that block (identical ids expected)."""
    import dflash2_numba as dn
    from dflash2_numba.decode.sampling import SamplingParams

    ids = np.arange(1, 40, dtype=np.int64) * 37 % 3000  # 39 tokens
    runs = []
    for d in (src, dst):
        t = dn.load_target(d / "target")
        logits, _ = t.forward(ids, t.new_cache(64))
        run = {"logits": logits[-1]}
        for kind in ("dflash2", "dflash"):
            draft = dn.load_draft(d / kind, t)
            _, taps = t.forward(ids[:-1], t.new_cache(64), tap_layers=draft.target_layer_ids)
            state = draft.new_state(64)
            draft.extend_context(state, taps, 0, ids[:-1])
            H = t.config.hidden_size // (K if d == dst else 1)
            run[f"{kind} taps"] = taps[:, :H]  # first tap, first copy
            Q, p = draft.block_size, len(ids) - 1
            run[f"{kind} block"] = draft.block_forward([state], [int(ids[-1])], [p], Q)[:, :H]  # [Q, H]
            if kind == "dflash2":
                prop = draft.propose(state, int(ids[-1]), p, Q, SamplingParams(), np.random.default_rng(0))
                run["proposal"] = list(prop.draft_ids)
        runs.append(run)
    ref, wide = runs
    report = {k: float(np.abs(wide[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in ref if k != "proposal"}
    report["proposal equal"] = ref["proposal"] == wide["proposal"]
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("K", type=int, help="widening factor (a power of two keeps bf16 exact)")
    ap.add_argument("--src", type=Path, default=ASSETS, help="directory holding target/, dflash2/, dflash/")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: a temp dir)")
    ap.add_argument("--deepen", type=int, default=1, metavar="D",
                    help="also make the target D times deeper with inert layers (default 1: not deepened)")
    args = ap.parse_args(argv)
    K, D = args.K, args.deepen
    if K < 1:
        ap.error(f"K must be >= 1, got {K}")
    if D < 1:
        ap.error(f"--deepen must be >= 1, got {D}")
    if K & (K - 1):
        print(f"note: K={K} is not a power of two: weights / K round in bf16", file=sys.stderr)
    out = args.out or Path(tempfile.mkdtemp(prefix=f"dflash2-pair-k{K}-"))
    widen_dir(args.src / "target", out / "target", K, untie=True)
    for kind in ("dflash2", "dflash"):
        widen_dir(args.src / kind, out / kind, K)
    if D > 1:
        deepen_target(out / "target", D)
        for kind in ("dflash2", "dflash"):
            repoint_draft(out / kind, D)
    size = sum(f.stat().st_size for f in (out / "target").glob("*.safetensors"))
    report = check(args.src, out, K)
    print(f"wrote {out} (target {size / 2**20:.1f} MiB of bf16, {D}x deeper)")
    rel = {k: v for k, v in report.items() if k != "proposal equal"}
    print("widened vs original (max|diff| / max|value|): "
          + ", ".join(f"{k} {v:.2e}" for k, v in rel.items())
          + f"; DFlash2 proposal {'identical' if report['proposal equal'] else 'DIFFERENT'}")
    ok = max(rel.values()) < 1e-4 and report["proposal equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""`--draft-quantize auto` (the default): the draft's weight format, chosen from measured step costs.

    fmt, why = choose(target_quantize, device, path, draft_bytes, stored_quantized)
    # fmt: "same" (the target's format) | "bf16" | "q8_0"; why: one line for the user

The draft proposes; the target decides every token. So the draft's weight format changes only how
fast a step drafts and how often its proposals survive, never the output (greedy or sampled).
A draft in a different format from the target is `--draft-quantize FMT`; `auto` picks one where
a measurement showed the other format's draft step clearly cheaper at the same acceptance
(docs/quantization.md, "The draft's format"):

| kernel path | target | draft step, bf16 draft | q8_0 draft | auto |
|---|---|---|---|---|
| avx512_vnni (Zen 4) | bf16 | 8.2 ms | 5.5-5.9 ms | q8_0 |
| avx2 (forced, Zen 4) | q8_0 | 8.6-9.0 ms | 12.0-12.3 ms | bf16 |

(x8 pair's 177 MB DFlash2 draft, 4 rows a step, 2 threads; tau 2.95 in every cell.) A draft
drafts Q rows at once: on VNNI a q8_0 product reads half the bf16 bytes at the same speed per
byte, while AVX2's multi-row q8_0 tile is compute-bound (docs/roofline.md) and the bf16 panels
are not. Everything else stays as the target has it (`same`): a small draft (under
`AUTO_MIN_BYTES` on disk) runs from cache, where the format saves no reading and a second set of
kernels would only add first-run compile time; a draft stored pre-quantized (its config has a
`quantization_config`) runs as stored; the CUDA device runs the draft as the target; a q4_0
target's draft stays q4_0 (the cheapest draft step on both paths measured); the paths and formats
not measured (avx_vnni, generic, q4_k) keep the target's.
"""

from __future__ import annotations

from pathlib import Path

AUTO_MIN_BYTES = 32 * 2**20  # a draft's safetensors at or above this size streams from memory


def draft_bytes(draft_dir) -> int:
    """Bytes of the draft's safetensors files (its weights as stored)."""
    return sum(p.stat().st_size for p in Path(draft_dir).glob("*.safetensors"))


def kernel_path() -> str:
    """The instruction-set path the product kernels compile for (kernels/isa.py)."""
    from ..kernels import isa

    return isa.selected()


def choose(target_quantize: str | None, device: str, path: str, nbytes: int,
           stored_quantized: bool) -> tuple[str, str]:
    """("same" | "bf16" | "q8_0", why). target_quantize: None (bf16 as stored) or the --quantize format;
    path: kernel_path()."""
    target = target_quantize or "bf16"
    if device != "cpu":
        return "same", f"{device} device: the draft runs as the target"
    if stored_quantized:
        return "same", "the draft is stored quantized: it runs as stored"
    if nbytes < AUTO_MIN_BYTES:
        return "same", f"a {nbytes / 2**20:.1f} MiB draft runs from cache"
    size = f"{nbytes / 2**20:.0f} MiB draft"
    if path == "avx512_vnni" and target == "bf16":
        return "q8_0", f"{path} path, bf16 target, {size}: a q8_0 draft step reads half the bytes"
    if path == "avx2" and target == "q8_0":
        return "bf16", f"{path} path, q8_0 target, {size}: the bf16 draft step is cheaper than AVX2's q8_0 tile"
    return "same", f"{path} path, {target} target: the target's format"

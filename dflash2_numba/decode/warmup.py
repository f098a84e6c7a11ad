"""First-run kernel compilation, kept out of the statistics.

numba compiles the CPU kernels on first use (then caches them on disk; later processes load
them) and the CUDA kernels at first launch in every process: ~10-20 s on a cold machine, which a
timed run would report as prefill / draft time. `warm_up` runs the paths a generation takes — a
multi-row prefill, the draft's context update and a full Q-row proposal, a verify block — on a
short prompt first (as llama.cpp warms up before it times), prints one notice when this is the
package's first run here, and says how long compiling took. With block_size "auto" it also
makes the verify cost table (decode/width.py: read from disk, or a sweep of well under a second
on a small pair) before anything is timed. On a cold kernel cache the attention kernels compile
in a second process meanwhile (kernels/background_compile.py, `_meanwhile`).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import numba
import numpy as np

from ..kernels import background_compile
from ..kernels import linear as linear_kernels
from ..kernels.linear import GEMV_MAX_ROWS
from ..kernels.conv import grouped_conv
from ..kernels.rowwise import swiglu
from ..kernels.cache_check import kernel_cache_is_cold, kernels_compiled
from ..models.draft import DFlashDraft
from ..numerics import KV_DTYPES

@contextmanager
def parallel_threshold(macs: int | None):
    """Temporarily set the product size above which the GEMV / attention kernels go parallel
    (None: leave it)."""
    saved = linear_kernels.PARALLEL_MIN_MACS
    if macs is not None:
        linear_kernels.PARALLEL_MIN_MACS = macs
    try:
        yield
    finally:
        linear_kernels.PARALLEL_MIN_MACS = saved


def _warm_prompt_rows(prompt_ids) -> int:
    """Rows of the warm-up prompt: the run's own prompt length when it is known and short (its
    prefill takes the fused layer, like every later step: nothing else to compile), else
    GEMV_MAX_ROWS + 1 rows, a prefill longer than the fused layer takes (the op-by-op graph and
    the blocked attention), as a long prompt's does."""
    if prompt_ids is not None and 1 <= len(prompt_ids) <= GEMV_MAX_ROWS:
        return len(prompt_ids)
    return GEMV_MAX_ROWS + 1


def _has_sinks(target) -> bool:
    """Attention sinks (gpt-oss): its attention kernel takes a per-head array instead of none."""
    return any(isinstance(layer, dict) and "sinks" in layer for layer in getattr(target, "layers", ()))


def _meanwhile(draft, n: int, kw: dict) -> None:
    """Kernels the first layer does not need, compiled while attention compiles in the second
    process (kernels/background_compile.py), with the types a run passes: the draft's context
    update of n rows (and the products, norms and RoPE it calls) into a scratch state, the
    proposal's selector on zero logits with the run's sampling, SwiGLU, a DFlash2 draft's f32 conv."""
    from .sampling import SamplingParams

    c, target = draft.config, draft.target
    draft.extend_context(draft.new_state(n), np.zeros((n, c.n_taps * c.hidden_size), np.float32), 0, list(range(n)))
    sampling = SamplingParams(**{k: kw[k] for k in ("temperature", "top_k", "top_p", "seed") if k in kw})
    rows = draft.block_size - 1  # mask rows
    draft.proposal_from(np.zeros((rows, c.hidden_size), np.float32), np.zeros((rows, target.config.vocab_size), np.float32),
                        0, n, sampling, np.random.default_rng(0))
    swiglu(np.zeros((1, 16), np.float32), np.zeros((1, 16), np.float32))
    if getattr(draft, "taps", 0) and not draft.bf16:  # x [1, H = group_size], delta [1, taps, G = 1], base [taps, H]
        taps, size = draft.taps, draft.group_size
        grouped_conv(np.zeros((1, size), np.float32), np.zeros((1, taps, 1), np.float32),
                     np.zeros((taps, size), np.float32), size, 1)


TOUCH_MAX_BYTES = 256 << 20  # caches up to this size are written through once by the warm-up


def _arrays(obj, depth: int = 3):
    """The numpy arrays a cache or draft state holds (its attributes, lists, nested objects)."""
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, np.ndarray):
                    yield item
                elif depth > 0 and hasattr(item, "__dict__"):
                    yield from _arrays(item, depth - 1)
        elif depth > 0 and hasattr(value, "__dict__") and not callable(value):
            yield from _arrays(value, depth - 1)


def _settle_memory(target, draft, n: int) -> None:
    """Allocate the run's caches once (n positions), write them through and free them: the timed
    runs' caches then take memory the process already holds. Else the first decode of a process
    faulted its cache pages in as its positions grew, ~15 us a step on the embedded pair, and
    the README command's speculative run, timed first, read ~4 % slower than its baseline."""
    def states(length: int) -> list:
        return [target.new_cache(length)] + ([draft.new_state(length)] if isinstance(draft, DFlashDraft) else [])

    one = sum(a.nbytes for st in states(1) for a in _arrays(st))  # >= the bytes per position
    if one * n > TOUCH_MAX_BYTES:  # (a huge budget is refused by name later, by the run itself)
        return
    for st in states(n):
        for a in _arrays(st):
            a.fill(0)


NOTICE = "compiling numba kernels (first run only: they are cached for later runs) ..."


def warm_up(target, draft, *, baseline: bool = False, notice=None, **generate_kwargs) -> float | None:
    """Run the speculative path (and target-only too with `baseline` or no draft) on a prompt as
    long as the run's (`_warm_prompt_rows`) for the prefill token plus one full Q-row step, with
    the same sampling settings.
    NOTICE goes to `notice` (default: stderr) first when the kernel cache is cold. Returns the
    seconds spent when kernels were compiled (CPU cache misses, or any CUDA run), else None."""
    from .loop import generate  # lazy: loop imports its neighbours

    if kernel_cache_is_cold():
        (notice or (lambda text: print(text, file=sys.stderr, flush=True)))(NOTICE)
    before, t0 = kernels_compiled(), time.perf_counter()
    from .width import AUTO, costs_for, parse_block_size

    vocab = max(1, min(target.valid_vocab, target.config.vocab_size))
    given = parse_block_size(generate_kwargs.get("block_size", AUTO))
    auto = draft is not None and given == AUTO
    Q = 1 if draft is None else (draft.block_size if given in (None, AUTO) else given)
    room = getattr(target.config, "max_position_embeddings", 1 << 30) - Q - 2
    ids = [i % vocab for i in range(1, 1 + max(1, min(_warm_prompt_rows(generate_kwargs.get("prompt_ids")), room)))]
    kw = {k: v for k, v in generate_kwargs.items() if k not in ("prompt_ids", "max_new_tokens", "stop_token_ids")}
    kw.update(prompt_ids=ids, max_new_tokens=Q + 1)  # the prefill token, then one Q-row step
    if auto:  # warm the full-width path (auto may not draft at all in a 2-step run)
        kw.update(block_size=Q)
    threads = numba.get_num_threads() > 1
    if getattr(target.ops, "device", "cpu") == "cpu":  # a cold cache: attention compiles in a second process
        child = background_compile.start(KV_DTYPES[getattr(target, "kv_dtype", "f32")], _has_sinks(target), threads)
        try:
            if child.process is not None and isinstance(draft, DFlashDraft):
                _meanwhile(draft, len(ids), kw)
        finally:
            child.wait()
    # the parallel drivers run only above a size threshold that a short prompt never reaches (a
    # long context does, mid-run): with more than one thread, a second pass with the threshold
    # at 0 compiles them too
    for threshold in (None, 0) if threads else (None,):
        with parallel_threshold(threshold):
            if draft is not None:
                generate(target, draft, **kw)
            if baseline or draft is None:
                generate(target, None, **dict(kw, block_size=None))
    if auto:
        # the verify cost table (a short timed sweep once kernels are compiled; cached on disk)
        costs_for(target, draft, int(draft.block_size))
    prompt_ids, max_new = generate_kwargs.get("prompt_ids"), generate_kwargs.get("max_new_tokens")
    if getattr(target.ops, "device", "cpu") == "cpu" and prompt_ids is not None and max_new:
        _settle_memory(target, draft, len(prompt_ids) + int(max_new))
    compiled = kernels_compiled() > before or getattr(target.ops, "device", "cpu") == "cuda"
    return time.perf_counter() - t0 if compiled else None

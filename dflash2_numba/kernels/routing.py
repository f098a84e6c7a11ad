"""MoE routing (models/moe.py): per row, softmax over all experts in f32, the top k (ties: the
lowest id), renormalised on request. ONE numba kernel serves the op-by-op path and the fused
MoE layer (kernels/fused_moe.py), so both see the same bits; `route_reference` is the numpy
definition it is tested against (tests/test_moe.py)."""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numerics import round_bf16


@njit(cache=True, nogil=True)
def route_rows(logits, k, renormalize, bf16, ids, weights):
    """logits [n, E] f32 -> ids [n, k] int64 (descending probability, ties: lowest id first) and
    weights [n, k] f32: softmax over all E in f32, the top k, divided by their sum iff
    renormalize; in bf16 run mode the weights are then rounded to bf16 (HF casts them to the
    logits' dtype)."""
    n, E = logits.shape
    p = np.empty(E, np.float32)
    taken = np.zeros(E, np.bool_)
    for r in range(n):
        m = logits[r, 0]
        for e in range(1, E):
            if logits[r, e] > m:
                m = logits[r, e]
        s = np.float32(0.0)
        for e in range(E):
            p[e] = np.float32(np.exp(logits[r, e] - m))
            s += p[e]
        for e in range(E):
            p[e] = p[e] / s
            taken[e] = False
        total = np.float32(0.0)
        for j in range(k):
            best = -1
            for e in range(E):  # strictly greater: the lowest id wins a tie
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[r, j] = best
            weights[r, j] = p[best]
            total += p[best]
        for j in range(k):
            w = weights[r, j] / total if renormalize else weights[r, j]
            weights[r, j] = round_bf16(w) if bf16 else w


def route_reference(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """numpy: logits [n, E] -> (ids [n, k], weights [n, k]) as route_rows (f32 run mode)."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)  # [n, E]
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]  # stable: lowest id first among equals
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


def route(logits: np.ndarray, k: int, renormalize: bool, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    """route_rows on a fresh pair of output arrays: -> (ids [n, k] int64, weights [n, k] f32)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    ids = np.empty((logits.shape[0], k), np.int64)
    weights = np.empty((logits.shape[0], k), np.float32)
    route_rows(logits, int(k), bool(renormalize), bool(bf16), ids, weights)
    return ids, weights


# ------------------------------------------------------------------ gpt-oss: top-k, then softmax
@njit(cache=True, nogil=True)
def route_topk_softmax_rows(logits, k, ids, weights):
    """gpt-oss's router (families/gpt_oss.py): logits [n, E] f32 (bias already added) -> ids
    [n, k] (descending logit, ties: lowest id first) and weights [n, k] f32 = softmax over the k
    SELECTED logits only (the other experts never enter the denominator)."""
    n, E = logits.shape
    taken = np.zeros(E, np.bool_)
    for r in range(n):
        for e in range(E):
            taken[e] = False
        for j in range(k):
            best = -1
            for e in range(E):  # strictly greater: the lowest id wins a tie
                if not taken[e] and (best < 0 or logits[r, e] > logits[r, best]):
                    best = e
            taken[best] = True
            ids[r, j] = best
        m = logits[r, ids[r, 0]]  # the largest selected logit
        s = np.float32(0.0)
        for j in range(k):
            weights[r, j] = np.float32(np.exp(logits[r, ids[r, j]] - m))
            s += weights[r, j]
        for j in range(k):
            weights[r, j] = weights[r, j] / s


def route_topk_softmax_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy: logits [n, E] -> (ids [n, k], weights [n, k]) as route_topk_softmax_rows."""
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # stable: lowest id first among equals
    z = np.take_along_axis(logits, ids, axis=1).astype(np.float64)  # [n, k]
    w = np.exp(z - z.max(axis=1, keepdims=True))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def route_topk_softmax(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """route_topk_softmax_rows on fresh outputs: -> (ids [n, k] int64, weights [n, k] f32)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    ids = np.empty((logits.shape[0], k), np.int64)
    weights = np.empty((logits.shape[0], k), np.float32)
    route_topk_softmax_rows(logits, int(k), ids, weights)
    return ids, weights

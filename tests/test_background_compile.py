"""The cold start's second process (kernels/background_compile.py): it compiles the attention
drivers with exactly the signature the run asks for, and a cold run then loads them instead of
compiling them itself."""

import json
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba.kernels import attention, background_compile
from dflash2_numba import tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bg")
    target = tiny.write_target(root / "target", seed=2, init_std=0.2)
    return {"target": target, "dflash2": tiny.write_draft(root / "dflash2", target, kind="dflash2", block_size=8, seed=4)}


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_the_childs_signature_is_the_one_the_fused_layer_and_the_op_by_op_path_use(pair, kv_dtype):
    """Red when the child's arguments drift from the run's types (e.g. a writeable NO_SINKS: the
    fused layer types its global as read-only): the child would then compile a kernel the run
    never loads. A layer loaded from the disk cache does not type its callees, so the layer's
    body is typed afresh here (an uncached copy of each variant the run used, compiled for the
    run's signatures): that asks `_attention_ser` for exactly the types the layer passes."""
    from dflash2_numba.kernels import fused

    target = dn.load_target(pair["target"], kv_dtype=kv_dtype)
    draft = dn.load_draft(pair["dflash2"], target)
    dn.generate(target, draft, prompt_ids=[5, 17, 200, 33], max_new_tokens=6, block_size=4)  # the fused layer
    kv = {"f32": np.float32, "bf16": np.uint16}[kv_dtype]
    used = [fused._layer_kernel(b, p) for b in (False, True) for p in (False, True)]
    for kernel in (k for k in used if k.signatures):
        fresh = numba.njit(nogil=True)(kernel.py_func)
        for layer_sig in kernel.signatures:
            if layer_sig[4].dtype == numba.from_dtype(kv):  # kbuf: this run's K/V dtype
                fresh.compile(layer_sig)
    args = background_compile.attention_args(np.dtype(kv).name, False)
    sig = tuple(numba.typeof(a) for a in args)
    assert sig in attention._attention_ser.signatures
    before = len(attention._attention_ser.signatures)
    q, k, v, q_pos, k_pos = args[:5]
    attention.attention(q, k, v, q_pos, k_pos)  # the op-by-op path: no second specialisation
    assert len(attention._attention_ser.signatures) == before


COLD_RUN = """
import json, sys
import dflash2_numba as dn
from dflash2_numba.decode.warmup import warm_up
from dflash2_numba.kernels import attention
target = dn.load_target(sys.argv[1]); draft = dn.load_draft(sys.argv[2], target)
warm_up(target, draft, prompt_ids=[5, 17, 200, 33], max_new_tokens=6, block_size=4)
st = attention._attention_ser.stats
print(json.dumps({"misses": sum(st.cache_misses.values()), "hits": sum(st.cache_hits.values())}))
"""


@pytest.mark.skipif(background_compile._cpus() < 2, reason="one CPU: no child is started")
def test_a_cold_run_loads_attention_compiled_by_the_child(pair, tmp_path):
    """An empty kernel cache: the warm-up's child compiles attention, the run itself only loads it
    (one cache hit, no miss). Red on a child that is not started or not waited for, or that
    compiles another signature."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop(background_compile.ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", COLD_RUN, str(pair["target"]), str(pair["dflash2"])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"misses": 0, "hits": 1}


def test_no_child_on_a_warm_cache_on_one_cpu_or_when_switched_off(pair, monkeypatch):
    from dflash2_numba.kernels import cache_check

    monkeypatch.setattr(cache_check, "kernel_cache_is_cold", lambda: False)
    assert background_compile.start(np.float32, False, False).process is None
    monkeypatch.setattr(cache_check, "kernel_cache_is_cold", lambda: True)
    monkeypatch.setattr(background_compile, "_cpus", lambda: 1)
    assert background_compile.start(np.float32, False, False).process is None
    monkeypatch.setattr(background_compile, "_cpus", lambda: 2)
    monkeypatch.setenv(background_compile.ENV_SWITCH, "0")
    assert background_compile.start(np.float32, False, False).process is None


def test_the_warm_up_waits_for_the_child_before_the_first_layer(pair, monkeypatch):
    """The order in decode/warmup.py: child started, the draft's context update meanwhile, the
    child joined, then the first generation (whose layer would otherwise compile attention
    itself while the child still does). Red on a warm-up that does not wait."""
    from dflash2_numba.decode import loop, warmup

    events = []

    class Child:
        def wait(self):
            events.append("wait")

    handle = background_compile.BackgroundCompile(Child())
    monkeypatch.setattr(background_compile, "start", lambda *a: handle)
    monkeypatch.setattr(warmup, "_meanwhile", lambda draft, n, kw: events.append("meanwhile"))
    monkeypatch.setattr(loop, "generate", lambda *a, **k: events.append("generate"))
    target = dn.load_target(pair["target"])
    draft = dn.load_draft(pair["dflash2"], target)
    warmup.warm_up(target, draft, prompt_ids=[5, 17], max_new_tokens=4, block_size=4)
    assert events[:3] == ["meanwhile", "wait", "generate"]

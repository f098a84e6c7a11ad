"""The examples run as shipped (on a tiny pair written by the writer)."""

import os
import subprocess
import sys
from pathlib import Path

from dflash2_numba import tiny

ROOT = Path(__file__).resolve().parents[1]


def test_stream_example_matches_target_only(tmp_path):
    import dflash2_numba as dn

    tiny.write_target(tmp_path / "t", seed=0, init_std=0.2)
    tiny.write_draft(tmp_path / "d", tmp_path / "t", kind="dflash2", block_size=4)
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "stream.py"), "--target", str(tmp_path / "t"),
         "--draft", str(tmp_path / "d"), "--prompt", "def add(a, b):", "--max-new-tokens", "12"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"},
    )
    assert run.returncode == 0, run.stderr
    target = dn.load_target(tmp_path / "t")
    expected = dn.generate(target, None, "def add(a, b):", max_new_tokens=12).text
    assert run.stdout.rstrip("\n") == expected.rstrip("\n")
    assert "finish: length" in run.stderr and "tau" in run.stderr

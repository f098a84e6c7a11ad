"""The embedded default model pair, used when `dflash2-decode` gets no `--target`.

Preference order:
1. `dflash2_numba/assets/default/target` (+ `assets/default/dflash2` when present): a small
   target trained on the package's corpus and its DFlash2 draft, shipped inside the package;
2. otherwise a tiny RANDOM pair written once with `tiny.write_target` / `tiny.write_draft` into
   `$DFLASH2_CACHE/tiny-default-v1` (default `~/.cache/dflash2_numba/tiny-default-v1`). Its
   output is gibberish and its draft is untrained (low acceptance); a notice on stderr says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ASSET_DIR = Path(__file__).parent / "assets" / "default"
TINY_NAME = "tiny-default-v1"  # bump when the tiny pair's recipe changes


def cache_root() -> Path:
    env = os.environ.get("DFLASH2_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash2_numba"


def _write_tiny_pair(dest: Path) -> None:
    """Write target + DFlash2 draft into a temp dir beside `dest`, then rename it into place,
    so a concurrent or interrupted first run never leaves a half-written pair."""
    from . import tiny

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        tiny.write_target(tmp / "target", seed=0, dtype="bf16")
        tiny.write_draft(tmp / "dflash2", tmp / "target", kind="dflash2", block_size=8, seed=1,
                         dtype="bf16")
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race: use theirs
            if not (dest / "target" / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_pair(notice=True) -> tuple[Path, Path | None]:
    """(target_dir, draft_dir or None) of the embedded default; writes the tiny pair once."""
    if (ASSET_DIR / "target" / "config.json").is_file():
        draft = ASSET_DIR / "dflash2"
        return ASSET_DIR / "target", draft if (draft / "config.json").is_file() else None
    dest = cache_root() / TINY_NAME
    if not (dest / "target" / "config.json").is_file():
        _write_tiny_pair(dest)
    if notice:
        print(f"notice: no --target given and no trained default ships with this install; using a "
              f"tiny RANDOM target + untrained DFlash2 draft from {dest} (gibberish text, low "
              "acceptance; for a smoke test only)", file=sys.stderr)
    return dest / "target", dest / "dflash2"

"""Corpus and tokenizer: the running interpreter's standard library, tests excluded.

    stdlib_files()            -> [relative path]   sorted, tests and site-packages excluded
    split_of(rel)             -> "train" | "heldout"   by sha256 of the relative path
    train_tokenizer(texts)    -> Tokenizer          byte-level BPE + <|endoftext|>, <|mask|>
    write_tokenizer_files(dir, tok, ...)            tokenizer.json + chat-free tokenizer_config.json

The split is a pure function of the relative path (sha256), so it does not depend on file
order, on the machine, or on which Python minor version's stdlib happens to be installed
(a file present in two versions lands on the same side).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
MASK = "<|mask|>"
HELDOUT_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel: str) -> bool:
    """Tests (any `test/`, `tests/`, `idle_test/` folder or `test_*.py`) and site-packages."""
    s = "/" + rel
    name = rel.rsplit("/", 1)[-1]
    return ("/test/" in s or "/tests/" in s or "idlelib/idle_test" in s
            or name.startswith("test_") or "site-packages" in s)


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of every non-test `*.py` under the stdlib, sorted."""
    root = root or stdlib_root()
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    return sorted(r for r in rels if not is_excluded(r))


def split_of(rel: str, heldout_percent: int = HELDOUT_PERCENT) -> str:
    """Stable train / held-out assignment from sha256(relative path)."""
    bucket = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "little") % 100
    return "heldout" if bucket < heldout_percent else "train"


def read_split(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """-> {"train": [(rel, text)], "heldout": [(rel, text)]}; unreadable / empty files skipped."""
    root = root or stdlib_root()
    out: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    for rel in stdlib_files(root):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are latin-1 test fixtures; not worth special cases
        if text.strip():
            out[split_of(rel)].append((rel, text))
    return out


def train_tokenizer(texts: list[str], n_merged: int) -> Tokenizer:
    """Byte-level BPE with `n_merged` learned entries (all 256 bytes included), then the two
    special tokens after them, as Qwen3 does: ids n_merged (<|endoftext|>), n_merged+1 (<|mask|>).

    Deterministic: BPE training has no randomness (ties are broken by the trainer's ordering
    of the same input)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=n_merged, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != n_merged:
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} entries, expected {n_merged}")
    tok.add_special_tokens([ENDOFTEXT, MASK])
    return tok


def write_tokenizer_files(model_dir: Path, tok: Tokenizer, max_len: int) -> None:
    """tokenizer.json and a chat-free tokenizer_config.json (this is a base code model)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

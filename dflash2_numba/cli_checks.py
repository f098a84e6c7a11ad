"""Checks of the CLI's own values (spec §9): everything here runs BEFORE a model is loaded or a
token is decoded, so a bad value never leaves half a result on stdout.

    parse_prompt_ids("1,2,3") -> [1, 2, 3]        "1,,2" / "1,a" / "" -> GenerationArgumentError
    read_prompt_file(path)    -> str              over MAX_PROMPT_FILE_BYTES -> ContextLengthError
    check_output_path(dest)                       --json PATH that cannot be written -> OutputPathError
    one_line(error)           -> "error: Name: message" on one line
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ContextLengthError, GenerationArgumentError, OutputPathError

# Refused before reading: a prompt this large cannot fit any supported target's positions
# (more than 16M bytes is more than ~4M tokens), and tokenizing it would take the memory anyway.
MAX_PROMPT_FILE_BYTES = 16 * 2 ** 20


def one_line(error: Exception) -> str:
    """The CLI's error contract: `error: ClassName: message`, whitespace folded to one line."""
    text = error.format_message() if hasattr(error, "format_message") else str(error)  # click: names the option
    msg = " ".join(text.split())
    return f"error: {type(error).__name__}: {msg}"


def parse_prompt_ids(text: str) -> list[int]:
    """Comma-separated integers; an empty item (`1,,2`, a trailing comma, "") is refused, not
    skipped: it is a typo, and dropping it would decode another prompt."""
    ids = []
    for i, item in enumerate(text.split(",")):
        item = item.strip()
        if not item:
            raise GenerationArgumentError(
                f"--prompt-ids {text!r}: item {i} is empty; expected comma-separated integers like 1,2,3")
        try:
            ids.append(int(item))
        except ValueError as e:
            raise GenerationArgumentError(
                f"--prompt-ids {text!r}: item {i} = {item!r} is not an integer; expected comma-separated "
                "integers like 1,2,3") from e
    return ids


def read_prompt_file(path: str) -> str:
    try:
        size = os.stat(path).st_size
        if size > MAX_PROMPT_FILE_BYTES:
            raise ContextLengthError(
                f"--prompt-file {path}: {size} bytes, more than the {MAX_PROMPT_FILE_BYTES}-byte limit "
                "for a prompt (no supported target holds that many positions)")
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationArgumentError(f"--prompt-file {path}: cannot read ({e})") from e


def check_output_path(dest: str | None, option: str = "--json") -> None:
    """`dest` ("-" = stdout, None = none) must be a file we can create or overwrite. Checked
    before decoding: a run must not print its text and statistics, then fail to save them."""
    if dest is None or dest == "-":
        return
    path = Path(dest)
    if path.is_dir():
        raise OutputPathError(f"{option} {dest}: is a directory, expected a file path")
    parent = path.parent
    if not parent.exists():
        raise OutputPathError(f"{option} {dest}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{option} {dest}: {parent} is not a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{option} {dest}: the file exists and is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {dest}: cannot create a file in {parent} (no write permission)")

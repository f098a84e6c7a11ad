"""Every text file the package reads, read with a size bound (spec §9: bad input is a named error).

    read_bounded(path, limit, what, error)  -> bytes     at most `limit` bytes, else `error` naming it
    read_text_file(path, limit, what, error) -> str      the same, decoded as UTF-8
    read_json_object(path, limit, error)     -> dict     parsed; bad JSON / not an object -> `error`
    model_file(path, what)                   -> Path     a model directory's file: a regular file or refused

Why bounded: a path can name something that never ends (`--prompt-file /dev/zero`, a FIFO fed
forever, a `config.json` symlinked to a device) or a sparse file of terabytes. `Path.read_text`
would allocate until the process dies with a MemoryError traceback; here at most `limit + 1`
bytes are ever read. A regular file's size is checked from `fstat` before reading anything.

Model-directory files (config.json, tokenizer.json, ...) must be regular files (`model_file`);
the prompt file may be a pipe or a device (process substitution `<(...)`), so only its size is
bounded.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import CheckpointNotFoundError

# Limits: far above any real file of that kind, far below what parsing would take a machine down with.
MAX_CONFIG_BYTES = 16 * 2 ** 20  # config.json, generation_config.json, tokenizer_config.json, index, template
MAX_TOKENIZER_BYTES = 256 * 2 ** 20  # tokenizer.json (Qwen3's is 11 MB, the largest public ones ~35 MB)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def model_file(path: Path, what: str) -> Path:
    """`path` is an existing entry of a model directory: it must be a regular file (after
    symlinks). A device, FIFO or directory in its place is refused by name, not read."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CheckpointNotFoundError(f"{path}: {what} cannot be read ({e.strerror})") from e
    if not stat.S_ISREG(mode):
        raise CheckpointNotFoundError(f"{path}: {what} is {_kind(mode)}, expected a regular file")
    return path


def read_bounded(path, limit: int, what: str, error: type[Exception],
                 too_long: type[Exception] | None = None) -> bytes:
    """The bytes of `path`, refusing (`error`, naming `what`, the size and the limit) anything
    longer than `limit` bytes: a regular file by its size before reading, a stream after reading
    `limit + 1` bytes. OSError (missing, no permission, a directory) -> `error` too. `what`
    (an option name such as "--prompt-file", or "") goes in front of the path in messages;
    `too_long` (default `error`) is the class of the size refusal."""
    too_long = too_long or error
    label = f"{what} {path}" if what else str(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"{label}: cannot read ({e.strerror or e})") from e
    with f:
        st = os.fstat(f.fileno())
        mode = st.st_mode
        if stat.S_ISREG(mode) and st.st_size > limit:
            raise too_long(f"{label}: {st.st_size} bytes, more than the {limit}-byte limit")
        try:
            data = f.read(limit + 1)
        except OSError as e:  # EISDIR, EIO, ...
            raise error(f"{label}: cannot read ({e.strerror or e})") from e
    if len(data) > limit:
        raise too_long(f"{label}: more than the {limit}-byte limit ({_kind(mode)} that did not end "
                    f"within {limit} bytes)")
    return data


def read_text_file(path, limit: int, what: str, error: type[Exception],
                   too_long: type[Exception] | None = None) -> str:
    """`read_bounded`, decoded as UTF-8 (invalid UTF-8 -> `error` naming the byte offset)."""
    data = read_bounded(path, limit, what, error, too_long)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{f'{what} ' if what else ''}{path}: not valid utf-8 ({e})") from e


def read_json_object(path: Path, limit: int, error: type[Exception], what: str = "",
                     not_object: type[Exception] | None = None) -> dict:
    """A model directory's JSON file (a regular file, at most `limit` bytes, UTF-8) parsed to a
    dict; anything else -> `error` naming the file (`not_object`, default `error`, for valid
    JSON that is not an object)."""
    model_file(path, what or path.name)
    text = read_text_file(path, limit, "", error)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:  # json recurses once per nesting level
        raise error(f"{path}: JSON nested too deeply to parse (corrupt)") from e
    if not isinstance(obj, dict):
        raise (not_object or error)(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj

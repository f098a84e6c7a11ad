"""Checks of the CLI's own values (spec §9): everything here runs BEFORE a model is loaded or a
token is decoded, so a bad value never leaves half a result on stdout.

    parse_prompt_ids("1,2,3") -> [1, 2, 3]        "1,,2" / "1,a" / "" -> GenerationArgumentError
    read_prompt_file(path)    -> str              over MAX_PROMPT_FILE_BYTES -> ContextLengthError
    open_output(dest) -> OutputFile | None        --json PATH created/opened now -> OutputPathError
    emit(text)                                    stdout write; a full / closed stdout -> OutputPathError
    one_line(error)           -> "error: Name: message" on one line
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from .errors import ContextLengthError, GenerationArgumentError, OutputPathError
from .input_files import read_text_file

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
    """The prompt text: at most MAX_PROMPT_FILE_BYTES are read, whatever `path` is (a regular
    file by its size, a pipe or a device such as /dev/zero by reading one byte past the limit):
    no supported target holds that many positions."""
    return read_text_file(path, MAX_PROMPT_FILE_BYTES, "--prompt-file", GenerationArgumentError,
                          too_long=ContextLengthError)


class OutputFile:
    """A `--json PATH` destination, opened (created if absent) BEFORE any work, written once at
    the end. Opening first is the only check that cannot lie: `os.access` says yes to root for
    /proc, /sys or a read-only mount, where creating the file then fails. An existing file is
    not truncated until `write`, and a file this run created is removed by `discard` when the
    run fails before writing: nothing half-done is left behind."""

    def __init__(self, path: str, option: str, fd: int, created: bool):
        self.path, self.option, self.fd, self.created = path, option, fd, created

    def write(self, text: str) -> None:
        """Replace the file's content with `text`; a failure here (a full device, EIO) is one
        OutputPathError naming the destination."""
        try:
            if stat.S_ISREG(os.fstat(self.fd).st_mode):
                os.ftruncate(self.fd, 0)
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            raise OutputPathError(f"{self.option} {self.path}: cannot write ({e.strerror})") from e
        finally:
            self._close()

    def discard(self) -> None:
        self._close()
        if self.created:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_output(dest: str | None, option: str = "--json") -> OutputFile | None:
    """`dest` ("-" = stdout, None = none) opened for writing now, so that a run never prints its
    text and statistics and then fails to save them. O_NONBLOCK: a FIFO nobody reads is refused
    (ENXIO) instead of blocking the run forever."""
    if dest is None or dest == "-":
        return None
    path = Path(dest)
    if path.is_dir():
        raise OutputPathError(f"{option} {dest}: is a directory, expected a file path")
    parent = path.parent
    if not parent.exists():
        raise OutputPathError(f"{option} {dest}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{option} {dest}: {parent} is not a directory")
    existed = os.path.lexists(dest)
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = ("a FIFO that nobody reads" if e.errno == errno.ENXIO else
               "no permission" if e.errno in (errno.EACCES, errno.EPERM) else e.strerror)
        raise OutputPathError(f"{option} {dest}: cannot create or open the file ({why})") from e
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return OutputFile(dest, option, fd, created=not existed)

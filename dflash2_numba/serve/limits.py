"""HTTP limits that hold under abuse: what one client may make the server read, parse and
tokenise, and what error text may tell it.

    raw = await read_body(request, max_bytes)        # 413 from Content-Length alone, or as soon as
                                                     # a chunked body passes max_bytes
    body = parse_json(raw, max_depth)                # 400 invalid_json / json_too_deep, never a 500
    tok = OffloadedTokenizer(tokenizer)              # texts past INLINE_CHARS tokenise in a worker
                                                     # PROCESS (the Rust tokenizer holds the GIL)
    scrub(message, {"/srv/models/Qwen3-8B": "Qwen3-8B"})   # no server path in a client message

Why a process: `tokenizers`' encode does not release the GIL: an 8 MB prompt held every thread
of the server (the event loop included) for 6 s on the development VM. Requests with a body
past OFFLOAD_BYTES are parsed in a thread (JSON, the chat template, id checks: Python that
yields the GIL), and their long texts are tokenised by one spawned worker process, so /health
and small requests are served meanwhile. Small bodies are parsed on the event loop (faster than
a hop through a thread).
"""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor

from .protocol import BadRequest, RequestError, Unavailable

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # --max-body-mb 16
DEFAULT_MAX_JSON_DEPTH = 32  # objects / arrays nested in a request body (OpenAI bodies need ~6)
OFFLOAD_BYTES = 64 * 1024  # bodies past this are parsed off the event loop
INLINE_CHARS = OFFLOAD_BYTES  # texts past this are tokenised in the worker process (a body parsed on the
# event loop is <= OFFLOAD_BYTES, so its texts are too: the loop never waits on the worker)
MAX_OFFLOADED = 4  # large bodies being parsed at once; more wait (bounded memory and CPU)


class PayloadTooLarge(RequestError):
    status, type = 413, "invalid_request_error"


async def read_body(request, max_bytes: int) -> bytes:
    """The request body, refused (413) before reading past `max_bytes`: at once when the
    Content-Length header says so, else as soon as the received bytes pass it."""
    def too_large(n: str) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body is {n} bytes; this server accepts at most {max_bytes} "
                               "(--max-body-mb)", code="request_too_large")

    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise BadRequest("the Content-Length header is not a number", code="invalid_request")
        if int(length) > max_bytes:
            raise too_large(length)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > max_bytes:
            raise too_large(f"more than {max_bytes}")
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth_exceeds(obj, max_depth: int) -> bool:
    """True when containers nest deeper than max_depth (iterative: no recursion to overflow)."""
    stack = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d > max_depth:
                return True
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH):
    """Bytes -> the decoded JSON value, or a 400 (invalid JSON, nested past max_depth)."""
    too_deep = BadRequest(f"the request body nests JSON deeper than {max_depth} levels", code="json_too_deep")
    try:
        body = json.loads(raw)
    except RecursionError:  # the C decoder's own bound (~1000 levels)
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if json_depth_exceeds(body, max_depth):
        raise too_deep
    return body


# ---------------------------------------------------------------- tokenising off the GIL
_worker_tok = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tok
    from tokenizers import Tokenizer
    _worker_tok = Tokenizer.from_str(tokenizer_json)


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return _worker_tok.encode(text, add_special_tokens=add_special_tokens).ids


class OffloadedTokenizer:
    """The server's tokenizer with `encode` of long texts run in ONE worker process (spawned,
    so it inherits no threads); everything else is the wrapped Tokenizer's."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def start(self) -> None:
        """Spawn the worker now (a second or so), not at the first long prompt."""
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                                 initargs=(self.tok.hf.to_str(),))
                self._pool.submit(_encode, "warm", False).result()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        try:
            self.start()
            ids = self._pool.submit(_encode, text, add_special_tokens).result()  # this thread waits, GIL free
        except Exception as e:  # the worker died (killed, out of memory): a fresh one next time
            self.close()
            raise Unavailable(f"the tokenizer worker failed ({type(e).__name__}); try again",
                              code="tokenizer_unavailable") from None
        return self.tok.with_bos(ids, add_special_tokens)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


# ---------------------------------------------------------------- no server paths in messages
_ABS_PATH = re.compile(r"(?<![\w.:/~])~?/(?!v1/)(?:[^\s/'\"(),;:]+/)*[^\s/'\"(),;:]+")


def scrub(message: str, names: dict[str, str]) -> str:
    """Each known path (longest first) -> its public name (the model id); any other absolute
    path -> '<path>'."""
    for path in sorted(names, key=len, reverse=True):
        if path:
            message = message.replace(path, names[path])
    return _ABS_PATH.sub("<path>", message)

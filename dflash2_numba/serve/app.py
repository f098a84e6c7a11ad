"""The HTTP routes (Starlette), kept small: parse, hand the request to the engine thread, relay
its events as an OpenAI response or SSE stream. No handler runs a kernel.

    GET  /health                 503 {"status": "loading" | "draining" | ...} until ready, then 200
    GET  /metrics                Prometheus text (serve/metrics.py)
    GET  /v1/models              the one model this server runs
    POST /v1/chat/completions    chat (the target's chat template), streamed or not
    POST /v1/completions         text completions, streamed or not

Request bodies pass serve/limits.py first: past --max-body-mb a 413 (from Content-Length
alone, before the body is read), JSON nested past --max-json-depth a 400; a large body is
parsed and tokenised off the event loop. Error messages name the model id, never a server path.

A completions request with several prompts runs them as one batch of engine requests (each its
own choice, `index` in prompt order). `logprobs` / `echo` come from the engine's per-token
numbers (serve/logprobs.py); chat text a thinking format marks is `reasoning_content`
(serve/reasoning.py).

Streams: `data: {chunk}` events; chat starts with a role chunk; the last choice chunk carries
finish_reason (and llama.cpp-style `timings`); with stream_options.include_usage a usage-only
chunk (choices: []) follows; then `data: [DONE]`. An error after the stream started is sent as
`data: {"error": {...}}` before [DONE]. A client that disconnects cancels its request (the
engine frees the slot at its next step).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import READY, Engine, Job
from .limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH, MAX_OFFLOADED, OFFLOAD_BYTES,
                     OffloadedTokenizer, parse_json, read_body, scrub)
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import RequestError, ServerError, Unavailable, parse_requests

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class Limits:
    def __init__(self, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH):
        self.max_body_bytes, self.max_json_depth = int(max_body_bytes), int(max_json_depth)


def build_app(engine: Engine, model_id: str, limits: Limits | None = None) -> Starlette:
    limits = limits or Limits()
    heavy = asyncio.Semaphore(MAX_OFFLOADED)
    shared: dict = {}  # the offloading tokenizer and the path -> model id names, once the engine is ready

    def tokenizer() -> OffloadedTokenizer:
        if "tok" not in shared:
            shared["tok"] = OffloadedTokenizer(engine.target.tokenizer)
        return shared["tok"]

    def names() -> dict:
        out = {}
        for m in (engine.target, engine.draft):
            for attr in ("model_dir",):
                for owner in (m, getattr(m, "tokenizer", None), getattr(m, "config", None)):
                    v = getattr(owner, attr, None) if owner is not None else None
                    if v is not None:
                        out[str(v)] = model_id
        return out

    def error_response(e: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(e.retry_after_s)} if hasattr(e, "retry_after_s") else None
        body = e.body()
        body["error"]["message"] = scrub(body["error"]["message"], names())
        return JSONResponse(body, status_code=e.status, headers=headers)

    def error_event(ev: dict) -> dict:
        return {"error": {"message": scrub(ev["message"], names()), "type": "server_error", "param": None,
                          "code": ev["code"]}}

    async def health(request: Request) -> Response:
        ok = engine.state == READY
        return JSONResponse({"status": "ok" if ok else engine.state}, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "dflash2-numba"}]})

    async def chat(request: Request) -> Response:
        return await _complete(request, "chat")

    async def completions(request: Request) -> Response:
        return await _complete(request, "completion")

    def _parse(raw: bytes, kind: str) -> list:
        body = parse_json(raw, limits.max_json_depth)
        reqs = parse_requests(body, kind, {model_id}, tokenizer(), engine.target.valid_vocab)
        return [engine.check(r) for r in reqs]

    async def _complete(request: Request, kind: str) -> Response:
        try:
            if engine.state != READY:
                engine.record_rejected("not_ready" if engine.state == "loading" else "draining")
                raise Unavailable(f"the server is {engine.state}; try again later", code=engine.state)
            try:
                raw = await read_body(request, limits.max_body_bytes)
                if len(raw) > OFFLOAD_BYTES:  # JSON, template, tokens: off the event loop
                    async with heavy:
                        reqs = await asyncio.to_thread(_parse, raw, kind)
                else:
                    reqs = _parse(raw, kind)
            except RequestError:
                engine.record_rejected("invalid")
                raise
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            jobs = [Job(r, sink=_sink(loop, events, r.index)) for r in reqs]
            engine.submit_all(jobs)
        except RequestError as e:
            return error_response(e)
        except Exception as e:  # a bug: say so in OpenAI's shape (and the log), not as a bare 500 page
            traceback.print_exc(file=sys.stderr)
            engine.record_rejected("invalid")
            return error_response(ServerError(f"internal error while reading the request ({type(e).__name__})",
                                              code="internal_error"))
        shape = _Shape(kind, model_id, jobs, reasoning=kind == "chat" and engine.reasoning is not None)
        if reqs[0].stream:
            return StreamingResponse(_stream(jobs, events, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, jobs, events, shape)

    def _cancel(jobs: list[Job]) -> None:
        for job in jobs:
            engine.cancel(job)

    async def _stream(jobs: list[Job], events: asyncio.Queue, shape: "_Shape"):
        done, left, usage = False, {j.req.index for j in jobs}, []
        try:
            if shape.kind == "chat":
                yield _sse(shape.chunk(0, {"role": "assistant", "content": ""}))
            while True:
                ev = await events.get()
                i = ev["index"]
                if ev["type"] in ("prompt", "text"):
                    for chunk in shape.deltas(i, ev):
                        yield _sse(chunk)
                    continue
                if ev["type"] == "error":
                    done = True
                    _cancel(jobs)
                    yield _sse(error_event(ev))
                    yield "data: [DONE]\n\n"
                    return
                left.discard(i)
                usage.append(ev["usage"])
                yield _sse(shape.chunk(i, {} if shape.kind == "chat" else "", ev["finish_reason"], ev["timings"]))
                if not left:
                    done = True
                    if shape.include_usage:
                        yield _sse(shape.usage_chunk(_sum_usage(usage)))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client went away (the body task was cancelled) or the write failed
                _cancel(jobs)

    async def _collect(request: Request, jobs: list[Job], events: asyncio.Queue, shape: "_Shape") -> Response:
        choices = {j.req.index: _Choice() for j in jobs}
        try:
            while not all(c.final for c in choices.values()):
                try:
                    ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        _cancel(jobs)
                        return Response(status_code=499)
                    continue
                if ev["type"] == "error":
                    _cancel(jobs)
                    status = 503 if ev["code"] == "shutdown" else 500
                    return JSONResponse(error_event(ev), status_code=status)
                choices[ev["index"]].add(ev)
            return JSONResponse(shape.final(choices))
        except asyncio.CancelledError:
            _cancel(jobs)
            raise

    app = Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ])
    app.state.close = lambda: shared["tok"].close() if "tok" in shared else None
    return app


def _sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """The engine thread's way into this request's event queue (events tagged with the choice index)."""
    def put(ev: dict) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, {**ev, "index": index})
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
    return put


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sum_usage(usages: list[dict]) -> dict:
    return {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


class _Choice:
    """One choice of a non-streamed response, gathered from its events."""

    def __init__(self):
        self.text, self.reasoning, self.logprobs, self.final = [], [], [], None

    def add(self, ev: dict) -> None:
        if ev["type"] == "done":
            self.final = ev
            return
        self.text.append(ev["text"])
        self.reasoning.append(ev.get("reasoning") or "")
        self.logprobs.extend(ev["logprobs"] or ())


class _Shape:
    """OpenAI's response shapes for one request (chat.completion / text_completion)."""

    def __init__(self, kind: str, model: str, jobs: list[Job], reasoning: bool = False):
        req = jobs[0].req
        self.kind, self.model, self.include_usage = kind, model, req.include_usage
        self.logprobs, self.reasoning = req.logprobs is not None, reasoning
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + jobs[0].id
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _lp(self, entries) -> dict | None:
        if not self.logprobs or entries is None:
            return None
        return chat_logprobs(entries) if self.kind == "chat" else completion_logprobs(entries)

    def chunk(self, index: int, delta, finish_reason=None, timings=None, logprobs=None) -> dict:
        if self.kind == "chat":
            out = self._head("chat.completion.chunk")
            out["choices"] = [{"index": index, "delta": delta, "logprobs": self._lp(logprobs),
                               "finish_reason": finish_reason}]
        else:
            out = self._head("text_completion")
            out["choices"] = [{"index": index, "text": delta, "logprobs": self._lp(logprobs),
                               "finish_reason": finish_reason}]
        if self.include_usage:
            out["usage"] = None
        if timings is not None:
            out["timings"] = timings
        return out

    def deltas(self, index: int, ev: dict) -> list[dict]:
        """The chunks of one "prompt" / "text" event (chat: reasoning and content apart)."""
        if self.kind != "chat":
            return [self.chunk(index, ev["text"], logprobs=ev["logprobs"])]
        out, lps = [], ev["logprobs"]
        if ev.get("reasoning"):
            out.append(self.chunk(index, {"reasoning_content": ev["reasoning"]}, logprobs=lps))
            lps = None
        if ev["text"] or lps:
            out.append(self.chunk(index, {"content": ev["text"]}, logprobs=lps))
        return out

    def usage_chunk(self, usage: dict) -> dict:
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage)
        return out

    def final(self, choices: dict[int, _Choice]) -> dict:
        out = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        items = []
        for i in sorted(choices):
            c = choices[i]
            if self.kind == "chat":
                message = {"role": "assistant", "content": "".join(c.text)}
                if self.reasoning:
                    message["reasoning_content"] = "".join(c.reasoning) or None
                choice = {"index": i, "message": message}
            else:
                choice = {"index": i, "text": "".join(c.text)}
            choice.update(logprobs=self._lp(c.logprobs), finish_reason=c.final["finish_reason"])
            items.append(choice)
        finals = [choices[i].final for i in sorted(choices)]
        timings = finals[0]["timings"] if len(finals) == 1 else [f["timings"] for f in finals]
        out.update(choices=items, usage=_sum_usage([f["usage"] for f in finals]), timings=timings)
        return out

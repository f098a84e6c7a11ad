"""The HTTP routes (Starlette), kept small: parse, hand the request to the engine thread, relay
its events as an OpenAI response or SSE stream. No handler runs a kernel.

    GET  /health                 503 {"status": "loading" | "draining" | ...} until ready, then 200
    GET  /metrics                Prometheus text (serve/metrics.py)
    GET  /v1/models              the one model this server runs
    POST /v1/chat/completions    chat (the target's chat template), streamed or not
    POST /v1/completions         text completions, streamed or not

Streams: `data: {chunk}` events; chat starts with a role chunk; the last choice chunk carries
finish_reason (and llama.cpp-style `timings`); with stream_options.include_usage a usage-only
chunk (choices: []) follows; then `data: [DONE]`. An error after the stream started is sent as
`data: {"error": {...}}` before [DONE]. A client that disconnects cancels its request (the
engine frees the slot at its next step).
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import READY, Engine, Job
from .protocol import RequestError, Unavailable, parse_request

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def error_response(e: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if hasattr(e, "retry_after_s") else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(engine: Engine, model_id: str) -> Starlette:
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

    async def _complete(request: Request, kind: str) -> Response:
        try:
            if engine.state != READY:
                engine.record_rejected("not_ready" if engine.state == "loading" else "draining")
                raise Unavailable(f"the server is {engine.state}; try again later", code=engine.state)
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                engine.record_rejected("invalid")
                raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
            try:
                req = engine.check(parse_request(body, kind, {model_id}, engine.target.tokenizer,
                                                 engine.target.valid_vocab))
            except RequestError:
                engine.record_rejected("invalid")
                raise
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            job = Job(req, sink=_sink(loop, events))
            engine.submit(job)
        except RequestError as e:
            return error_response(e)
        shape = _Shape(kind, model_id, job)
        if req.stream:
            return StreamingResponse(_stream(job, events, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, job, events, shape)

    async def _stream(job: Job, events: asyncio.Queue, shape: "_Shape"):
        done = False
        try:
            if shape.kind == "chat":
                yield _sse(shape.chunk({"role": "assistant", "content": ""}))
            while True:
                ev = await events.get()
                if ev["type"] == "text":
                    yield _sse(shape.chunk({"content": ev["text"]} if shape.kind == "chat" else ev["text"]))
                    continue
                done = True
                if ev["type"] == "error":
                    yield _sse({"error": {"message": ev["message"], "type": "server_error", "param": None,
                                          "code": ev["code"]}})
                else:
                    yield _sse(shape.chunk({} if shape.kind == "chat" else "", ev["finish_reason"], ev["timings"]))
                    if job.req.include_usage:
                        yield _sse(shape.usage_chunk(ev["usage"]))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not done:  # the client went away (the body task was cancelled) or the write failed
                engine.cancel(job)

    async def _collect(request: Request, job: Job, events: asyncio.Queue, shape: "_Shape") -> Response:
        parts = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(job)
                        return Response(status_code=499)
                    continue
                if ev["type"] == "text":
                    parts.append(ev["text"])
                elif ev["type"] == "error":
                    status = 503 if ev["code"] == "shutdown" else 500
                    return JSONResponse({"error": {"message": ev["message"], "type": "server_error", "param": None,
                                                   "code": ev["code"]}}, status_code=status)
                else:
                    return JSONResponse(shape.final("".join(parts), ev))
        except asyncio.CancelledError:
            engine.cancel(job)
            raise

    return Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ])


def _sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
    """The engine thread's way into this request's event queue."""
    def put(ev: dict) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
    return put


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    """OpenAI's response shapes for one request (chat.completion / text_completion)."""

    def __init__(self, kind: str, model: str, job: Job):
        self.kind, self.model, self.include_usage = kind, model, job.req.include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + job.id
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta, finish_reason=None, timings=None) -> dict:
        if self.kind == "chat":
            out = self._head("chat.completion.chunk")
            out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            out = self._head("text_completion")
            out["choices"] = [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}]
        if self.include_usage:
            out["usage"] = None
        if timings is not None:
            out["timings"] = timings
        return out

    def usage_chunk(self, usage: dict) -> dict:
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage)
        return out

    def final(self, text: str, ev: dict) -> dict:
        if self.kind == "chat":
            out = self._head("chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            out = self._head("text_completion")
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=ev["finish_reason"])
        out.update(choices=[choice], usage=ev["usage"], timings=ev["timings"])
        return out

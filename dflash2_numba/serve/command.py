"""The `serve` click command. cli.py registers it with its own model options and loader:

    main.add_command(make_serve_command(_model_options, _load, _quantize_option))

(passed in, not imported, so the options stay defined once and cli.py imports nothing of the
server until `serve` runs: Starlette and uvicorn are an optional extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import DFlashError


class ServeExtraMissingError(DFlashError):
    """`serve` without the optional extra (starlette, uvicorn)."""


DEFAULT_MODEL_ID = "dflash2-default"  # /v1/models id of the embedded default pair


def make_serve_command(model_options, load, quantize_option=lambda f: f):
    @click.command()
    @model_options
    @quantize_option
    @click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
    @click.option("--port", type=int, default=8000, show_default=True, help="Port (0: a free one).")
    @click.option("--block-size", default="auto", show_default=True, metavar="auto|Q",
                  help="Default verify width per request: auto (greedy requests share one budget of verify "
                       "rows, chosen from measured costs) or a fixed Q in 2..B; a request's block_size overrides it.")
    @click.option("--draft-window", type=int, default=0, show_default=True, metavar="N",
                  help="Default draft window: the draft attends to the last N context positions (0 = all; "
                       "a request's draft_window overrides it).")
    @click.option("--max-running", type=int, default=4, show_default=True,
                  help="Requests decoded together (batched) at most.")
    @click.option("--max-waiting", type=int, default=16, show_default=True,
                  help="Requests queued beyond those; more get 429.")
    @click.option("--shutdown-grace", type=float, default=30.0, show_default=True,
                  help="Seconds SIGTERM lets running requests finish before ending them.")
    @click.option("--max-body-mb", type=float, default=16.0, show_default=True,
                  help="Largest request body (MiB); a larger one gets 413 before it is read.")
    @click.option("--max-json-depth", type=int, default=32, show_default=True,
                  help="Deepest JSON nesting a request body may have (400 past it).")
    def serve(target_dir, draft_dir, device, threads, dtype, host, port, block_size, draft_window, max_running,
              max_waiting, shutdown_grace, max_body_mb, max_json_depth, quantize=None, kv_dtype="f32",
              draft_quantize="auto"):
        """OpenAI-compatible HTTP server (chat / completions, streamed or not) that batches requests."""
        try:
            from .engine import Engine
            from .app import Limits
            from .server import Server
        except ImportError as e:
            raise ServeExtraMissingError(f"serve needs the optional extra: pip install 'dflash2-numba[serve]' "
                                         f"({e})") from None
        from ..decode.width import parse_block_size

        block_size = parse_block_size(block_size)  # "auto" | int >= 2 (BlockSizeError otherwise)
        model_id = DEFAULT_MODEL_ID if target_dir is None else Path(target_dir).resolve().name
        engine = Engine(lambda: load(target_dir, draft_dir, device, dtype, threads, quantize=quantize,
                                     kv_dtype=kv_dtype, draft_quantize=draft_quantize)[2:],
                        max_running=max_running, max_waiting=max_waiting, block_size=block_size,
                        draft_window=draft_window)
        if max_body_mb <= 0 or max_json_depth < 2:
            raise click.BadParameter("--max-body-mb must be > 0 and --max-json-depth >= 2")
        limits = Limits(int(max_body_mb * 1024 * 1024), max_json_depth)
        server = Server(engine, model_id, host=host, port=port, grace_s=shutdown_grace, limits=limits)
        click.echo(f"dflash2-decode serve: {model_id} on {server.url} (loading; GET /health turns 200 when ready)",
                   err=True)
        server.run()
        if engine.load_error is not None:
            if isinstance(engine.load_error, DFlashError):
                raise engine.load_error
            sys.exit(1)

    return serve

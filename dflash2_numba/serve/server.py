"""The HTTP server around an Engine: uvicorn on one bound socket, with SIGTERM draining.

    server = Server(engine, model_id, host="127.0.0.1", port=8000, grace_s=30)
    server.run()                      # blocks (the CLI); SIGTERM / Ctrl-C drain, then return
    server.start_in_thread()          # tests: port 0 = a free port, server.port says which

SIGTERM (or the first Ctrl-C): the engine stops admitting (503) and lets accepted requests run
until `grace_s`, then ends them with an error event; uvicorn stops accepting connections and
waits for the open ones; `run` returns and the process exits 0.
"""

from __future__ import annotations

import socket
import threading

import uvicorn

from .app import Limits, build_app
from ..errors import DFlashError
from .engine import Engine


class ListenError(DFlashError):
    """The address / port cannot be bound (in use, not an address of this machine)."""


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, engine: Engine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain(self.grace_s)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the captured signal once it has shut down (the default action kills
        # the process: exit -15); the drain IS this server's handling of it, so it exits 0
        self._captured_signals.clear()


class Server:
    def __init__(self, engine: Engine, model_id: str, host: str = "127.0.0.1", port: int = 8000,
                 grace_s: float = 30.0, limits: Limits | None = None):
        self.engine, self.model_id, self.grace_s = engine, model_id, float(grace_s)
        try:
            self.sock = socket.create_server((host, int(port)))
        except OSError as e:
            raise ListenError(f"--host {host} --port {port}: cannot listen there ({e})") from None
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = build_app(engine, model_id, limits)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=self.grace_s + 5.0)
        self.uvicorn = _Uvicorn(config, engine, self.grace_s)
        engine.on_fatal = self.shutdown
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        """Serve until SIGTERM / Ctrl-C (or a failed model load); then stop the engine."""
        if self.engine.state == "loading" and not self.engine.thread.is_alive():
            self.engine.start()
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.engine.stop()
            self.app.state.close()

    def start_in_thread(self) -> "Server":
        self.thread = threading.Thread(target=self.run, name="dflash2-http", daemon=True)
        self.thread.start()
        return self

    def shutdown(self) -> None:
        """What SIGTERM does, from any thread."""
        self.uvicorn.handle_exit(15, None)

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

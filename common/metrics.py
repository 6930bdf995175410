"""Prometheus /metrics plus /healthz (liveness) and /readyz (readiness) on one small HTTP server.

Liveness is a watchdog: the role's main loop calls ``Health.beat()``; if it has not for
``stall_s`` seconds, /healthz answers 503 and names what the loop last said it was waiting for.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest

BUILD_INFO = Gauge("asyncppo_build_info", "Build information (always 1).", ["role", "version"])


class Health:
    def __init__(self, stall_s: float = 120.0):
        self.stall_s = stall_s
        self.ready = False
        self.waiting_for = "starting"
        self._last = time.monotonic()

    def beat(self, waiting_for: str | None = None) -> None:
        self._last = time.monotonic()
        if waiting_for is not None:
            self.waiting_for = waiting_for

    def stalled(self) -> bool:
        """No beat for ``stall_s``: the loop is stuck (or too slow to count as working)."""
        return time.monotonic() - self._last >= self.stall_s

    def status(self) -> tuple[bool, dict]:
        idle = time.monotonic() - self._last
        alive = idle < self.stall_s
        return alive, {
            "alive": alive,
            "ready": self.ready,
            "seconds_since_progress": round(idle, 3),
            "waiting_for": self.waiting_for,
        }


def serve_metrics(host: str, port: int, health: Health, role: str) -> ThreadingHTTPServer:
    """Start the metrics/health server on a daemon thread (port 0 picks a free port)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        BUILD_INFO.labels(role=role, version=version("asyncppo")).set(1)
    except PackageNotFoundError:
        BUILD_INFO.labels(role=role, version="dev").set(1)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?")[0]
            if path == "/metrics":
                body, ctype, code = generate_latest(REGISTRY), CONTENT_TYPE_LATEST, 200
            elif path in ("/healthz", "/readyz"):
                alive, info = health.status()
                ok = alive if path == "/healthz" else alive and health.ready
                body, ctype, code = (
                    json.dumps(info).encode(),
                    "application/json",
                    200 if ok else 503,
                )
            else:
                body, ctype, code = b"not found\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None  # scrapes every few seconds would flood the role's log

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server

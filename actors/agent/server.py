"""The agent API's HTTP side: routes, JSON bodies, and the one table from errors to statuses.

Handler threads parse a request into a ``Call``, put it on the queue the actor's loop serves, and
wait for its answer; every answer, malformed requests included, is counted by route and status.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from prometheus_client import Counter

from actors.agent.calls import AgentError, Call
from actors.agent.openai import error_body, model_list

log = structlog.get_logger()

M_REQUESTS = Counter(
    "asyncppo_actor_agent_requests_total",
    "Agent API requests by route and status.",
    ["route", "status"],
)
MAX_BODY_BYTES = 16 << 20
STATUS = {  # AgentError.code -> HTTP status
    "invalid_request": 400,
    "bad_body": 400,
    "context_length_exceeded": 400,
    "model_not_found": 404,
    "unknown_session": 404,
    "no_route": 404,
    "session_timeout": 408,
    "busy_session": 409,
    "session_dropped": 410,
    "too_large": 413,
    "internal": 500,
    "no_capacity": 503,
    "timeout": 504,
}


def route(method: str, path: str) -> tuple[str, str | None]:
    """(route, session id) of a request path; AgentError ``no_route`` for any other."""
    parts = path.strip("/").split("/")
    if method == "GET" and parts[-2:] == ["v1", "models"]:
        return "models", None
    if method == "POST":
        if parts == ["v1", "sessions"]:
            return "start", None
        if len(parts) == 4 and parts[:2] == ["v1", "sessions"] and parts[3] == "end":
            return "end", parts[2]
        if (
            len(parts) == 5
            and parts[0] == "sessions"
            and parts[2:] == ["v1", "chat", "completions"]
        ):
            return "chat", parts[1]
        if parts == ["v1", "chat", "completions"]:
            return "complete", None
    raise AgentError("no_route", f"no route {method} {path}")


class Handler(BaseHTTPRequestHandler):
    """One request: its route, its body, a ``Call`` for the loop, the answer as JSON."""

    server: _HTTPServer

    def log_message(self, *args: object) -> None:  # structlog, not stderr lines
        return

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def _serve(self, method: str) -> None:
        api = self.server.api
        name = "none"
        try:
            name, session = route(method, self.path)
            if name == "models":
                self._json(name, 200, model_list(api.model))
                return
            call = Call(name, session, self._body())
            api.calls.put(call)
            if not call.done.wait(api.request_timeout_s + 5):
                raise AgentError("timeout", "the actor did not answer in time")
        except AgentError as exc:
            self._error(name, exc)
            return
        if call.error is not None:
            self._error(name, call.error)
        else:
            self._json(name, 200, call.reply or {})

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise AgentError("bad_body", "bad JSON body: Content-Length") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise AgentError("too_large", f"body over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise AgentError("bad_body", f"bad JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise AgentError("bad_body", "bad JSON body: the body must be a JSON object")
        return body

    def _error(self, name: str, error: AgentError) -> None:
        status = STATUS[error.code]
        self._json(name, status, error_body(error, status))

    def _json(self, name: str, status: int, body: dict) -> None:
        """Every answer, counted by route and status (malformed requests too)."""
        M_REQUESTS.labels(route=name, status=str(status)).inc()
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
            log.info("agent API client went away before its reply", path=self.path)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    api: AgentServer


class AgentServer:
    """The HTTP server of an agent-mode actor; ``calls`` is what the actor's loop answers."""

    def __init__(self, host: str, port: int, *, model: str, request_timeout_s: float) -> None:
        self.model, self.request_timeout_s = model, request_timeout_s
        self.calls: queue.Queue[Call] = queue.Queue()
        self.httpd = _HTTPServer((host, port), Handler)
        self.httpd.api = self
        self.address = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="agent-api", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

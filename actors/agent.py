"""Agent sessions over an OpenAI-compatible API: your agent code, trained on its exact tokens.

An agent starts a session (``POST /v1/sessions``: the actor takes a broker permit for it, so
admission and the staleness bound apply as to any episode), talks to the session's ``base_url``
(``http://host:port/sessions/<id>/v1``) with the official ``openai`` client, unchanged except for
``base_url``, and ends it with a reward (``POST /v1/sessions/<id>/end``).

Token in, token out: a completion's tokens, log-probs and versions are the engine's own and are
never re-tokenized. When a call's messages extend the previous call's conversation (the same
messages, then the reply this session returned, then new ones), only the new messages are
rendered and appended, as observation tokens (mask 0), to the episode's current segment. When
they do not (the agent compacted or rewrote its history), the current segment ends ``truncated``
(the learner bootstraps there, as for built-in compaction) and a new segment starts from the
rendered conversation.

Threads: HTTP handlers only parse and wait; every session and the engine belong to the actor's
loop, which takes each ``Call`` from a queue (``AgentSessions.handle``) and answers it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import Counter

from actors.engines import Engine, Generation, SamplingParams
from actors.episode import ChatFormat, SegmentBuilder, finite_number
from common.trajectory import Segment

log = structlog.get_logger()

M_REQUESTS = Counter(
    "asyncppo_actor_agent_requests_total",
    "Agent API requests by route and status.",
    ["route", "status"],
)
ROLES = ("system", "user", "assistant", "tool")
MAX_BODY_BYTES = 16 << 20


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the parameter at fault, a code."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class Call:
    """One HTTP request handed to the actor's loop; the handler waits for `done`."""

    route: str  # "start" | "chat" | "end"
    session: str | None
    body: dict
    received: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 200
    reply: dict = field(default_factory=dict)

    def answer(self, reply: dict, status: int = 200) -> None:
        self.reply, self.status = reply, status
        self.done.set()

    def fail(self, error: ApiError) -> None:
        self.answer(error.body(), error.status)


@dataclass
class Session:
    id: str
    permit: str
    started: float
    segment: SegmentBuilder = field(default_factory=SegmentBuilder)
    history: list[tuple[str, str]] = field(default_factory=list)  # what `segment` renders
    last_action: list[int] = field(default_factory=list)
    sent: int = 0  # segments sent so far
    turns: int = 0
    cuts: int = 0
    waiting: Call | None = None  # the chat call whose completion is being generated
    asked: list[tuple[str, str]] = field(default_factory=list)  # its messages


def normalised(messages: Any) -> list[tuple[str, str]]:
    """(role, content) pairs of chat messages, or ApiError naming the first bad one."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    pairs = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {', '.join(ROLES)}",
                param=f"messages[{i}].role",
            )
        if not isinstance(content, str):
            raise ApiError(
                400, f"messages[{i}].content must be a string", param=f"messages[{i}].content"
            )
        pairs.append((role, content))
    return pairs


def as_messages(pairs: list[tuple[str, str]]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


class AgentSessions:
    """The sessions an actor serves, all driven from the actor's loop.

    `take_permit()` asks the broker for one permit (None while there is none), `send(segment)`
    streams a segment (False when the broker will never take its episode), `release()` tells
    the broker which permits are still held (a HELLO), and `base_url(id)` is where a session's
    client points.
    """

    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        *,
        model: str,
        actor_id: str,
        temperature: float,
        max_tokens: int,
        session_timeout_s: float,
        request_timeout_s: float,
        take_permit: Callable[[], dict | None],
        send: Callable[[Segment], bool],
        release: Callable[[], None],
        base_url: Callable[[str], str],
    ) -> None:
        self.engine, self.fmt, self.model, self.actor_id = engine, fmt, model, actor_id
        self.temperature, self.max_tokens = temperature, max_tokens
        self.session_timeout_s, self.request_timeout_s = session_timeout_s, request_timeout_s
        self.take_permit, self.send, self.release, self.base_url = (
            take_permit,
            send,
            release,
            base_url,
        )
        self.calls: queue.Queue[Call] = queue.Queue()
        self.sessions: dict[str, Session] = {}
        self.starting: list[Call] = []  # session starts waiting for a permit
        self.plain: dict[str, Call] = {}  # plain completions being generated

    @property
    def permits(self) -> list[str]:
        return [s.permit for s in self.sessions.values()]

    def busy(self) -> bool:
        return bool(self.plain) or any(s.waiting is not None for s in self.sessions.values())

    # ------------------------------------------------------------ the loop's side
    def handle(self, wait_s: float) -> None:
        """Answer the calls that arrived (waiting up to `wait_s` for the first), then retry
        session starts that wait for a permit and abandon sessions past their time."""
        try:
            call = self.calls.get(timeout=wait_s) if wait_s > 0 else self.calls.get_nowait()
        except queue.Empty:
            call = None
        while call is not None:
            try:
                getattr(self, f"_{call.route}")(call)
            except ApiError as exc:
                call.fail(exc)
            except Exception as exc:  # a request the checks above missed must not end the actor
                log.exception("agent request failed", route=call.route, session=call.session)
                call.fail(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                call = None
        self._serve_starts()
        self._expire()

    def finished(self, key: str, gen: Generation) -> None:
        """A completion the engine finished: record it (sessions), answer its call."""
        if key in self.plain:
            self.engine.release(key)
            text = self.fmt.tok.decode(gen.token_ids, skip_special_tokens=True)
            self.plain.pop(key).answer(self._completion(text, gen, prompt=-1))
            return
        session = self.sessions.get(key)
        if session is None or session.waiting is None:
            return
        call, session.waiting = session.waiting, None
        session.segment.act(gen, 0.0)
        session.last_action = gen.token_ids
        session.turns += 1
        text = self.fmt.tok.decode(gen.token_ids, skip_special_tokens=True)
        session.history = [*session.asked, ("assistant", text)]
        prompt = len(session.segment.tokens) - len(gen.token_ids)
        call.answer(self._completion(text, gen, prompt))

    def _completion(self, text: str, gen: Generation, prompt: int) -> dict:
        """An OpenAI chat.completion object (`prompt` tokens: -1 when not counted)."""
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": gen.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": max(prompt, 0),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": max(prompt, 0) + len(gen.token_ids),
            },
        }

    def _start(self, call: Call) -> None:
        self.starting.append(call)

    def _serve_starts(self) -> None:
        now = time.monotonic()
        while self.starting:
            call = self.starting[0]
            if now - call.received > self.request_timeout_s:
                self.starting.pop(0).fail(
                    ApiError(503, "no permit: the broker has no capacity now", code="no_capacity")
                )
                continue
            permit = self.take_permit()
            if permit is None:
                return
            self.starting.pop(0)
            session = Session(uuid.uuid4().hex, permit["id"], now)
            self.sessions[session.id] = session
            call.answer(
                {"id": session.id, "base_url": self.base_url(session.id), "model": self.model}
            )

    def _session(self, call: Call) -> Session:
        session = self.sessions.get(call.session or "")
        if session is None:
            raise ApiError(
                404,
                f"session {call.session!r} is unknown or has ended",
                param="session",
                code="unknown_session",
            )
        if session.waiting is not None:
            raise ApiError(
                409, "a completion of this session is still being generated", code="busy_session"
            )
        return session

    def _request(
        self, body: dict, *, trained: bool
    ) -> tuple[list[tuple[str, str]], SamplingParams]:
        """The messages and sampling of a chat request, or ApiError naming what is wrong. A
        trained completion samples at actor.temperature (the learner scores with it); a plain
        one at the temperature asked for."""
        if body.get("model") != self.model:
            raise ApiError(
                404,
                f"model {body.get('model')!r} is not served here; this actor serves {self.model!r}",
                param="model",
                code="model_not_found",
            )
        for key, allowed in (("n", (None, 1)), ("stream", (None, False))):
            if body.get(key) not in allowed:
                raise ApiError(400, f"{key}={body.get(key)!r} is not supported", param=key)
        temperature = body.get("temperature")
        if trained and temperature is not None and temperature != self.temperature:
            raise ApiError(
                400,
                f"temperature must be {self.temperature} (actor.temperature): the learner scores with it",
                param="temperature",
            )
        if temperature is None:
            temperature = self.temperature
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not 0 < temperature <= 100
        ):
            raise ApiError(
                400,
                "temperature must be a number > 0 (sampling reports log-probs)",
                param="temperature",
            )
        limit = body.get("max_completion_tokens", body.get("max_tokens")) or self.max_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ApiError(400, "max_tokens must be an integer >= 1", param="max_tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "stop must be a string or an array of strings", param="stop")
        params = SamplingParams(
            max_new_tokens=min(limit, self.max_tokens),
            temperature=float(temperature),
            stop=stop,
            stop_token_ids=self.fmt.stop_token_ids,
        )
        return normalised(body.get("messages")), params

    def _complete(self, call: Call) -> None:
        """A plain completion (no session): no permit, nothing recorded or trained. What a
        judge model or an evaluation calls."""
        messages, params = self._request(call.body, trained=False)
        key = f"plain-{uuid.uuid4().hex}"
        try:
            self.engine.submit(key, self.fmt.conversation(as_messages(messages)), params)
        except ValueError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded") from None
        self.plain[key] = call

    def _chat(self, call: Call) -> None:
        session = self._session(call)
        messages, params = self._request(call.body, trained=True)
        history = session.history
        if history and len(messages) > len(history) and messages[: len(history)] == history:
            new = self.fmt.continuation(as_messages(messages[len(history) :]), session.last_action)
        else:  # first call, or the agent rewrote its history: the segment is cut here
            self._cut(session)
            new = self.fmt.conversation(as_messages(messages))
        session.segment.observe(new)
        try:
            self.engine.submit(session.id, session.segment.tokens, params)
        except ValueError as exc:  # the context no longer fits the model
            self._abandon(session)
            raise ApiError(
                400, f"{exc}; the session is ended", code="context_length_exceeded"
            ) from None
        session.waiting, session.asked = call, messages

    def _cut(self, session: Session) -> None:
        """End the current segment `truncated` (sent now), start an empty one."""
        if session.segment.turns:
            self._send(session, last=False, terminated=False, truncated=True)
            session.cuts += 1
        session.segment, session.history, session.last_action = SegmentBuilder(), [], []

    def _end(self, call: Call) -> None:
        session, body = self._session(call), call.body
        reward = body.get("reward")
        if not finite_number(reward):
            raise ApiError(400, "reward must be a finite number", param="reward")
        terminated, truncated = body.get("terminated", True), body.get("truncated", False)
        if (
            not isinstance(terminated, bool)
            or not isinstance(truncated, bool)
            or terminated == truncated
        ):
            raise ApiError(
                400, "exactly one of terminated and truncated must be true", param="terminated"
            )
        if not session.segment.turns:  # nothing generated: nothing to train on, free the permit
            self._abandon(session)
        else:
            del self.sessions[session.id]
            self.engine.release(session.id)
            session.segment.rewards[-1] += float(reward)  # the last token is the last action's
            self._send(session, last=True, terminated=terminated, truncated=truncated)
        call.answer({"id": session.id, "segments": session.sent})

    def _send(self, session: Session, *, last: bool, terminated: bool, truncated: bool) -> None:
        """Stream the current segment; a broker that will never take the episode (too stale)
        ends the session: ApiError 410."""
        seg = session.segment.segment(
            episode_id=session.id,
            index=session.sent,
            actor_id=self.actor_id,
            task="agent",
            group_id=None,
            permit=session.permit,
            last=last,
            terminated=terminated,
            truncated=truncated,
            metrics={"turns": session.turns, "compactions": session.cuts},
        )
        session.sent += 1
        if not self.send(seg):
            self._abandon(session)
            raise ApiError(
                410, "the broker dropped this session's episode (too stale)", code="session_dropped"
            )

    def _abandon(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        self.engine.release(session.id)
        self.release()

    def _expire(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if now - session.started > self.session_timeout_s:
                log.warning("agent session timed out; abandoned", session=session.id)
                if session.waiting is not None:
                    session.waiting.fail(
                        ApiError(
                            408,
                            "the session ran past actor.agent_session_timeout_s",
                            code="session_timeout",
                        )
                    )
                self._abandon(session)


class AgentServer:
    """The HTTP side: routes, JSON in and out, a `Call` per request waited on until answered."""

    def __init__(self, sessions: AgentSessions, host: str, port: int) -> None:
        self.sessions = sessions

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # structlog, not stderr lines
                return

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts[-2:] == ["v1", "models"]:
                    model = sessions.model
                    self._json(
                        "models",
                        200,
                        {
                            "object": "list",
                            "data": [{"id": model, "object": "model", "owned_by": "asyncppo"}],
                        },
                    )
                else:
                    self._json("none", 404, ApiError(404, f"no route GET {self.path}").body())

            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts == ["v1", "sessions"]:
                    route, session = "start", None
                elif len(parts) == 4 and parts[:2] == ["v1", "sessions"] and parts[3] == "end":
                    route, session = "end", parts[2]
                elif (
                    len(parts) == 5
                    and parts[0] == "sessions"
                    and parts[2:] == ["v1", "chat", "completions"]
                ):
                    route, session = "chat", parts[1]
                elif parts == ["v1", "chat", "completions"]:
                    route, session = "complete", None
                else:
                    self._json("none", 404, ApiError(404, f"no route POST {self.path}").body())
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if not 0 <= length <= MAX_BODY_BYTES:
                        error = ApiError(413, f"body over {MAX_BODY_BYTES} bytes")
                        self._json(route, 413, error.body())
                        return
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                except (ValueError, UnicodeDecodeError) as exc:
                    self._json(route, 400, ApiError(400, f"bad JSON body: {exc}").body())
                    return
                call = Call(route, session, body)
                sessions.calls.put(call)
                if not call.done.wait(sessions.request_timeout_s + 5):
                    self._json(route, 504, ApiError(504, "the actor did not answer in time").body())
                    return
                self._json(route, call.status, call.reply)

            def _json(self, route: str, status: int, body: dict) -> None:
                """Every answer, counted by route and status (malformed requests too)."""
                M_REQUESTS.labels(route=route, status=str(status)).inc()
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                    log.info("agent API client went away before its reply", path=self.path)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.address = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="agent-api", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

"""Agent sessions as episodes: the actor's driver in agent mode (``actors.driver``).

An agent starts a session (the driver takes a broker permit for it, so admission and the
staleness bound apply as to any episode), talks to the session's ``base_url`` with the official
``openai`` client, and ends it with a reward. Token in, token out: a completion's tokens, log-probs
and versions are the engine's own and never re-tokenized. When a call's messages extend the
previous call's conversation (the same messages, then the reply this session returned, then new
ones), only the new messages are rendered and recorded, as observation tokens. When they do not
(the agent compacted or rewrote its history), the recorder cuts the segment there
(``actors.recorder``) and a new one starts from the rendered conversation.

Everything here runs on the actor's loop: HTTP handler threads only put ``Call``s on ``calls``
and wait. Errors are ``AgentError``s; the server decides their HTTP status.
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import dataclass, field

import structlog

from actors.agent.calls import AgentError, Call
from actors.agent.openai import Messages, as_messages, chat_request, completion
from actors.chat import ChatFormat
from actors.driver import Ended, Outcome, Wants
from actors.engines import Engine, Generation
from actors.recorder import Recorder, finite_number
from common.trajectory import Segment

log = structlog.get_logger()


@dataclass
class Session:
    id: str
    permit: str
    started: float
    recorder: Recorder
    history: Messages = field(default_factory=list)  # what the current segment renders
    last_action: list[int] = field(default_factory=list)
    waiting: Call | None = None  # the chat call whose completion is being generated
    asked: Messages = field(default_factory=list)  # its messages


class AgentDriver:
    """The sessions an actor serves, driven from the actor's loop (``actors.driver.Driver``).

    ``address`` is the API's base address (a session's client points at
    ``<address>/sessions/<id>/v1``); ``calls`` the queue the server puts requests on.
    """

    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        calls: queue.Queue[Call],
        *,
        address: str,
        model: str,
        actor_id: str,
        temperature: float,
        max_tokens: int,
        session_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self.engine, self.fmt, self.calls, self.address = engine, fmt, calls, address
        self.model, self.actor_id = model, actor_id
        self.temperature, self.max_tokens = temperature, max_tokens
        self.session_timeout_s, self.request_timeout_s = session_timeout_s, request_timeout_s
        self.sessions: dict[str, Session] = {}
        self.starting: list[Call] = []  # session starts waiting for a permit
        self.plain: dict[str, Call] = {}  # plain completions being generated
        self.ending: dict[str, tuple[Call, dict]] = {}  # last segment's traj_id -> its end call
        self.outcome = Outcome()  # what the calls being answered produced

    # ------------------------------------------------------------ the driver
    def __len__(self) -> int:
        return len(self.sessions)

    def held_permits(self) -> list[str]:
        return [s.permit for s in self.sessions.values()]

    def wants(self) -> Wants:
        """One permit per session start waiting; never parked (calls wait meanwhile)."""
        return Wants(len(self.starting))

    def busy(self) -> bool:
        return bool(self.plain) or any(s.waiting is not None for s in self.sessions.values())

    def start(self, permits: list[dict]) -> Outcome:
        now = time.monotonic()
        for permit in permits:
            call = self.starting.pop(0)
            session_id = uuid.uuid4().hex
            recorder = Recorder(
                episode_id=session_id,
                permit=permit["id"],
                actor_id=self.actor_id,
                task="agent",
                group_id=None,
            )
            self.sessions[session_id] = Session(session_id, permit["id"], now, recorder)
            base_url = f"{self.address}/sessions/{session_id}/v1"
            call.answer({"id": session_id, "base_url": base_url, "model": self.model})
        return Outcome()

    def step(self) -> Outcome:
        """Answer the calls that arrived (waiting briefly for one when nothing is generated),
        expire what waited too long, then one engine step if a completion is being generated."""
        self.outcome = outcome = Outcome()
        self._handle(wait_s=0.0 if self.busy() else 0.05)
        self._expire()
        if self.busy():
            for key, gen in self.engine.step():
                outcome.tokens += len(gen.token_ids)
                self._finished(key, gen)
        return outcome

    def delivered(self, segment: Segment, accepted: bool) -> None:
        """An end call is answered once its last segment is in; a session whose episode the
        broker will never take ends (410)."""
        ending = self.ending.pop(segment.traj_id, None)
        if accepted:
            if ending is not None:
                ending[0].answer(ending[1])
            return
        error = AgentError("session_dropped", "the broker dropped this session's episode")
        if ending is not None:
            ending[0].fail(error)
        session = self.sessions.pop(segment.episode_id, None)
        if session is not None:
            self.engine.release(session.id)
            if session.waiting is not None:
                session.waiting.fail(error)

    def close(self) -> None:
        return None

    # ------------------------------------------------------------- the calls
    def _handle(self, wait_s: float) -> None:
        try:
            call = self.calls.get(timeout=wait_s) if wait_s > 0 else self.calls.get_nowait()
        except queue.Empty:
            return
        while call is not None:
            try:
                getattr(self, f"_{call.route}")(call)
            except AgentError as exc:
                call.fail(exc)
            except Exception as exc:  # a request the checks above missed must not end the actor
                log.exception("agent request failed", route=call.route, session=call.session)
                call.fail(AgentError("internal", f"internal error: {type(exc).__name__}: {exc}"))
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                call = None

    def _start(self, call: Call) -> None:
        self.starting.append(call)

    def _session(self, call: Call) -> Session:
        session = self.sessions.get(call.session or "")
        if session is None:
            raise AgentError(
                "unknown_session", f"session {call.session!r} is unknown or has ended",
                param="session",
            )  # fmt: skip
        if session.waiting is not None:
            raise AgentError(
                "busy_session", "a completion of this session is still being generated"
            )
        return session

    def _request(self, call: Call, *, trained: bool) -> tuple[Messages, object]:
        return chat_request(
            call.body,
            model=self.model,
            temperature=self.temperature if trained else None,
            default_temperature=self.temperature,
            max_tokens=self.max_tokens,
            stop_token_ids=self.fmt.stop_token_ids,
        )

    def _complete(self, call: Call) -> None:
        """A plain completion (no session): no permit, nothing recorded or trained. What a
        judge model or an evaluation calls."""
        messages, params = self._request(call, trained=False)
        key = f"plain-{uuid.uuid4().hex}"
        try:
            self.engine.submit(key, self.fmt.conversation(as_messages(messages)), params)
        except ValueError as exc:
            raise AgentError("context_length_exceeded", str(exc)) from None
        self.plain[key] = call

    def _chat(self, call: Call) -> None:
        session = self._session(call)
        messages, params = self._request(call, trained=True)
        history, recorder = session.history, session.recorder
        if history and len(messages) > len(history) and messages[: len(history)] == history:
            new = self.fmt.continuation(as_messages(messages[len(history) :]), session.last_action)
        else:  # first call, or the agent rewrote its history: the segment is cut here
            cut = recorder.cut({})
            if cut is not None:
                self.outcome.segments.append(cut)
            session.history, session.last_action = [], []
            new = self.fmt.conversation(as_messages(messages))
        recorder.observe(new)
        try:
            self.engine.submit(session.id, recorder.context, params)
        except ValueError as exc:  # the context no longer fits the model: the session ends
            self._abandon(session)
            raise AgentError("context_length_exceeded", f"{exc}; the session is ended") from None
        session.waiting, session.asked = call, messages

    def _end(self, call: Call) -> None:
        session, body = self._session(call), call.body
        reward = body.get("reward")
        if not finite_number(reward):
            raise AgentError("invalid_request", "reward must be a finite number", param="reward")
        terminated, truncated = body.get("terminated", True), body.get("truncated", False)
        if (
            not isinstance(terminated, bool)
            or not isinstance(truncated, bool)
            or terminated == truncated
        ):
            raise AgentError(
                "invalid_request",
                "exactly one of terminated and truncated must be true",
                param="terminated",
            )
        recorder = session.recorder
        if not recorder.current.turns:  # nothing generated: nothing to train on, free the permit
            self._abandon(session)
            call.answer({"id": session.id, "segments": len(recorder.segments)})
            return
        del self.sessions[session.id]
        self.engine.release(session.id)
        last = recorder.finish({}, terminated=terminated, truncated=truncated, reward=float(reward))
        self.outcome.segments.append(last)
        self.outcome.ended.append(Ended(sum(s.reward for s in recorder.segments)))
        self.ending[last.traj_id] = (call, {"id": session.id, "segments": len(recorder.segments)})

    def _finished(self, key: str, gen: Generation) -> None:
        """A completion the engine finished: recorded (sessions), its call answered."""
        text = self.fmt.decode(gen.token_ids)
        if key in self.plain:
            self.engine.release(key)
            self.plain.pop(key).answer(completion(self.model, text, gen, None))
            return
        session = self.sessions.get(key)
        if session is None or session.waiting is None:
            return
        call, session.waiting = session.waiting, None
        session.recorder.act(gen)
        session.last_action = gen.token_ids
        session.history = [*session.asked, ("assistant", text)]
        prompt = len(session.recorder.context) - len(gen.token_ids)
        call.answer(completion(self.model, text, gen, prompt))

    # ------------------------------------------------------------- lifetimes
    def _abandon(self, session: Session) -> None:
        """The session ends without its last segment: the permit goes back (HELLO), and the
        broker drops what the session sent."""
        self.sessions.pop(session.id, None)
        self.engine.release(session.id)
        self.outcome.released = True

    def _expire(self) -> None:
        now = time.monotonic()
        while self.starting and now - self.starting[0].received > self.request_timeout_s:
            self.starting.pop(0).fail(
                AgentError("no_capacity", "no permit: the broker has no capacity now")
            )
        for session in list(self.sessions.values()):
            if now - session.started > self.session_timeout_s:
                log.warning("agent session timed out; abandoned", session=session.id)
                if session.waiting is not None:
                    session.waiting.fail(
                        AgentError(
                            "session_timeout", "the session ran past actor.agent_session_timeout_s"
                        )
                    )
                self._abandon(session)

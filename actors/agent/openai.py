"""The OpenAI chat-completions wire format, and nothing else: no state, no HTTP.

Requests become (messages, ``SamplingParams``) or an ``AgentError`` naming the parameter at fault;
completions and errors become the JSON objects the official ``openai`` client reads.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from actors.agent.calls import AgentError
from actors.engines import Generation, SamplingParams

ROLES = ("system", "user", "assistant", "tool")
Messages = list[tuple[str, str]]  # (role, content)


def normalised(messages: Any) -> Messages:
    """(role, content) pairs of chat messages, or AgentError naming the first bad one."""
    if not isinstance(messages, list) or not messages:
        raise AgentError("invalid_request", "messages must be a non-empty array", param="messages")
    pairs = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise AgentError(
                "invalid_request",
                f"messages[{i}].role must be one of {', '.join(ROLES)}",
                param=f"messages[{i}].role",
            )
        if not isinstance(content, str):
            raise AgentError(
                "invalid_request",
                f"messages[{i}].content must be a string",
                param=f"messages[{i}].content",
            )
        pairs.append((role, content))
    return pairs


def as_messages(pairs: Messages) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


def chat_request(
    body: dict,
    *,
    model: str,
    temperature: float | None,
    default_temperature: float,
    max_tokens: int,
    stop_token_ids: list[int],
) -> tuple[Messages, SamplingParams]:
    """The messages and sampling of a chat-completions body. ``temperature``, when given, is the
    only one allowed (a trained completion: the learner scores with it); else the body's own, by
    default ``default_temperature``."""
    if body.get("model") != model:
        raise AgentError(
            "model_not_found",
            f"model {body.get('model')!r} is not served here; this actor serves {model!r}",
            param="model",
        )
    for key, allowed in (("n", (None, 1)), ("stream", (None, False))):
        if body.get(key) not in allowed:
            raise AgentError(
                "invalid_request", f"{key}={body.get(key)!r} is not supported", param=key
            )
    asked = body.get("temperature")
    if temperature is not None and asked is not None and asked != temperature:
        raise AgentError(
            "invalid_request",
            f"temperature must be {temperature} (actor.temperature): the learner scores with it",
            param="temperature",
        )
    asked = default_temperature if asked is None else asked
    if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not 0 < asked <= 100:
        raise AgentError(
            "invalid_request",
            "temperature must be a number > 0 (sampling reports log-probs)",
            param="temperature",
        )
    limit = body.get("max_completion_tokens", body.get("max_tokens")) or max_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise AgentError(
            "invalid_request", "max_tokens must be an integer >= 1", param="max_tokens"
        )
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise AgentError(
            "invalid_request", "stop must be a string or an array of strings", param="stop"
        )
    params = SamplingParams(
        max_new_tokens=min(limit, max_tokens),
        temperature=float(asked),
        stop=stop,
        stop_token_ids=stop_token_ids,
    )
    return normalised(body.get("messages")), params


def completion(model: str, text: str, gen: Generation, prompt_tokens: int | None) -> dict:
    """A ``chat.completion`` object (``prompt_tokens`` None: not counted, reported as 0)."""
    prompt = prompt_tokens or 0
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": gen.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": len(gen.token_ids),
            "total_tokens": prompt + len(gen.token_ids),
        },
    }


def model_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "asyncppo"}]}


UNNAMED = {"invalid_request", "bad_body", "too_large", "no_route", "timeout", "internal"}


def error_body(error: AgentError, status: int) -> dict:
    """An OpenAI error object; generic refusals (``UNNAMED``) carry no ``code``."""
    return {
        "error": {
            "message": str(error),
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": error.param,
            "code": None if error.code in UNNAMED else error.code,
        }
    }

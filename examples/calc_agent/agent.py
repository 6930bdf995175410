"""An agent written against the `openai` client only, trained by asyncppo without changing it.

It answers arithmetic questions. Each episode is one question: the agent asks the model, lets it
call a calculator tool (a reply that starts with "calc:" gets the tool's result back as a `tool`
message), keeps at most `--keep` messages of history (older turns are compacted into one summary
message, as agents do when their context fills up), and gives a reward of 1 when a reply contains
the right number. The only asyncppo-specific part is where the client points: a session's
`base_url`, from `POST /v1/sessions`, and `POST /v1/sessions/<id>/end` with the reward.

    python examples/calc_agent/agent.py --actor http://127.0.0.1:8000 --episodes 64
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import urllib.request

import openai


def call(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


def calculator(expression: str) -> str:
    """The tool: `a + b`, `a - b` or `a * b` of whole numbers, nothing else is evaluated."""
    match = re.fullmatch(r"\s*(\d+)\s*([+*-])\s*(\d+)\s*", expression)
    if match is None:
        return "error: write calc: <number> <+, - or *> <number>"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def episode(actor: str, model: str, seed: int, *, turns: int = 4, keep: int = 4) -> dict:
    """One question, played through one session; returns what the agent saw and got."""
    rng = random.Random(seed)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    session = call(f"{actor}/v1/sessions", {})
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused")
    messages = [
        {"role": "user", "content": f"What is {a} + {b}? You may answer calc: <expression>."}
    ]
    replies, reward, compactions = [], 0.0, 0
    for _ in range(turns):
        if len(messages) > keep:  # the context is full: the agent rewrites its own history
            summary = f"Earlier you tried {len(replies)} times. What is {a} + {b}?"
            messages = [{"role": "user", "content": summary}]
            compactions += 1
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        text = reply.choices[0].message.content
        replies.append(text)
        if str(a + b) in text:
            reward = 1.0
            break
        messages.append({"role": "assistant", "content": text})
        if text.strip().lower().startswith("calc:"):
            messages.append({"role": "tool", "content": calculator(text.split(":", 1)[1])})
        else:
            messages.append({"role": "user", "content": "Not yet. Try again."})
    call(f"{actor}/v1/sessions/{session['id']}/end", {"reward": reward})
    client.close()
    return {
        "session": session["id"],
        "replies": replies,
        "reward": reward,
        "compactions": compactions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actor", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny", help="the model name the actor serves")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=8, help="sessions at once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results: list[dict] = []
    seeds = iter(range(args.seed, args.seed + args.episodes))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                seed = next(seeds, None)
            if seed is None:
                return
            result = episode(args.actor, args.model, seed)
            with lock:
                results.append(result)
                print(json.dumps(result), flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.parallel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    mean = sum(r["reward"] for r in results) / max(1, len(results))
    print(f"calc_agent: {len(results)} episodes, mean reward {mean:.3f}", flush=True)


if __name__ == "__main__":
    main()

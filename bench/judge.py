"""How well the reward-hacking guard catches hacks: the fixed rules, a language-model judge, both.

Every tool call of the labelled set (bench/data/guard_cases.json: legitimate calls, the hacks the
rules are written for, and disguised ones they are not) is screened three ways: rules only, the
judge only, and the guard as it runs (rules first, the judge on what they let through).
Precision and recall of "hack" for each, per kind, and the judge's outcomes (answers, timeouts,
garbage; a failure counts as the configured `on_failure`).

The judge is any OpenAI-compatible endpoint (`--url`, `--model`), or, with `--serve PATH`, this
script starts a broker and an actor in agent mode on the checkpoint at PATH and asks the actor's
plain /v1/chat/completions route (nothing is trained, no permit is taken).

    python -m bench.judge --serve runs/models/smollm2-135m-instruct [--out docs/results/judge.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from actors.envs.guard import check_action
from actors.envs.judge import LLMJudge
from bench.record import SCRATCH, write_report
from common.lifecycle import spawn

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "bench" / "data" / "guard_cases.json"


def scores(predicted: list[bool], labels: list[bool]) -> dict[str, float | int]:
    tp = sum(p and y for p, y in zip(predicted, labels, strict=True))
    fp = sum(p and not y for p, y in zip(predicted, labels, strict=True))
    fn = sum(y and not p for p, y in zip(predicted, labels, strict=True))
    return {
        "true_positives": tp,
        "false_positives": fp,
        "false_negatives": fn,
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / (tp + fn) if tp + fn else float("nan"),
    }


def evaluate(cases: list[dict], judge: Callable[[str], bool]) -> dict:
    labels = [case["hack"] for case in cases]
    rules = [check_action(case["call"]) is not None for case in cases]
    judged = [judge(case["call"]) for case in cases]
    guard = [r or j for r, j in zip(rules, judged, strict=True)]
    report = {
        name: scores(predicted, labels)
        for name, predicted in (("rules", rules), ("judge", judged), ("guard", guard))
    }
    report["per_case"] = [
        {**case, "rules": r, "judge": j} for case, r, j in zip(cases, rules, judged, strict=True)
    ]
    return report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model_path: str, name: str) -> Iterator[str]:
    """A broker and an agent-mode actor on `model_path`; yields the actor's /v1 URL."""
    broker, api = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{broker}"
    common = ["--set", f"model.path={model_path}", "--set", "model.builtin=null"]
    cli = [sys.executable, "-m", "deploy.cli"]
    procs = [
        spawn(cli + ["broker", "--set", f"broker.bind={endpoint}"] + common, cwd=ROOT),
        spawn(
            cli
            + ["actor", "--set", f"actor.broker={endpoint}", "--set", "actor.mode=agent"]
            + ["--set", f"actor.agent_port={api}", "--set", f"actor.agent_model={name}"]
            + common,
            cwd=ROOT,
        ),
    ]
    url = f"http://127.0.0.1:{api}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/models", timeout=2).status == 200:
                    break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the judge's actor did not start serving")
            time.sleep(1)
        yield url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an OpenAI-compatible endpoint (…/v1)")
    parser.add_argument("--model", default="judge", help="the model name the endpoint serves")
    parser.add_argument("--serve", help="serve this checkpoint with an agent-mode actor")
    parser.add_argument("--on-failure", choices=("block", "allow"), default="block")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--temperature", type=float, default=0.01, help="near-greedy verdicts")
    parser.add_argument("--out", type=Path, default=SCRATCH / "judge.json")
    args = parser.parse_args()
    if bool(args.url) == bool(args.serve):
        parser.error("give exactly one of --url and --serve")
    cases = json.loads(CASES.read_text())["cases"]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(served(args.serve, args.model))
        judge = LLMJudge(
            url,
            args.model,
            timeout_s=args.timeout_s,
            on_failure=args.on_failure,
            temperature=args.temperature,
        )
        start = time.monotonic()
        report = evaluate(cases, judge)
        seconds = time.monotonic() - start
    report["meta"] = {
        "judge_model": args.serve or args.model,
        "on_failure": args.on_failure,
        "temperature": args.temperature,
        "judge_outcomes": judge.outcomes,
        "cases": len(cases),
        "hacks": sum(case["hack"] for case in cases),
        "judge_seconds": seconds,
    }
    for name in ("rules", "judge", "guard"):
        r = report[name]
        print(f"{name:6s} precision {r['precision']:.2f} recall {r['recall']:.2f}  ({r})")
    print(f"judge outcomes: {judge.outcomes}")
    write_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

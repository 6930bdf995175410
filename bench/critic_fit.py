"""Can the critic represent the chain's value at all? Offline regression on the warm policy's episodes.

The critic experiment's critics explain almost none of the return on held-out episodes while the
Monte-Carlo value function explains about half. This separates capacity from training signal: the
separate critic (tiny-chain-warm trunk, zero-init head) is regressed with AdamW on 400 training
instances x 8 plays of the warm policy, on realised returns (what GAE with lambda 1 gives the
learner) or on leave-one-out Monte-Carlo values (clean targets), and scored every 50 steps on 96
held-out instances x 8 plays against realised returns.

    python bench/critic_fit.py   # ~8 min on 2 cores -> docs/results/critic_fit.json
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.engines import engine_for  # noqa: E402
from actors.episode import ChatFormat  # noqa: E402
from actors.evaluation import evaluate, held_out_instances  # noqa: E402
from common.config import load_config  # noqa: E402
from common.model import load_tokenizer  # noqa: E402
from learner.batch import Batch  # noqa: E402
from learner.critic_eval import explained, leave_one_out, turn_returns, turn_starts  # noqa: E402
from learner.models import Critic, shift_to_tokens  # noqa: E402

MODEL = str(ROOT / "runs/models/tiny-chain-warm")  # asyncppo model warmup chain
PLAYS, LR, STEPS, SEGMENTS = 8, 1e-3, 300, 64


class Turns:
    """Every turn of some episodes: its segment, its first action token, return and MC value."""

    def __init__(self, played: list[tuple]) -> None:
        self.segments, self.rows, self.returns = [], [], []
        keys, episode = [], []
        for e, (seed, states, segs) in enumerate(played):
            returns, t = turn_returns(segs, 1.0), 0
            for seg in segs:
                self.segments.append(seg)
                for start in turn_starts(seg.action_mask):
                    self.rows.append((len(self.segments) - 1, start))
                    keys.append((seed, states[t]))
                    self.returns.append(returns[t])
                    episode.append(e)
                    t += 1
        self.mc = leave_one_out(keys, self.returns, episode)


def values(critic: Critic, segments: list, rows: list[tuple[int, int]]) -> torch.Tensor:
    """V at each (segment, position) of `rows`, as the learner aligns it."""
    batch = Batch.of(segments)
    ids, attn, _ = batch.inputs(list(range(len(batch))), "cpu")
    v = shift_to_tokens(critic(ids, attn))
    return torch.stack([v[r, s] for r, s in rows])


def held_out_ev(critic: Critic, held: Turns) -> float:
    out = []
    with torch.no_grad():
        for i in range(0, len(held.segments), 256):
            rows = [(r - i, s) for r, s in held.rows if i <= r < i + 256]
            out.append(values(critic, held.segments[i : i + 256], rows))
    return explained(held.returns, torch.cat(out).tolist())


def fit(kind: str, train: Turns, held: Turns) -> list[dict]:
    torch.manual_seed(0)
    rng = random.Random(0)
    critic = Critic(MODEL, torch.float32)
    opt = torch.optim.AdamW(critic.parameters(), lr=LR)
    targets = (
        train.returns
        if kind == "return"
        else [r if m is None else m for m, r in zip(train.mc, train.returns, strict=True)]
    )
    by_segment: dict[int, list[tuple[int, int]]] = {}
    for k, (r, s) in enumerate(train.rows):
        by_segment.setdefault(r, []).append((s, k))
    curve, t0 = [], time.time()
    for step in range(1, STEPS + 1):
        pick = rng.sample(range(len(train.segments)), SEGMENTS)
        rows, target = [], []
        for j, i in enumerate(pick):
            for s, k in by_segment.get(i, []):
                rows.append((j, s))
                target.append(targets[k])
        v = values(critic, [train.segments[i] for i in pick], rows)
        loss = ((v - torch.tensor(target)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            curve.append({"step": step, "held_out_critic_ev": held_out_ev(critic, held)})
            print(kind, curve[-1], f"{time.time() - t0:.0f}s", flush=True)
    return curve


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [
            f"model.path={MODEL}",
            "actor.env=chain",
            "actor.env_kwargs={max_turns: 50, early_termination: true}",
            "actor.max_turns=100",
            "actor.context_budget_tokens=384",
            "eval.episodes=96",
        ],
    )
    engine, fmt = engine_for(cfg, MODEL), ChatFormat(load_tokenizer(MODEL))

    def play(instances: list) -> Turns:
        played: list[tuple] = []
        on_episode = lambda p, ep: played.append((p.seed, p.states, ep.segments))  # noqa: E731
        evaluate(cfg, engine, fmt, instances * PLAYS, on_episode=on_episode)
        return Turns(played)

    held = play(held_out_instances(cfg, 96))
    train = play([(seed, None) for seed in range(400)])  # training seeds: bit 31 clear
    scored = [i for i, m in enumerate(held.mc) if m is not None]
    report = {
        "command": "python bench/critic_fit.py",
        "held_out_monte_carlo_ev": explained(
            [held.returns[i] for i in scored], [held.mc[i] for i in scored]
        ),
        "held_out_turns": len(held.rows),
        "train_turns": len(train.rows),
        "plays_per_instance": PLAYS,
        "lr": LR,
        "segments_per_step": SEGMENTS,
        "curves": {kind: fit(kind, train, held) for kind in ("return", "mc")},
    }
    (ROOT / "docs/results/critic_fit.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

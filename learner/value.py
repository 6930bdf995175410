"""The critic's math in one room: how well values explain returns, the Monte-Carlo value of a
state, and the regression that fits a critic to it.

* ``value_sums`` / ``explained_variance``: 1 − Var(R − V) / Var(R) from sums that ranks can
  all-reduce (the step log's ``explained_variance``, the critic warm-up's gate);
* ``turn_starts`` / ``turn_returns``: where each turn's action tokens begin, and the return-to-go
  R_t = r_t + γ R_{t+1} of every turn of an episode;
* ``leave_one_out`` / ``exact_value_explained``: the Monte-Carlo value V^π(s) of a state (the mean
  return of the *other* plays that reached it) and V^π's own explained variance, free of that
  estimate's sampling noise;
* ``Turns`` / ``fit``: every turn of some played episodes, and the least-squares fit of a critic
  to their Monte-Carlo values (``asyncppo critic``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from common.trajectory import Segment
from learner.batch import Batch
from learner.models import Critic, shift_to_tokens

VALUE_SUMS = ("n", "sum_r", "sum_r2", "sum_d", "sum_d2")  # the names of value_sums' entries


def value_sums(returns: torch.Tensor, values: torch.Tensor) -> list[float]:
    """[n, ΣR, ΣR², Σ(R−V), Σ(R−V)²] over the given (action) tokens, in float64.

    Sums, so that ranks can all-reduce them before ``explained_variance``.
    """
    r, d = returns.double(), returns.double() - values.double()
    return [
        float(r.numel()),
        float(r.sum()),
        float((r**2).sum()),
        float(d.sum()),
        float((d**2).sum()),
    ]


def explained_variance(sums: Sequence[float]) -> float:
    """1 − Var(R−V) / Var(R) from ``value_sums`` (population variances); 0 without variance.

    Var, not the mean square: a critic off by a constant explains all the variance (1.0).
    """
    n, r, r2, d, d2 = sums
    if n <= 0:
        return 0.0
    var_r = r2 / n - (r / n) ** 2
    if var_r <= 1e-12:
        return 0.0
    return 1.0 - (d2 / n - (d / n) ** 2) / var_r


def explained(returns: Sequence[float], predictions: Sequence[float]) -> float:
    """``explained_variance`` of predictions given as lists."""
    r, v = (
        torch.tensor(returns, dtype=torch.float64),
        torch.tensor(predictions, dtype=torch.float64),
    )
    return explained_variance(value_sums(r, v))


# ---------------------------------------------------------------------------- turns
def turn_starts(action_mask: np.ndarray | torch.Tensor) -> list[int]:
    """Index of each turn's first action token: where a run of action tokens begins."""
    if isinstance(action_mask, torch.Tensor):
        action_mask = action_mask.cpu().numpy()
    mask = np.asarray(action_mask, dtype=bool)
    return [int(i) for i in np.flatnonzero(mask & ~np.r_[False, mask[:-1]])]


def _turn_spans(action_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each turn's action tokens and the observation after them: a turn's
    reward sits on its action tokens (``actors.recorder``)."""
    starts = turn_starts(action_mask)
    return list(zip(starts, [*starts[1:], len(action_mask)], strict=True))


def turn_returns(segments: Sequence[Segment], gamma: float) -> list[float]:
    """R_t = r_t + γ R_{t+1} per turn of an episode (its segments in order): r_t is the reward
    on the turn's action tokens."""
    rewards = [
        float(seg.rewards[start:end].sum())
        for seg in segments
        for start, end in _turn_spans(seg.action_mask)
    ]
    returns, ahead = [], 0.0
    for r in reversed(rewards):
        ahead = r + gamma * ahead
        returns.append(ahead)
    return returns[::-1]


# -------------------------------------------------------------------- Monte Carlo
def _others(
    states: Sequence[Hashable], returns: Sequence[float], episode: Sequence[int]
) -> list[tuple[float, int]]:
    """For each turn, the sum and the count of the returns of the turns of *other* episodes in
    the same state. (An episode visits a state at most once where the state counts turns; where
    it can revisit one, its own visits are all left out.)"""
    total: dict[Hashable, float] = defaultdict(float)
    count: dict[Hashable, int] = defaultdict(int)
    own: dict[tuple[Hashable, int], tuple[float, int]] = defaultdict(lambda: (0.0, 0))
    for s, r, e in zip(states, returns, episode, strict=True):
        total[s] += r
        count[s] += 1
        t, c = own[s, e]
        own[s, e] = (t + r, c + 1)
    return [
        (total[s] - own[s, e][0], count[s] - own[s, e][1])
        for s, e in zip(states, episode, strict=True)
    ]


def leave_one_out(
    states: Sequence[Hashable], returns: Sequence[float], episode: Sequence[int]
) -> list[float | None]:
    """For each turn, the mean return of the turns of other episodes in the same state (the
    Monte-Carlo value of the state); None where no other episode reached it."""
    return [t / n if n else None for t, n in _others(states, returns, episode)]


def exact_value_explained(
    states: Sequence[Hashable], returns: Sequence[float], episode: Sequence[int]
) -> float:
    """The explained variance of V^π itself on the turns another episode also reached,
    estimated without the sampling noise of its Monte-Carlo estimate m (the mean of the n other
    plays' returns), which ``explained(R, m)`` counts against the value function.

    Given the state, R and the n other returns are independent draws of one distribution with
    variance σ²_s, so E[(R − m)² | s] = σ²_s (1 + 1/n) while E[(R − V^π)² | s] = σ²_s: each
    squared residual weighted by n/(n+1) estimates V^π's, and V^π's residual has mean 0, so
    EV = 1 − Σ (R − m)² n/(n+1) / Σ (R − R̄)². With few plays m is noisy enough that a critic
    can "beat" it; this is the figure a critic is compared with."""
    others = _others(states, returns, episode)
    kept = [(r, t / n, n) for r, (t, n) in zip(returns, others, strict=True) if n]
    if not kept:
        return 0.0
    r, m, n = (np.array(x, dtype=np.float64) for x in zip(*kept, strict=True))
    var_r = float(np.var(r))
    if var_r <= 1e-12:
        return 0.0
    return 1.0 - float(np.mean((r - m) ** 2 * n / (n + 1))) / var_r


# --------------------------------------------------------------------------- fitting
class Turns:
    """Every turn of some played episodes: (segment, first action token) rows, the realised
    return R_t, the regression target (the Monte-Carlo value, R_t where it has none), the turns
    another play also reached (``scored``: where the value function is defined) and V^π's
    explained variance on them."""

    def __init__(self, played: Sequence[tuple[int, list[tuple], list]], gamma: float) -> None:
        self.segments: list = []
        self.rows: list[tuple[int, int]] = []
        self.returns: list[float] = []
        keys, episode = [], []
        for e, (seed, states, segments) in enumerate(played):
            returns = turn_returns(segments, gamma)
            starts = [turn_starts(seg.action_mask) for seg in segments]
            if len(states) != len(returns):  # a turn that sampled no token: not scorable
                continue
            for seg, seg_starts in zip(segments, starts, strict=True):
                self.segments.append(seg)
                self.rows += [(len(self.segments) - 1, s) for s in seg_starts]
            keys += [(seed, s) for s in states]
            self.returns += returns
            episode += [e] * len(returns)
        self.monte_carlo = leave_one_out(keys, self.returns, episode)
        self.exact_value_ev = exact_value_explained(keys, self.returns, episode)
        self.targets = [
            r if m is None else m for m, r in zip(self.monte_carlo, self.returns, strict=True)
        ]
        self.scored = [i for i, m in enumerate(self.monte_carlo) if m is not None]


def values(critic: Critic, segments: list, rows: list[tuple[int, int]]) -> torch.Tensor:
    """V at each (segment, position) of ``rows``, aligned as the learner reads it."""
    ids, _ = Batch.of(segments).inputs(list(range(len(segments))), "cpu")
    v = shift_to_tokens(critic(ids))
    return torch.stack([v[r, s] for r, s in rows])


def held_out_ev(critic: Critic, held: Turns, chunk: int = 256) -> float:
    """The critic's explained variance of the held-out turns' realised returns (on the scored
    turns, as the value function's)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(held.segments), chunk):
            rows = [(r - i, s) for r, s in held.rows if i <= r < i + chunk]
            out.append(values(critic, held.segments[i : i + chunk], rows))
    v = torch.cat(out).tolist()
    return explained([held.returns[i] for i in held.scored], [v[i] for i in held.scored])


def fit(
    critic: Critic,
    train: Turns,
    held: Turns,
    *,
    steps: int,
    lr: float,
    segments_per_step: int,
    score_every: int,
    rng: random.Random,
    on_score: Callable[[dict], None] = lambda point: None,
) -> list[dict]:
    """Least squares of V on the training turns' Monte-Carlo values (V^π up to sampling noise),
    ``segments_per_step`` segments a step; the held-out curve, scored every ``score_every``
    steps and at the end (each point also to ``on_score``)."""
    opt = torch.optim.AdamW(critic.parameters(), lr=lr)
    by_segment: dict[int, list[tuple[int, int]]] = {}
    for k, (r, s) in enumerate(train.rows):
        by_segment.setdefault(r, []).append((s, k))
    curve = [{"step": 0, "held_out_critic_ev": held_out_ev(critic, held)}]
    for step in range(1, steps + 1):
        pick = rng.sample(range(len(train.segments)), min(segments_per_step, len(train.segments)))
        rows, target = [], []
        for j, i in enumerate(pick):
            for s, k in by_segment.get(i, []):
                rows.append((j, s))
                target.append(train.targets[k])
        if not rows:
            continue
        v = values(critic, [train.segments[i] for i in pick], rows)
        loss = ((v - torch.tensor(target)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % score_every == 0 or step == steps:
            curve.append({"step": step, "held_out_critic_ev": held_out_ev(critic, held)})
            on_score(curve[-1])
    return curve

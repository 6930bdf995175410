"""What the experiments train on: the models they start from and the task configurations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


RUNS = ROOT / "runs" / "experiments"


MODEL = "runs/models/tiny"  # the built-in random-init model: the same starting point for every run


SMOLLM2 = "runs/models/smollm2-135m-instruct"  # `make smollm2` prepares it


WARM_MAZE_MODEL = "runs/models/tiny-maze-warm"  # `asyncppo model warmup maze` builds it


WARM_CHAIN_MODEL = "runs/models/tiny-chain-warm"  # `asyncppo model warmup chain` builds it


# `asyncppo critic` on the warm chain model's early-termination episodes (fitted_critic): its
# directory -> (instances, plays, steps); the second plays 4x the instances for 4x the steps
WARM_CHAIN_CRITIC = "runs/models/tiny-chain-warm-critic"


WARM_CHAIN_CRITIC_12K = "runs/models/tiny-chain-warm-critic-12k"


FITTED_CRITICS = {WARM_CHAIN_CRITIC: (400, 8, 300), WARM_CHAIN_CRITIC_12K: (1600, 8, 1200)}


QUICK_CRITIC = ("runs/models/tiny-chain-warm-critic-quick", (40, 4, 50))


# The warm chain model's weights with 2,048 positions: a 50-turn episode without compaction is
# ~1,400 tokens (long_context_copy)
WARM_CHAIN_2K_MODEL = "runs/models/tiny-chain-warm-2k"


BASE = {
    "model.path": MODEL,
    "model.builtin": "tiny",
    "learner.zero_stage": 1,
    "learner.checkpoint_every": 0,
    "run.metrics_base_port": 0,
    "run.log_format": "json",
}


DIGITS = {
    "actor.env": "digits",
    "actor.permits_per_request": 8,
    "learner.batch_size": 32,
    "learner.optimizer.lr": 3e-3,
    "learner.critic.lr": 3e-3,
    "learner.ppo_epochs": 2,
}


def maze(max_turns: int) -> dict[str, Any]:
    """2..max_turns turns (log-uniform), sparse 0/1 reward, compaction past 384 context tokens.

    The random-init tiny model almost never emits a valid move: use it for pipeline throughput,
    and MAZE_LEARNING (a warmed start) where learning is measured.
    """
    return {
        "actor.env": "maze",
        "actor.env_kwargs": {"max_turns": max_turns},
        "actor.max_turns": max_turns,
        "actor.context_budget_tokens": 384,
        "actor.permits_per_request": 4,
        "learner.batch_size": 16,
        "learner.optimizer.lr": 3e-3,
        "learner.critic.lr": 3e-3,
        "learner.ppo_epochs": 1,
    }


# The long-horizon comparison: 2-50 turn mazes (the spec's horizon), a hint with the next optimal
# move on every turn, 2 tokens per action (a move letter and the end of turn), started from the
# warmed tiny model of deploy/warmup.py (a partial instruction follower). What RL must
# learn is to follow the hint on every turn of a long episode rewarded only at its end.
MAZE_LEARNING = {
    **maze(50),
    "actor.env_kwargs": {"max_turns": 50, "hint_max_turns": 50, "action_tokens": 2},
    "model.path": WARM_MAZE_MODEL,
    "model.builtin": None,
    "learner.optimizer.lr": 3e-4,  # 1e-3 drifted the warmed model off the hint within 25 steps
    "learner.critic.warmup_steps": 2,
}


# The long-horizon testbed (actors/envs/chain.py): N log-uniform in 2-50 right answers, reward
# only after the N-th, compaction past 384 context tokens (one to about ten segments an episode),
# from the chain warm start of deploy/warmup.py (it copies the hint on ~85% of turns: held-out
# success ~0.3, most short instances and few long ones).
# Every arm: 32 episodes a step in groups of 8 (GRPO's groups; PPO gets the same instance
# stream), advantages centred over the batch's action tokens, the same steps, so the same
# episodes; generated tokens are reported per run.
CHAIN = {
    "actor.env": "chain",
    "actor.max_turns": 100,
    "actor.context_budget_tokens": 384,
    "actor.permits_per_request": 8,
    "actor.group_size": 8,
    "learner.batch_size": 32,
    "model.path": WARM_CHAIN_MODEL,
    "model.builtin": None,
    "learner.optimizer.lr": 3e-4,
    "learner.critic.lr": 1e-3,
    "learner.advantage_norm": "centre",
    "broker.max_staleness": 1,
}


CHAIN_VARIANTS = {  # name -> environment arguments
    "early": {"max_turns": 50, "early_termination": True},
    # A wrong answer costs a turn of a budget of N + 10%: the warm start's ~15% wrong answers
    # exhaust it on long instances (at the default 50% slack it starts at ~0.97, nothing to learn).
    "no-early": {"max_turns": 50, "early_termination": False, "slack": 0.1},
    "coin-flip": {"max_turns": 50, "early_termination": True, "coin_flip": True},
    "short": {"min_turns": 1, "max_turns": 3, "early_termination": True},
}

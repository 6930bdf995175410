"""The demo's and the long-horizon experiments' starting models: the tiny model after a short
supervised warm-up.

RL post-training starts from a model that already answers in the task's format and follows
instructions somewhat. The built-in random-init tiny model does neither: about 8% of its
vocabulary starts with a move letter, so on a sparse-reward 2-50 turn maze it almost never
reaches a door and neither PPO nor GRPO has anything to reinforce (0.5% of episodes over 25
steps at a 20-turn budget, measured).

The warm-up is next-token training on the action tokens of real episodes of the environment
(`maze` or `chain`: both show a hint, `Hint: [U]`), rendered with the chat template the actors
use, in which a demonstrator types the observation's hint (a move letter, then the end of turn).
Where the warmed model starts RL differs by environment (`RECIPES`):

* maze: a demonstrator that always types the hint, stopped early (100 steps), so the model
  answers with a move but follows the hint only part of the time.
* chain: a demonstrator that types the hint 80% of the time and a random move otherwise,
  trained to convergence (600 steps). The model then follows the hint on ~85% of turns (held-out
  success ~0.3: most short instances, few long ones), and what it gains beyond that it learns by
  RL. A converged model is a property of the data, not of when training stopped: the chain's
  earlier recipe (a perfect demonstrator stopped at 220 steps, in the middle of the abrupt jump
  in which the tiny model learns to copy) gave a different model on another processor, and RL
  learned from one and not from the other. (A demonstrator that follows the hint only 30% of the
  time does not work: the 100k parameter model then learns the letter frequencies, not the copy.)

    asyncppo model warmup maze|chain [--out DIR]   (default: runs/models/tiny-<env>-warm)

`make demo` starts from the chain's warm model; the experiments in bench/ start from both.

Deterministic for a given seed and built once: an existing directory is reused when its
`warmup.json` names the same recipe, and rebuilt otherwise.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

from actors.chat import ChatFormat
from actors.envs import make_env
from common.model import ensure_model, load_causal_lm, load_tokenizer

BASE_MODEL = "runs/models/tiny"
OUT = "runs/models/tiny-maze-warm"
# Every instance prints its hint: the demonstrator always has a letter to type.
ENVS = {
    "maze": {"max_turns": 50, "hint_max_turns": 50, "action_tokens": 2},
    "chain": {"max_turns": 50, "early_termination": False},
}
# Optimiser steps and how often the demonstrator types the hint (see the module docstring).
RECIPES = {"maze": {"steps": 100, "hint_rate": 1.0}, "chain": {"steps": 600, "hint_rate": 0.8}}


def demonstrations(
    tokenizer, *, episodes: int, turns: int, hint_rate: float, seed: int, env: str = "maze"
) -> list[tuple[list[int], list[int]]]:
    """(token ids, action mask) of `env` episodes whose moves follow the hint with probability
    `hint_rate` and are uniformly random otherwise."""
    fmt, rng = ChatFormat(tokenizer), random.Random(seed)
    end_of_turn = fmt.stop_token_ids[0]
    env = make_env(env, **ENVS[env])
    transcripts = []
    for episode in range(episodes):
        observation = env.reset(seed=seed * 1_000_003 + episode)
        ids = fmt.prompt(observation)
        mask = [0] * len(ids)
        for _ in range(turns):
            hint = re.search(r"Hint: \[([UDLR])\]", observation)[1]
            letter = hint if rng.random() < hint_rate else rng.choice("UDLR")
            move = tokenizer(letter, add_special_tokens=False)["input_ids"]
            action = [*move, end_of_turn]
            ids, mask = ids + action, mask + [1] * len(action)
            result = env.step(tokenizer.decode(action, skip_special_tokens=True))
            if not result.observation:
                break
            observation = result.observation
            observed = fmt.turn(observation, action)
            ids, mask = ids + observed, mask + [0] * len(observed)
        transcripts.append((ids, mask))
    return transcripts


def warm_up(
    out: str | Path = OUT,
    *,
    env: str = "maze",
    episodes: int = 256,
    turns: int = 6,
    steps: int | None = None,
    batch: int = 16,
    lr: float = 3e-3,
    hint_rate: float | None = None,
    seed: int = 0,
) -> Path:
    """Next-token loss on the demonstrations' action tokens; saves a Hugging Face directory
    with the recipe beside it (`warmup.json`), so that a changed recipe is not silently reused."""
    out = Path(out)
    steps = steps or RECIPES[env]["steps"]
    hint_rate = RECIPES[env]["hint_rate"] if hint_rate is None else hint_rate
    recipe = {
        "env": env,
        "episodes": episodes,
        "turns": turns,
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "hint_rate": hint_rate,
        "seed": seed,
    }
    written = out / "warmup.json"  # last: its presence means the directory is complete
    if written.exists() and json.loads(written.read_text()) == recipe:
        return out
    torch.manual_seed(seed)
    base = ensure_model(BASE_MODEL, builtin="tiny")
    tokenizer, model = load_tokenizer(base), load_causal_lm(base)
    data = demonstrations(
        tokenizer, episodes=episodes, turns=turns, hint_rate=hint_rate, seed=seed, env=env
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        chosen = rng.sample(data, batch)
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        attention = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100)  # -100: no loss (observations and padding)
        for row, (seq, mask) in enumerate(chosen):
            n = len(seq)
            ids[row, :n], attention[row, :n] = torch.tensor(seq), 1
            labels[row, :n] = torch.where(torch.tensor(mask) == 1, torch.tensor(seq), -100)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    written.write_text(json.dumps(recipe, indent=1) + "\n")
    print(f"{env} warm-up: {steps} steps, final action-token loss {loss.item():.3f} -> {out}")
    return out

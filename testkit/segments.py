"""The one factory of synthetic segments, and synthetic weights: valid inputs for any layer.

A segment is described by its layout, one letter per token: ``a`` an action token the policy
sampled, ``o`` a prompt or observation token. Everything else has a default a test can override.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from common.trajectory import Segment

if TYPE_CHECKING:
    import torch

BEHAVIOR = -6.0  # ~ log(1/400): a near-uniform policy's log-prob of its sampled token
TOKEN_IDS = (5, 400)  # below every test model's vocabulary, above its special tokens


def turns(num_tokens: int) -> str:
    """A prompt token, then turns of 3 action tokens and 1 observation token."""
    if num_tokens < 2:
        raise ValueError(
            f"num_tokens must be >= 2 (a prompt token and an action), got {num_tokens}"
        )
    return "".join("o" if i % 4 == 0 else "a" for i in range(num_tokens))


def make_segment(
    layout: str = "ooaaoa",
    *,
    episode_id: str = "ep",
    index: int = 0,
    actor_id: str = "actor-0",
    permit: str | None = None,
    group_id: str | None = None,
    version: int = 0,
    last: bool = True,
    terminated: bool | None = None,
    rewards: dict[int, float] | np.ndarray | None = None,
    behavior: float = BEHAVIOR,
    seed: int | None = None,
    **fields: Any,
) -> Segment:
    """A valid segment of ``layout``.

    Action tokens carry ``version`` and log-prob ``behavior``; ``rewards`` maps positions to
    rewards, or is the whole per-token array (default: 1 on the last action token of an episode's final segment). ``terminated``
    defaults to ``last``; a segment that did not terminate is ``truncated`` (a compaction cut or a
    budget end). Token ids are drawn from ``seed`` (default: fixed per episode and index).
    ``fields`` replace any other ``Segment`` field after the defaults are built.
    """
    mask = np.array([c == "a" for c in layout], dtype="|u1")
    actions = np.flatnonzero(mask)
    if not len(actions) or set(layout) - {"a", "o"}:
        raise ValueError(f"layout is a string of 'a' and 'o' with at least one 'a', got {layout!r}")
    terminated = last if terminated is None else terminated
    if rewards is None:
        rewards = {int(actions[-1]): 1.0} if last else {}
    if isinstance(rewards, dict):
        reward_array = np.zeros(len(layout), "<f4")
        for pos, r in rewards.items():
            reward_array[pos] = r
    else:
        reward_array = np.asarray(rewards, "<f4")
    if seed is None:
        seed = zlib.crc32(f"{episode_id}/{index}".encode())
    seg = Segment(
        traj_id=f"{episode_id}.{index}",  # as actors/recorder.py names them
        episode_id=episode_id,
        segment=index,
        actor_id=actor_id,
        task="test",
        group_id=group_id,
        permit=f"permit-{episode_id}" if permit is None else permit,
        last=last,
        terminated=terminated,
        truncated=not terminated,
        temperature=1.0,
        top_p=1.0,
        tokens=np.random.default_rng(seed).integers(*TOKEN_IDS, len(layout)).astype("<i4"),
        action_mask=mask,
        behavior_logprobs=np.where(mask == 1, behavior, 0.0).astype("<f4"),
        versions=np.where(mask == 1, version, -1).astype("<i4"),
        rewards=reward_array,
    )
    return dataclasses.replace(seg, **fields) if fields else seg


def segment_digest(seg: Segment) -> str:
    """sha256 of a segment's arrays, name by name: equal digests, equal tensors."""
    h = hashlib.sha256()
    for name, arr in seg.arrays().items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(arr))
    return h.hexdigest()


def synthetic_weights(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict of exactly ``nbytes`` (a multiple of 8): a float32 matrix and a bias."""
    import torch

    if nbytes < 8 or nbytes % 8:
        raise ValueError(f"nbytes must be a positive multiple of 8, got {nbytes}")
    gen = torch.Generator().manual_seed(seed)
    numel = nbytes // 4
    return {
        "layer.weight": torch.rand(numel - 2, generator=gen),
        "layer.bias": torch.rand(2, generator=gen),
    }

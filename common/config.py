"""Typed configuration: one YAML file for every role, plus ``--set a.b=value`` overrides.

Every field carries its help text (``param(default, "help")``), so the reference in docs/configuration.md and
``asyncppo config --reference`` come from the same place as the defaults. Loading rejects unknown
keys and badly typed values with an error that names the key, the value and where it came from.
"Off" is spelled one way per kind: 0 for a number (a rate, a count, a period), null for a path or
an address. A choice is declared once, as the field's ``Literal``; the registries that implement
the choices (``learner/algorithms.py``) are checked against it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key, the value and its source."""


def param(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> Any:
    """A dataclass field with a default, a help string (shown in the config reference) and the
    bounds of its value, checked with the value's type wherever a value is set."""
    meta = {"help": help, "minimum": minimum, "maximum": maximum, "above": above}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _check_bounds(value: Any, meta: Any, key: str, source: str) -> None:
    lo, hi, above = meta["minimum"], meta["maximum"], meta["above"]
    if lo is not None and hi is not None and not lo <= value <= hi:
        rule = f"{lo}-{hi}"
    elif lo is not None and value < lo:
        rule = f">= {lo}"
    elif above is not None and not value > above:
        rule = f"> {above}"
    else:
        return
    raise ConfigError(f"config key '{key}' must be {rule}, got {value!r} ({source})")


@dataclass
class ModelConfig:
    path: str = param(
        "runs/models/tiny", "Local Hugging Face directory: config.json, weights, tokenizer."
    )
    builtin: str | None = param(
        "tiny",
        "Build this small random-init model at `path` when it is missing ('tiny'); null for a real checkpoint.",
    )
    hidden_size: int = param(64, "Hidden size of the built-in tiny model.")
    num_layers: int = param(2, "Layers of the built-in tiny model.")
    dtype: Literal["float32", "bfloat16"] = param(
        "float32", "Learner parameter dtype: float32 (CPU) or bfloat16 (GPU)."
    )


@dataclass
class BrokerConfig:
    bind: str = param(
        "tcp://127.0.0.1:5555",
        "ZeroMQ ROUTER endpoint the broker binds (actors and learner connect).",
    )
    max_staleness: int = param(
        1,
        "Largest allowed policy-version lag of any trained token; 0 is the synchronous baseline.",
        minimum=0,
    )
    max_queue_bytes: int = param(
        1 << 30, "Bytes of queued segments above which new segments get a retryable `busy`."
    )
    max_message_bytes: int = param(
        256 << 20, "ZMQ_MAXMSGSIZE on every socket: larger messages are refused.", minimum=1
    )
    heartbeat_timeout_s: float = param(
        15.0, "An actor silent this long is presumed dead; its permits are reclaimed."
    )
    batch_wait_s: float = param(
        2.0, "How long a GET_BATCH is held open before the broker answers WAIT."
    )
    permits_wait_s: float = param(
        1.0,
        "How long a PERMITS_REQ that finds no capacity is held open; it is answered the moment "
        "capacity frees, so actors wait without polling.",
    )
    spool_dir: str | None = param(
        None,
        "Directory where accepted segments and the newest weights are written before they are acknowledged.",
    )
    learner_lease_s: float = param(
        30.0,
        "The learner role belongs to the connection that took it; another connection may take it "
        "over only once the holder has been silent this long (at once under Curve with the same key).",
        above=0,
    )
    max_actors: int = param(
        10000,
        "Registered actors at most; a HELLO beyond it gets a retryable `actor_limit`.",
        minimum=1,
    )
    weights_fanout: Literal["chain", "star"] = param(
        "chain",
        "Whom a weight fetcher is sent to: chain (the last fetcher to join: a version reaches N "
        "actors in about the time it reaches one) or star (the learner: N copies through its link).",
    )


@dataclass
class ActorConfig:
    broker: str = param("tcp://127.0.0.1:5555", "Broker endpoint this actor connects to.")
    broker_timeout_s: float = param(
        30.0,
        "Seconds the actor waits for a broker reply before it presumes the broker restarted, "
        "reopens its socket and retries.",
        above=0,
    )
    id: str | None = param(
        None, "Actor id; default: hostname-pid (env ASYNCPPO_ACTOR_ID also sets it)."
    )
    engine: Literal["torch", "sglang", "simulated"] = param(
        "torch",
        "Inference engine: torch (CPU), sglang (GPU) or simulated (no model: random tokens, long-tailed latency).",
    )
    engine_dtype: Literal["auto", "float32", "bfloat16"] = param(
        "auto",
        "Engine weight dtype: auto (the engine's default: torch float32, sglang bfloat16), float32 or bfloat16.",
    )
    mode: Literal["env", "agent"] = param(
        "env",
        "env: play actor.env episodes. agent: serve an OpenAI-compatible API whose sessions are "
        "the episodes (docs/agents.md).",
    )
    agent_host: str = param("127.0.0.1", "Agent mode: address the API binds.")
    agent_port: int = param(
        8000, "Agent mode: port of the API (0: any free port, logged).", minimum=0
    )
    agent_model: str | None = param(
        None, "Agent mode: the model name clients must ask for; default the model directory's name."
    )
    agent_max_tokens: int = param(
        256, "Agent mode: most tokens one completion may generate.", minimum=1
    )
    agent_session_timeout_s: float = param(
        600.0, "Agent mode: a session older than this is abandoned (its permit freed).", above=0
    )
    agent_request_timeout_s: float = param(
        120.0,
        "Agent mode: how long a request may wait (for a permit, or its completion).",
        above=0,
    )
    env: str = param(
        "digits",
        "Environment: a built-in name (actors.envs.ENV_NAMES: digits, the default, is a smoke "
        "task; chain and maze are the long-horizon testbeds) or an import path "
        "'package.module:factory' to your own (docs/agents.md).",
    )
    env_kwargs: dict = param({}, "Keyword arguments for the environment factory.")
    max_inflight_episodes: int = param(
        32,
        "Episodes played at once, each at its own turn, one engine step for all (continuous "
        "batching); a slot is refilled as soon as its episode ends.",
        minimum=1,
    )
    permits_per_request: int = param(
        8,
        "Most permits one PERMITS_REQ asks for (a multiple of group_size); the actor asks again "
        "while slots are free.",
        minimum=1,
    )
    group_size: int = param(
        1, "Episodes per prompt sharing a group_id (GRPO needs > 1).", minimum=1
    )
    temperature: float = param(
        1.0, "Sampling temperature; each segment carries it and the learner scores with it."
    )
    top_p: float = param(
        1.0, "Nucleus sampling threshold: only 1.0 can be trained on (the learner refuses < 1)."
    )
    max_turns: int = param(
        50, "Turn budget of an episode; reaching it truncates the episode.", minimum=1
    )
    context_budget_tokens: int = param(
        512,
        "When the context passes this many tokens the environment compacts and a new segment starts.",
    )
    torch_threads: int = param(
        0,
        "torch intra-op threads of the actor process; 0 keeps torch's default (one per core). "
        "Set 1 when actors share cores with other roles: idle threads spin and steal them.",
        minimum=0,
    )
    peer_bind: str | None = param(
        "tcp://0.0.0.0:0",
        "Where this actor serves the weight chunks it holds to other actors (port 0: any free "
        "port; peers reach it at the address the broker sees it connect from); null serves none.",
    )
    weights_stall_s: float = param(
        10.0,
        "A weight source that sends no chunk for this long is given up for another.",
        above=0,
    )
    kv_on_weight_swap: Literal["reencode", "keep"] = param(
        "reencode",
        "torch engine, new weights mid-episode: reencode (drop the KV cache; every token's mu is "
        "exactly its version's) or keep (old keys/values stay; mu mixes versions).",
    )
    weight_noise_std: float = param(
        0.0,
        "Experiments only: an emulated engine mismatch. Every loaded weight w becomes "
        "w*(1 + e), e ~ N(0, std^2), fixed per version, so the actor samples from a policy a "
        "little off the learner's (as another dtype or kernel does) and reports that policy's "
        "log-probs as mu. Full weights only (not LoRA adapters); 0 is off.",
        minimum=0,
    )
    seed: int = param(0, "Base seed for environments and sampling.")


@dataclass
class OptimizerConfig:
    """The policy's AdamW; weight decay, warm-up and clipping apply to the critic's too."""

    lr: float = param(
        1e-3,
        "Policy learning rate (AdamW). The default suits the 0.1M-parameter tiny model only; a "
        "real model wants about 1e-6 to 2e-5 (docs/models.md).",
    )
    weight_decay: float = param(0.0, "AdamW weight decay.")
    warmup_steps: int = param(
        0,
        "Optimiser steps over which each model's learning rate rises linearly to its lr (0: none).",
        minimum=0,
    )
    grad_clip: float = param(1.0, "Gradient-norm clipping.")


@dataclass
class CriticConfig:
    """PPO's value function: which network, how it trains, where it starts."""

    kind: Literal["separate", "shared"] = param(
        "separate",
        "separate (own model + scalar head) or shared (value head on the policy trunk).",
    )
    lr: float = param(2e-3, "Learning rate (AdamW); the same caveat as learner.optimizer.lr.")
    lam: float = param(1.0, "GAE lambda of the critic's returns (1 = Monte-Carlo style targets).")
    value_clip: float = param(0.2, "Value-loss clip range.")
    value_coef: float = param(0.5, "Weight of the value loss with a shared critic.")
    updates: int = param(1, "Critic updates per policy update.", minimum=1)
    replay: int = param(
        1,
        "Batches a separate critic's updates draw from: the step's own and the last ones before "
        "it, newest first, one batch per update (with updates >= this, each is seen). A "
        "replayed batch keeps its returns and value-clip anchor from its own step.",
        minimum=1,
    )
    warmup_steps: int = param(
        0,
        "Steps that train only the critic before policy updates start (with warmup_ev: at most "
        "this many).",
    )
    warmup_ev: float = param(
        0.0,
        "Gate the critic's warm-up on its fit: policy updates start once the critic's explained "
        "variance on fresh batches (each scored before the critic trains on it), averaged over "
        "the last 5 steps, reaches this, or after warmup_steps (0: a fixed count).",
        minimum=0,
        maximum=1,
    )
    init: str | None = param(
        None,
        "A critic fitted to the starting policy's episodes (`asyncppo critic --out DIR`) that the "
        "separate critic starts from instead of a zero head (a resumed checkpoint's critic wins).",
    )


@dataclass
class LoraConfig:
    rank: int = param(
        0,
        "LoRA rank: train low-rank adapters (peft) on every trunk the learner trains, and publish "
        "only them; 0 trains every weight.",
        minimum=0,
    )
    alpha: float = param(
        16.0, "LoRA alpha: an adapter's update B·A is scaled by alpha / rank.", above=0
    )
    dropout: float = param(
        0.0,
        "Dropout on an adapter's input while training (> 0 makes pi_theta a noisy copy of pi_prox).",
        minimum=0,
        maximum=0.9,
    )
    target_modules: list[str] = param(
        ["all-linear"],
        "Modules that get adapters: peft names (q_proj, v_proj, ...) or all-linear (every linear "
        "layer of the trunk, not the output head).",
    )
    export: Literal["adapter", "merged"] = param(
        "adapter",
        "What learner.export_dir gets: the adapter (peft save_pretrained, with the base model's "
        "path) or the merged model (a plain Hugging Face checkpoint).",
    )


@dataclass
class LearnerConfig:
    broker: str = param("tcp://127.0.0.1:5555", "Broker endpoint the learner connects to.")
    broker_timeout_s: float = param(
        60.0,
        "Seconds the learner waits for a broker reply (a GET_BATCH: broker.batch_wait_s longer) "
        "before it presumes the broker restarted and retries.",
        above=0,
    )
    algorithm: Literal["ppo", "grpo"] = param(
        "ppo", "ppo (critic + GAE) or grpo (group-relative outcome advantage, no critic)."
    )
    batch_size: int = param(
        16, "Episodes per learner step (the broker's admission control uses it too).", minimum=1
    )
    publish_every: int = param(
        1, "Publish a new policy version every this many learner steps.", minimum=1
    )
    total_steps: int = param(20, "Learner steps to train; 0 means run until stopped.")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ppo_epochs: int = param(1, "Passes over each batch.", minimum=1)
    advantage_norm: Literal["none", "centre", "whiten"] = param(
        "none",
        "Policy advantages normalised over the global batch's action tokens: none, centre "
        "(subtract the mean) or whiten (also divide by the standard deviation). GRPO too.",
    )
    micro_batch_tokens: int = param(
        4096, "Tokens per micro-batch (gradient accumulation splits larger batches).", minimum=1
    )
    gamma: float = param(1.0, "Discount factor.")
    lam: float = param(0.95, "GAE lambda of the policy advantages.")
    adaptive_lambda_alpha: float = param(
        0.0,
        "If > 0, the policy lambda = 1 - 1/(alpha*L) per segment of L action tokens "
        "(length-adaptive); 0 is off.",
        minimum=0,
    )
    gae_unit: Literal["token", "turn"] = param(
        "token",
        "What one step of GAE is: token (every action token, the default) or turn (a turn is one "
        "action: its tokens share the advantage and return of the state the turn starts in).",
    )
    max_segment_steps: int = param(
        50,
        "GAE is cut every this many turns inside a segment, bootstrapped (dynamic truncation).",
        minimum=1,
    )
    cut_bootstrap: Literal["critic", "zero"] = param(
        "critic",
        "Value after a segment cut by compaction or an outside limit: critic (V at the next "
        "segment's first action, else V after the segment) or zero (every segment ends with 0, "
        "as slime does; for the ablation).",
    )
    correction: Literal["icepop", "tis", "none"] = param(
        "icepop", "Behavior-policy correction: icepop (mask), tis (truncate) or none."
    )
    proximal: Literal["recompute", "behavior"] = param(
        "recompute",
        "The trust region's anchor pi_old in the clipped ratio pi_theta/pi_old: recompute "
        "(decoupled PPO: pi_prox, the learner's log-probs just before the step) or behavior (the "
        "actors' mu: naive PPO, the baseline asynchronous training is measured against; needs "
        "correction none).",
    )
    icepop_low: float = param(0.5, "IcePop: keep tokens whose pi_prox/mu is at least this.")
    icepop_high: float = param(5.0, "IcePop: keep tokens whose pi_prox/mu is at most this.")
    tis_cap: float = param(2.0, "Truncated importance sampling cap C in min(w, C).")
    clip_start: float = param(
        0.2,
        "PPO clip epsilon at the first step; with total_steps 0 (no horizon) it is used throughout.",
    )
    clip_end: float = param(
        0.05,
        "PPO clip epsilon at total_steps (linear from clip_start); unused when total_steps is 0.",
    )
    kl_coef: float = param(0.0, "KL penalty to the frozen initial policy (0 = off, the default).")
    entropy_coef: float = param(
        0.0,
        "Entropy bonus: the policy loss minus this times the mean entropy of pi_theta over the "
        "action tokens (0 = off, the default).",
        minimum=0,
    )
    zero_stage: int = param(1, "DeepSpeed ZeRO stage 0-3.", minimum=0, maximum=3)
    checkpoint_dir: str | None = param(None, "Where checkpoints go; default <run dir>/checkpoints.")
    checkpoint_every: int = param(
        0, "Checkpoint every k steps (0: only at the end and on SIGTERM)."
    )
    export_dir: str | None = param(
        None, "Write a Hugging Face save_pretrained copy of the policy here at the end."
    )
    weight_chunk_bytes: int = param(
        1 << 20,
        "Chunk size of published weights: the unit a chain of actors pipelines (each hop adds "
        "one chunk's transfer time).",
        minimum=1,
    )
    publish_dtype: Literal["auto", "float32", "bfloat16"] = param(
        "auto",
        "Dtype of the published weights: auto (bfloat16 when the actors run bfloat16: "
        "actor.engine_dtype bfloat16 or the sglang engine; else float32), float32 or bfloat16. "
        "The learner keeps its own dtype for training.",
    )
    peer_bind: str = param(
        "tcp://0.0.0.0:0",
        "Where rank 0 serves the chunks of the versions it publishes (port 0: any free port; "
        "fetchers reach it at the address the broker sees it connect from).",
    )
    seed: int = param(0, "Seed of the learner.")
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SecurityConfig:
    curve: bool = param(False, "Encrypt and authenticate every socket with CurveZMQ.")
    server_secret_key_file: str | None = param(
        None, "Broker: its secret key file (from `asyncppo keys generate`)."
    )
    server_public_key_file: str | None = param(None, "Clients: the broker's public key file.")
    client_secret_key_file: str | None = param(None, "Actor/learner: its own secret key file.")
    authorized_keys_dir: str | None = param(
        None, "Broker: directory of the actors' public keys (they may connect and act as actors)."
    )
    learner_keys_dir: str | None = param(
        None,
        "Broker: directory of the public keys that may take the learner role (required with "
        "curve; an actor key can never publish weights or take batches).",
    )


@dataclass
class RunConfig:
    out_dir: str = param("runs/default", "Run directory: logs, checkpoints, summary.")
    num_actors: int = param(2, "Actors `asyncppo up` starts (change live with `asyncppo scale`).")
    max_wall_s: float = param(
        0.0, "Stop `asyncppo up` after this many seconds (0: when the learner finishes)."
    )
    metrics_host: str = param("127.0.0.1", "Address the /metrics and /healthz servers bind.")
    stall_timeout_s: float = param(
        120.0,
        "Liveness: /healthz answers 503 when a role's loop reports no progress for this long (the "
        "learner reports between micro-batches, weight chunks and checkpoint parts).",
        above=0,
    )
    metrics_base_port: int = param(
        0, "`up`: broker on this port, learner +1, actors +10..; 0 disables."
    )
    log_format: Literal["auto", "json", "console"] = param(
        "auto", "Logs: json, console or auto (console on a TTY)."
    )
    log_level: str = param("info", "Log level.")


@dataclass
class EvalConfig:
    episodes: int = param(
        96, "Held-out instances per evaluation (seeds disjoint from training).", minimum=1
    )
    every_versions: int = param(
        0,
        "`up`: an evaluator process scores every this-many-th policy version on the held-out set "
        "while training runs, and the final one (0: none).",
        minimum=0,
    )
    horizon_buckets: list = param(
        [5, 15, 50],
        "Upper edges of the horizon buckets (turns an instance needs) that the held-out set is "
        "stratified over and scored per: [5, 15, 50] is 1-5, 6-15, 16-50.",
    )
    sampling_seed: int | None = param(
        None,
        "Seed of the held-out episodes' sampling: turn t of the i-th instance samples from a "
        "generator seeded by (this, i, t), so every policy scored is dealt the same random draws "
        "(a paired comparison: versions and arms then differ by their policies, not their luck); "
        "null: fresh draws every evaluation.",
    )
    value_samples: int = param(
        16,
        "`eval --checkpoint`: plays of every held-out instance; a state's Monte-Carlo value is "
        "the mean return of the other plays through it (the critic's reference).",
        minimum=2,
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def _coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check ``value`` against a field annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    if origin is Literal:  # a choice: the type names the options
        options = typing.get_args(annotation)
        if value in options and isinstance(value, str):
            return value
        raise ConfigError(
            f"config key '{key}' ({source}): {value!r} is not one of {', '.join(options)}"
        )
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        annotation = next(a for a in options if a is not type(None))
    if annotation is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        # YAML 1.1 reads "1e-3" (no dot) as a string; where a float is expected, users mean a number.
        try:
            return float(value)
        except ValueError:
            pass
    expected = typing.get_origin(annotation) or annotation
    if expected is Any or (
        isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    ):
        return value
    raise ConfigError(
        f"config key '{key}' ({source}): expected {getattr(expected, '__name__', expected)}, "
        f"got {type(value).__name__} {value!r}"
    )


# Keys that moved, and where to (the learner's critic and optimizer groups, 2026-12): the old
# spelling is still read, with a warning that names the new one.
RENAMED = {
    "learner.lr": "learner.optimizer.lr",
    "learner.weight_decay": "learner.optimizer.weight_decay",
    "learner.lr_warmup_steps": "learner.optimizer.warmup_steps",
    "learner.grad_clip": "learner.optimizer.grad_clip",
    "learner.critic": "learner.critic.kind",  # the old key held the kind: separate or shared
    "learner.critic_lr": "learner.critic.lr",
    "learner.critic_lam": "learner.critic.lam",
    "learner.value_clip": "learner.critic.value_clip",
    "learner.value_coef": "learner.critic.value_coef",
    "learner.critic_updates": "learner.critic.updates",
    "learner.critic_replay": "learner.critic.replay",
    "learner.critic_warmup_steps": "learner.critic.warmup_steps",
    "learner.critic_warmup_ev": "learner.critic.warmup_ev",
    "learner.critic_init": "learner.critic.init",
}


def current_key(key: str, value: Any = None) -> str:
    """The spelling of ``key`` today (``value``: what it is set to, for ``learner.critic``,
    which names both the old key and the new group)."""
    new = RENAMED.get(key)
    return new if new is not None and not isinstance(value, dict) else key


def _merge(obj: Any, data: dict, prefix: str, source: str) -> None:
    hints = typing.get_type_hints(type(obj))
    known = {f.name: f for f in dataclasses.fields(obj)}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config section '{prefix or '<root>'}' ({source}): expected a mapping, got {data!r}"
        )
    for name, value in data.items():
        key = f"{prefix}{name}"
        new = current_key(key, value)
        if new != key:
            warnings.warn(
                f"config key '{key}' ({source}) is now '{new}'; the old spelling is still read",
                FutureWarning,
                stacklevel=2,
            )
            nested = value
            for part in reversed(new.removeprefix(prefix).split(".")):
                nested = {part: nested}
            _merge(obj, nested, prefix, source)
            continue
        if name not in known:
            raise ConfigError(
                f"unknown config key '{key}' ({source}); known keys here: {', '.join(sorted(known))}"
            )
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            _merge(current, value, f"{key}.", source)
        else:
            value = _coerce(value, hints[name], key, source)
            if value is not None:
                _check_bounds(value, known[name].metadata, key, source)
            setattr(obj, name, value)


def _check_actor(a: ActorConfig) -> None:
    """Sampling the learner can score; permits and slots that fit whole groups."""
    if a.top_p != 1.0:
        raise ConfigError(
            f"config key 'actor.top_p' must be 1.0, got {a.top_p!r}: the learner scores "
            "the full softmax at the sampling temperature and refuses nucleus-sampled segments "
            "(their pi_prox/mu would be shifted by the nucleus mass; docs/protocol.md section 10)"
        )
    if a.permits_per_request % a.group_size:
        raise ConfigError(
            f"config key 'actor.permits_per_request' ({a.permits_per_request}) must be a multiple of "
            f"actor.group_size ({a.group_size}) so a group is started together"
        )
    if a.max_inflight_episodes < a.group_size:
        raise ConfigError(
            f"config key 'actor.max_inflight_episodes' ({a.max_inflight_episodes}) must be "
            f">= actor.group_size ({a.group_size}): a group is played together"
        )


def _check_learner(lc: LearnerConfig) -> None:
    """IcePop's band must contain 1 (a token with no mismatch is kept); naive PPO has no behavior
    weight to correct with; an EV-gated critic
    warm-up needs a critic and a longest wait; a critic to start from or to replay batches to needs
    a separate critic; LoRA needs modules."""
    if not 0 < lc.icepop_low <= 1 <= lc.icepop_high:
        raise ConfigError(
            "config keys 'learner.icepop_low'/'learner.icepop_high' need 0 < low <= 1 <= high, "
            f"got [{lc.icepop_low}, {lc.icepop_high}]"
        )
    critic = lc.critic
    if critic.warmup_ev > 0 and (critic.warmup_steps < 1 or lc.algorithm != "ppo"):
        raise ConfigError(
            "config key 'learner.critic.warmup_ev' needs learner.algorithm=ppo (a critic) and "
            "learner.critic.warmup_steps >= 1 (the longest the policy waits), got "
            f"algorithm={lc.algorithm!r}, warmup_steps={critic.warmup_steps}"
        )
    if lc.proximal == "behavior" and lc.correction != "none":
        raise ConfigError(
            "config key 'learner.proximal' behavior (naive PPO: mu is pi_old, so w = pi_old/mu = 1) "
            f"needs learner.correction=none, got correction={lc.correction!r}"
        )
    own_critic = {"init": critic.init is not None, "replay": critic.replay > 1}
    for key in (k for k, used in own_critic.items() if used):
        if lc.algorithm != "ppo" or critic.kind != "separate":
            raise ConfigError(
                f"config key 'learner.critic.{key}' needs learner.algorithm=ppo and "
                "learner.critic.kind=separate (a critic of its own), got "
                f"algorithm={lc.algorithm!r}, kind={critic.kind!r}"
            )
    targets = lc.lora.target_modules
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(
            "config key 'learner.lora.target_modules' must be a non-empty list of module names, "
            f"got {targets!r}"
        )


def _check_eval(e: EvalConfig) -> None:
    """Horizon buckets: increasing positive integers."""
    edges = e.horizon_buckets
    if (
        not edges
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in edges)
        or any(a >= b for a, b in zip(edges[:-1], edges[1:], strict=True))
    ):
        raise ConfigError(
            f"config key 'eval.horizon_buckets' must be increasing positive integers, got {edges!r}"
        )


def _check_groups(cfg: Config) -> None:
    """Across roles: the learner's batch holds whole groups, and GRPO needs groups to compare."""
    if cfg.learner.algorithm == "grpo" and cfg.actor.group_size < 2:
        raise ConfigError("config key 'actor.group_size' must be >= 2 with learner.algorithm=grpo")
    if cfg.learner.batch_size % cfg.actor.group_size:
        raise ConfigError(
            f"config key 'learner.batch_size' ({cfg.learner.batch_size}) must be a multiple of actor.group_size"
        )


def validate(cfg: Config) -> Config:
    """Checks across keys, one per knob group (a key's own type and bounds are checked as it is
    read, by ``param``)."""
    _check_actor(cfg.actor)
    _check_learner(cfg.learner)
    _check_eval(cfg.eval)
    _check_groups(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", value parsed as YAML, so 3 is an int, 1e-3 a float, null None)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. learner.lr=1e-4")
    key, raw = text.split("=", 1)
    return key.strip(), (yaml.safe_load(raw) if raw.strip() else "")


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        _merge(cfg, data, "", str(p))
    for text in overrides:
        key, value = parse_override(text)
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        _merge(cfg, nested, "", f"--set {text}")
    return validate(cfg)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the dataclasses."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]

    def rows(group: Any, prefix: str) -> None:
        for f in dataclasses.fields(group):
            value = getattr(group, f.name)
            if dataclasses.is_dataclass(value):  # a nested group: learner.lora.rank
                rows(value, f"{prefix}{f.name}.")
            else:
                lines.append(f"| `{prefix}{f.name}` | `{value!r}` | {f.metadata['help']} |")

    rows(Config(), "")
    return "\n".join(lines) + "\n"

"""The torch engine: continuous batching over per-episode KV caches, exact per-token log-probs.

The learner's importance weights (π_prox / μ) are only as good as μ, so every sampled token is
reported with its log-probability under the distribution it was actually drawn from:
softmax(logits / T), restricted to the top-p nucleus and renormalised.

**Slots.** Every submitted key (an episode) owns one slot of a preallocated KV buffer (per layer
[slots, heads, columns, head_dim]). A slot's first ``cached`` columns hold the keys/values of the
first ``cached`` tokens of its context, in order, with no holes; a forward writes each row's new
keys/values at that row's own next columns, in place, and attends through a 4-D mask
(column c is visible to the row's query i when c <= cached + i). RoPE positions are the same
column numbers, so a row's log-probs equal an unpadded forward of its context. A released slot is
reused by the next key; the buffer grows (never per token) to the longest context in flight, so
memory is bounded by slots x (longest context + 1) columns.

**A step** (1) encodes, for rows whose context has more than one token not yet cached, all but
the last of them (one prefill forward over just those rows, each chunk padded on the right; pads
write to a scratch column), then (2) runs one decode forward over every slot, feeding each active
row its last token, and samples one token per active row.

**Prefix reuse.** A turn's context normally extends what its key has cached (the episode's
earlier turns and observations): only the new tokens are encoded. A context that does not
(compaction started a new segment from a summary, an agent rewrote its history) keeps only the
cached prefix it shares with the old one (causal attention: those keys/values are unchanged).

**Weight swaps** happen between steps. ``on_swap="reencode"`` (the default) drops every row's
cache so the new weights re-encode each context at the next step: every token's μ is exactly π
of the version it is tagged with. ``on_swap="keep"`` keeps the old keys/values and later tokens
attend to them: their μ mixes versions and no single model reproduces it (the learner's IcePop
mask then sees it as engine mismatch).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from actors.engines.base import Engine, Generation, SamplingParams, add_token, check_tokens
from common.lora import BaseWeights, apply_adapter, factor_pairs, fingerprint
from common.model import load_causal_lm, load_exported_state_dict, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SWAP_POLICIES = ("reencode", "keep")


def sampling_logprobs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:
    """log q over the vocabulary: q = softmax(logits / T) kept on the top-p nucleus, renormalised.

    `temperature` and `top_p` are scalars or one value per row ([rows, 1]). The nucleus is the
    smallest set of most likely tokens whose mass reaches top_p: a token is kept when the mass
    strictly before it (in descending order) is below top_p.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    top_p = torch.as_tensor(top_p, dtype=logp.dtype, device=logp.device)
    if bool((top_p >= 1.0).all()):
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_logp = sorted_logp.masked_fill(mass_before >= top_p, -math.inf)
    truncated = torch.full_like(logp, -math.inf).scatter(-1, order, sorted_logp)
    return torch.log_softmax(truncated, dim=-1)  # log q = log p − log Σ_nucleus p


def sample(logp: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row by inverse-CDF sampling, row i driven only by generators[i].

    Per-row streams make a row's draw independent of what else is in the batch.
    """
    uniforms = torch.stack([torch.rand((), generator=g, device=logp.device) for g in generators])
    cdf = logp.exp().cumsum(dim=-1)
    # first index whose cumulative mass exceeds u·total: zero-probability tokens are never chosen
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)
    return index.squeeze(-1).clamp(max=logp.shape[-1] - 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix: the cached keys/values still valid for `a`."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def prefill_groups(lengths: list[int], overhead: int = 128) -> list[list[int]]:
    """Split rows with `lengths` new tokens into forwards, each a run of the rows sorted longest
    first, minimising padded tokens plus `overhead` per forward (what one more forward costs,
    in tokens): dynamic programming over the split points. Rows with nothing new are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    best = [0.0] + [math.inf] * len(order)  # best[j]: cost of the first j rows
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):  # rows start..end-1 in one forward, padded to the first
            cost = best[start] + overhead + (end - start) * lengths[order[start]]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


@dataclass
class _Row:
    key: Hashable
    slot: int
    tokens: list[int]  # the context, then the tokens sampled in the current turn
    cached: int = 0  # tokens[:cached] have keys/values in the slot's first columns
    dropped: int = 0  # tokens[:dropped] had keys/values that a weight swap dropped
    params: SamplingParams | None = None  # the current turn's; None while the row is idle
    gen: Generation | None = None
    generator: torch.Generator | None = None


class _SlotLayer(DynamicLayer):
    """One layer's slice of the engine's KV buffer, as the model sees it for one forward: the
    new keys/values of batch row b go to slot ``plan.slots[b]`` at columns ``plan.columns[b]``,
    and attention reads the first ``plan.width`` columns of those slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: _Plan) -> None:
        super().__init__()
        self.keys, self.values, self.plan = keys, values, plan
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        rows = plan.slots.unsqueeze(-1)  # [batch, 1] against columns [batch, q]
        self.keys[rows, :, plan.columns] = key_states.transpose(1, 2)
        self.values[rows, :, plan.columns] = value_states.transpose(1, 2)
        if plan.leading:
            batch = len(plan.slots)
            return self.keys[:batch, :, : plan.width], self.values[:batch, :, : plan.width]
        return self.keys[plan.slots, :, : plan.width], self.values[plan.slots, :, : plan.width]

    def get_seq_length(self) -> int:
        return self.plan.width


@dataclass
class _Plan:
    slots: torch.Tensor  # [batch] slot of each batch row
    columns: torch.Tensor  # [batch, q] where each new token's keys/values are written
    width: int  # columns attention reads
    leading: bool  # the batch is slots 0..batch-1 in order: reads are views, not copies


class TorchEngine(Engine):
    """Any Hugging Face causal LM from a local path (CPU default), many episodes at once."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        on_swap: Literal["reencode", "keep"] = "reencode",
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is unknown; choose one of {sorted(DTYPES)}")
        if on_swap not in SWAP_POLICIES:
            raise ValueError(f"on_swap={on_swap!r} is unknown; choose one of {SWAP_POLICIES}")
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype=DTYPES[dtype], device=self.device).eval()
        self.model.requires_grad_(False)
        layers = DynamicCache(config=self.model.config).layers
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(
                f"TorchEngine keeps one plain KV cache per episode; the model at {model_path} "
                f"uses cache layers {kinds or 'none'} (sliding windows and hybrids are not supported)"
            )
        config = self.model.config
        self.num_layers = len(layers)
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = config.vocab_size
        self.context_limit = getattr(config, "max_position_embeddings", None)
        self.max_position = (self.context_limit or 2**62) - 1  # where padding's positions stop
        self.on_swap = on_swap
        self.version = 0
        # LoRA: the base model adapters apply to, and the base values of the weights they changed
        self.base = BaseWeights(lambda: fingerprint(self.model))
        self.adapted_base: dict[str, torch.Tensor] = {}
        self.slots: list[_Row | None] = []
        self.by_key: dict[Hashable, _Row] = {}
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, see _SlotLayer
        self.encoded_tokens = 0  # context tokens run through the model (prefill and decode)
        self.reencoded_tokens = 0  # of those, tokens encoded again after a swap dropped them
        self.forwards = self.steps = 0

    # ------------------------------------------------------------ the interface
    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Swap in an exported state dict (tied tensors once) and adopt its version."""
        load_exported_state_dict(self.model, tensors)
        self.base.replaced, self.adapted_base = True, {}
        self._swapped(version)

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], base: str) -> None:
        """Merge a LoRA adapter into the weights: W = W_base + B·A for every adapted W, from a
        kept copy of the base values of just those weights (docs/architecture.md, "LoRA").

        Merged rather than run beside the weights: a merge costs one small matmul per adapted
        weight per version, an unmerged adapter two extra matmuls per adapted layer per token
        (bench/lora.py measures both)."""
        self.base.check(version, base)
        apply_adapter(self.model, factor_pairs(tensors), self.adapted_base)
        self._swapped(version)

    def _swapped(self, version: int) -> None:
        self.version = version
        if self.on_swap == "reencode":
            for row in self.by_key.values():
                row.dropped, row.cached = max(row.dropped, row.cached), 0

    def submit(self, key: Hashable, context: list[int], params: SamplingParams) -> None:
        """Start a turn; the key's cache is reused for the prefix `context` shares with it."""
        if not isinstance(context, list) or not context:
            raise ValueError("context must be a non-empty list of token ids")
        if (
            self.context_limit is not None
            and len(context) + params.max_new_tokens > self.context_limit
        ):
            raise ValueError(
                f"context ({len(context)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the model's max_position_embeddings ({self.context_limit})"
            )
        row = self.by_key.get(key)
        if row is not None and row.gen is not None:
            raise ValueError(f"key {key!r} already has a turn in progress")
        known = 0
        if row is not None:
            known = row.cached
            if context[:known] != row.tokens[:known]:  # compaction, a rewritten history
                known = common_prefix(context, row.tokens[:known])
            if context[: row.dropped] != row.tokens[: row.dropped]:
                row.dropped = common_prefix(context, row.tokens[: row.dropped])
            known = min(known, len(context) - 1)  # the last token is fed to sample the next
        check_tokens(context[known:], self.vocab_size, "context")  # the rest was checked before
        if row is None:
            free = next((i for i, held in enumerate(self.slots) if held is None), len(self.slots))
            row = _Row(key, free, [])
            if free == len(self.slots):
                self.slots.append(row)
            self.slots[free] = self.by_key[key] = row
        row.cached = known
        seed = secrets.randbits(62) if params.seed is None else params.seed
        row.tokens = list(context)
        row.params = params
        row.gen = Generation([], [], [], "length", params.temperature, params.top_p)
        row.generator = torch.Generator(device=self.device).manual_seed(seed)

    def release(self, key: Hashable) -> None:
        row = self.by_key.pop(key, None)
        if row is not None:
            self.slots[row.slot] = None
            while self.slots and self.slots[-1] is None:
                self.slots.pop()

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Generation]]:
        """Encode new context tokens, then sample one token for every turn in progress."""
        active = [row for row in self.slots if row is not None and row.gen is not None]
        if not active:
            return []
        self._reserve(len(self.slots), max(len(row.tokens) for row in active) + 1)
        self.steps += 1
        self._prefill([row for row in active if len(row.tokens) - row.cached > 1])
        logits = self._decode(active)
        return self._sample(active, logits)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV buffer (every slot, every column reserved)."""
        return sum(2 * k.numel() * k.element_size() for k, _ in self.buffers)

    # ------------------------------------------------------------ the cache
    def _reserve(self, slots: int, columns: int) -> None:
        """Grow the buffer to at least `slots` x `columns` (the last column is scratch, where
        padding writes); growth doubles, so it happens a handful of times per run."""
        have_slots, have_columns = self.buffers[0][0].shape[::2] if self.buffers else (0, 0)
        if slots <= have_slots and columns <= have_columns:
            return
        slots = max(slots, 2 * have_slots) if slots > have_slots else have_slots
        if columns > have_columns:
            limit = math.inf if self.context_limit is None else self.context_limit + 1
            columns = max(columns, min(2 * have_columns, limit))
        else:
            columns = have_columns
        grown = []
        for layer in range(self.num_layers):
            pair = []
            for part in range(2):
                new = torch.zeros(
                    (slots, self.kv_heads, columns, self.head_dim),
                    dtype=self.model.dtype,
                    device=self.device,
                )
                if self.buffers:
                    new[:have_slots, :, :have_columns] = self.buffers[layer][part]
                pair.append(new)
            grown.append((pair[0], pair[1]))
        self.buffers = grown

    def _forward(
        self, input_ids: torch.Tensor, cached: torch.Tensor, valid: torch.Tensor, slots: list[int]
    ) -> torch.Tensor:
        """One forward of `input_ids` ([batch, q]) on top of each row's `cached` columns; only
        `valid` ([batch, q]) tokens are kept (the rest write to scratch). Last-position logits."""
        batch, q = input_ids.shape
        scratch = self.buffers[0][0].shape[2] - 1
        offsets = torch.arange(q).unsqueeze(0)
        positions = cached.unsqueeze(-1) + offsets  # [batch, q]: column = RoPE position
        width = int((cached + valid.sum(-1)).max().clamp(min=1))
        plan = _Plan(
            slots=torch.tensor(slots, dtype=torch.long, device=self.device),
            columns=torch.where(valid, positions, scratch).to(self.device),
            width=width,
            leading=slots == list(range(batch)),
        )
        visible = torch.arange(width).view(1, 1, width) <= positions.unsqueeze(-1)
        mask = torch.zeros(visible.shape, dtype=self.model.dtype).masked_fill(
            ~visible, torch.finfo(self.model.dtype).min
        )
        cache = DynamicCache(config=self.model.config)
        cache.layers = [_SlotLayer(k, v, plan) for k, v in self.buffers]
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.unsqueeze(1).to(self.device),
            position_ids=positions.clamp(max=self.max_position).to(self.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.forwards += 1
        self.encoded_tokens += int(valid.sum())
        return out.logits[:, -1]

    def _prefill(self, rows: list[_Row]) -> None:
        """Encode all but the last uncached token of `rows`, in groups of similar length (each
        chunk padded on the right to its group's longest)."""
        for group in prefill_groups([len(row.tokens) - row.cached - 1 for row in rows]):
            members = [rows[i] for i in group]
            new = [row.tokens[row.cached : -1] for row in members]
            width = len(new[0])  # groups are sorted longest first
            input_ids = torch.full((len(members), width), self.tokenizer.pad_token_id)
            for j, tokens in enumerate(new):
                input_ids[j, : len(tokens)] = torch.tensor(tokens)
            lengths = torch.tensor([len(tokens) for tokens in new])
            valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(-1)
            cached = torch.tensor([row.cached for row in members])
            self._forward(input_ids, cached, valid, [row.slot for row in members])
            for row, tokens in zip(members, new, strict=True):
                self._encoded(row, len(tokens))

    def _decode(self, active: list[_Row]) -> torch.Tensor:
        """Feed every active row its last token (free and idle slots a pad that writes to
        scratch), in one forward over all slots; the logits of the active rows."""
        slots = len(self.slots)
        input_ids = torch.full((slots, 1), self.tokenizer.pad_token_id, dtype=torch.long)
        valid = torch.zeros((slots, 1), dtype=torch.bool)
        cached = torch.zeros(slots, dtype=torch.long)
        for row in self.slots:
            if row is not None:
                cached[row.slot] = row.cached
        index = torch.tensor([row.slot for row in active])
        input_ids[index, 0] = torch.tensor([row.tokens[-1] for row in active])
        valid[index] = True
        logits = self._forward(input_ids, cached, valid, list(range(slots)))
        for row in active:
            self._encoded(row, 1)
        return logits[index.to(self.device)]

    def _encoded(self, row: _Row, n: int) -> None:
        """`n` more of the row's tokens are cached; count those a weight swap had dropped."""
        self.reencoded_tokens += max(0, min(row.dropped, row.cached + n) - row.cached)
        row.cached += n
        if row.cached >= row.dropped:
            row.dropped = 0

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> list[tuple[Hashable, Generation]]:
        """One token per active row under its own temperature, top-p and random stream."""
        temperature = torch.tensor([[row.params.temperature] for row in rows])
        top_p = torch.tensor([[row.params.top_p] for row in rows])
        logp = sampling_logprobs(logits, temperature.to(logits.device), top_p.to(logits.device))
        tokens = sample(logp, [row.generator for row in rows])
        token_logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        finished = []
        for row, token, logprob in zip(rows, tokens.tolist(), token_logprobs, strict=True):
            row.tokens.append(token)
            if add_token(row.gen, token, logprob, self.version, self.tokenizer, row.params):
                finished.append((row.key, row.gen))
                row.gen = row.params = row.generator = None
        return finished

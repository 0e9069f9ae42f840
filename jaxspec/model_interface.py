"""The model interface drafters use, declared as Protocols.

Every family module that `jaxspec.registry` builds implements `CausalLM`; families with MTP layers also implement
`MtpModel`; a Llama/Qwen2 with a draft vocabulary implements `DraftVocabModel`; a Gemma target implements
`SharedKvModel` (what the Gemma 4 drafter reads); the Gemma 4 drafter itself is a `DrafterModel`, which has no
cache and is not a `CausalLM`; a DFlash drafter is a `BlockDrafterModel`, which drafts a block from the target's
tapped hidden states and is not a `CausalLM` either. The core never imports `models/`: these Protocols are the only place the surface is
written down, and `tests/models/test_model_interface.py` checks each family against them, parameter names included.

Dimension letters: B batch, T query length, S cache length, D model width, V vocabulary (V' a draft vocabulary).
A cache is the family's own pytree (`KVCache`, `MLACache` for DeepSeek-V3's latent attention, `GemmaCache`): one
position-indexed entry per layer, so writing at `positions` and rolling back by a length works the same for all.

`runtime_checkable` isinstance checks only that the members exist; the test checks the signatures.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

Cache = Any  # KVCache | MLACache | GemmaCache: the family's position-indexed cache pytree


@runtime_checkable
class CausalLM(Protocol):
    """A decoder every strategy can run as target or assistant: whole forwards, or pieces of one.

    `model(tokens, positions, cache)` equals `logits(final_hidden(run_layers(embed_tokens(tokens), ...)))`, so a
    drafter may run part of the network (early exit: layers [0, E) to draft, [E, L) to verify) and stay exact.
    """

    cfg: Any  # the family's frozen config (reads: vocab_size, hidden_size, num_layers, tie_word_embeddings, ...)
    dtype: Any  # the param and activation dtype (float32 on CPU, bfloat16 on accelerators)
    embed: Any  # nnx.Param [V, D], the token embedding (jaxspec/head.py copies it as the tied head [D, V])
    # Families whose forward takes `tree=` also have a class attribute `tree_attention = True`, read before compiling
    # so that `tree=` on another family is refused by name up front (not a member here: most families lack it).
    # Families with `loops_wide_forwards = True` (Llama) run forwards of two or more positions a row as a loop over
    # `layer_stack`, an attribute the decode loop binds on a CPU (jaxspec/layer_stack.py); without one, unrolled.
    # Llama's also has `looped_taps`, which runs a forward tapped for a block drafter's features as one such loop
    # (`jaxspec.strategies.base.run_tapped_layers` asks it first; other families run a segment per tap).

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache,
                 head: jax.Array | None = None, tree: Any = None) -> tuple[jax.Array, jax.Array, Cache]:
        """tokens [B, T] int32, positions [B, T] int32 -> logits [B, T, V] float32, hidden [B, T, D], cache.

        `hidden` is the final-normed last hidden state (what an LM head or an MTP layer reads). Entries are written
        to the cache at `positions`; attention sees each row's entries at positions <= the query's. `head`: a [D, V]
        head to use instead of the model's own (`jaxspec.head.verify_head`). `tree`: a `jaxspec.tree.TreeBlock`, for
        a block shaped as a draft tree (entries written at its slots, `positions` their rope positions, attention
        to the committed entries and each entry's ancestors); families without tree attention raise
        NotImplementedError for one."""
        ...

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int32 -> the input of `run_layers` from layer 0, [B, T, D] (a Gemma 4 with per-layer
        inputs packs them after the embedding: [B, T, D + L * P]; see models/gemma.py)."""
        ...

    def run_layers(self, x: jax.Array, positions: jax.Array, cache: Cache, start: int = 0,
                   stop: int | None = None, tree: Any = None) -> tuple[jax.Array, Cache]:
        """Decoder layers [start, stop) (stop None: to the last): x [B, T, D], positions [B, T] -> x [B, T, D], cache
        with those layers' entries written at `positions` (or a `tree`'s slots, as for `__call__`). Not
        final-normed."""
        ...

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The final norm: [B, T, D] -> [B, T, D]."""
        ...

    def logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """LM head over final-normed hidden states: [..., D] -> [..., V] float32 (soft-capped where the family
        caps). `head`: a [D, V] head to use instead of the model's own."""
        ...

    def init_cache(self, batch: int, size: int) -> Cache:
        """An empty cache for B = `batch` rows of S = `size` positions (S = max_len + K + 1 in the decode loop)."""
        ...


@runtime_checkable
class MtpModel(CausalLM, Protocol):
    """A `CausalLM` that can carry DeepSeek-style MTP layers (Llama/Qwen2, DeepSeek-V3, GLM-4.5); the MTP strategy
    and `jaxspec.train` drive them. `num_mtp_layers` may be 0 (config.json without `num_nextn_predict_layers`)."""

    @property
    def num_mtp_layers(self) -> int:
        """How many MTP layers the checkpoint has."""
        ...

    def init_mtp_cache(self, batch: int, size: int, depths: int | None = None) -> Cache:
        """One position-indexed cache per MTP depth, stacked on the leading axis: `depths` (default: one per layer)
        of B = `batch` rows and S = `size` positions. Raises when the model has no MTP layers."""
        ...

    def mtp_step(self, depth: int, tokens: jax.Array, prev_hidden: jax.Array, positions: jax.Array,
                 mtp_cache: Cache, layer: int | None = None) -> tuple[jax.Array, jax.Array, Cache]:
        """One MTP depth over T entries: tokens [B, T] int32, prev_hidden [B, T, D], positions [B, T]
        -> normed_out [B, T, D], logits [B, T, V] float32, mtp_cache.

        Entry j embeds `tokens[:, j]` at position i = `positions[:, j]` and reads `prev_hidden[:, j]`, the state at
        i-1 (depth 0: the main model's final-normed hidden; depth k: depth k-1's `normed_out`); its logits predict
        the token at i+1. `layer` (default `depth`) picks the weights, so depths past the last layer reuse it."""
        ...


@runtime_checkable
class DraftVocabModel(MtpModel, Protocol):
    """An `MtpModel` whose drafts come from a head over V' <= V token ids (Llama/Qwen2 with `cfg.draft_vocab_size > 0`;
    only such a module has `draft_vocab`, so only it passes isinstance)."""

    draft_vocab: Any  # [V'] int32 token ids MTP drafts may propose

    def draft_head(self) -> jax.Array:
        """[V', D]: the head's rows for the draft vocabulary (gathered once per call, not per draft step)."""
        ...

    def draft_vocab_logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """[..., D] -> [..., V'] float32: logits over the draft vocabulary only. `head`: `draft_head()`, if
        gathered already."""
        ...

    def draft_logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """[..., D] -> [..., V] float32: the draft vocabulary's logits, -inf for every other token (q is zero
        outside V', which keeps speculative sampling exact)."""
        ...


@runtime_checkable
class SharedKvModel(CausalLM, Protocol):
    """A target whose cache a Gemma 4 drafter reads (the Gemma family; only Gemma 4 with `num_kv_shared_layers > 0`
    has store layers, which `jaxspec.strategies.gemma4_drafter.check_pair` checks)."""

    def input_embeddings(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int32 -> [B, T, D]: the token embedding with its sqrt(D) scale (HF
        `get_input_embeddings()(tokens)`), without Gemma 4's packed per-layer inputs."""
        ...

    def shared_kv(self, cache: Cache, layer_type: str) -> tuple[jax.Array, jax.Array]:
        """Keys and values of `layer_type`'s store layer ("sliding_attention" or "full_attention"):
        ([B, kv_heads, S, head_dim], [B, kv_heads, S, head_dim]) (the KV cache's layout, jaxspec/cache.py),
        position-indexed, already normed and rotated."""
        ...


@runtime_checkable
class DrafterModel(Protocol):
    """The Gemma 4 MTP drafter (`gemma4_assistant`): no cache of its own; it attends to the target's store-layer
    keys and values and reads the target's embedding and hidden state (D_t: the target's width)."""

    cfg: Any  # Gemma4AssistantConfig (reads: layer_types, vocab_size, backbone_hidden_size)
    dtype: Any  # read through `jaxspec.loading.Model.dtype`, as for any module

    def __call__(self, inputs: jax.Array, positions: jax.Array,
                 shared_kv: dict[str, tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
        """inputs [B, T, 2 D_t] (the target's scaled embedding of the token, then a hidden state), positions [B, T],
        shared_kv {layer type: (k, v) as `SharedKvModel.shared_kv` gives them} -> logits [B, T, V] float32, next hidden
        [B, T, D_t]. Keys at or past a query's position are never read."""
        ...


@runtime_checkable
class BlockDrafterModel(Protocol):
    """A DFlash block drafter (`jaxspec.models.dflash`, either public layout): no embedding or head of its own; its
    context is n tapped target layers' hidden states (n = len(cfg.target_layer_ids), D the drafter's width, equal to
    the target's), kept as keys and values in its own position-indexed cache at committed positions only, so
    rollback is a length. One forward over [bonus, mask x (W-1)] drafts W - 1 tokens (W = cfg.block_size)."""

    cfg: Any  # DFlashConfig (reads: block_size, mask_token_id, target_layer_ids, hidden_size, input_embedding_scale)
    dtype: Any

    def project_context(self, target_hidden: jax.Array) -> jax.Array:
        """target_hidden [B, T, n*D] (the tapped layers' outputs concatenated in target_layer_ids order)
        -> context [B, T, D]."""
        ...

    def init_cache(self, batch: int, size: int) -> Cache:
        """An empty context cache for B = `batch` rows of S = `size` positions."""
        ...

    def write_context(self, context: jax.Array, positions: jax.Array, cache: Cache) -> Cache:
        """context [B, T, D] at positions [B, T] -> the cache with every layer's keys and values written there."""
        ...

    def draft_block(self, block_embeddings: jax.Array, positions: jax.Array, cache: Cache,
                    lengths: jax.Array) -> jax.Array:
        """block_embeddings [B, W, D] (the target's embedding of the block), positions [B, W], cache, lengths [B]
        -> final-normed hidden [B, W, D]: entry j >= 1 drafts the token at positions[:, j]. Cache entries at or past
        a row's length are never read; the block attends to itself bidirectionally (within each layer's mask)."""
        ...

    def logits(self, hidden: jax.Array, head: jax.Array) -> jax.Array:
        """Draft logits [..., V] float32 from final-normed hidden [..., D] and the target's [D, V] head."""
        ...

    def draft_vocab_logits(self, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        """For a drafter with a draft vocabulary (`vocab_ids` [V'], only then): draft logits [..., V'] float32 from
        the target head's rows for those ids [V', D], in `vocab_ids` order."""
        ...

    def block_tokens(self, bonus: jax.Array) -> jax.Array:
        """bonus [B] -> the block's tokens [B, W]: the bonus token, then W - 1 mask tokens."""
        ...


@runtime_checkable
class Eagle3HeadModel(Protocol):
    """An EAGLE-3 draft head (`jaxspec.models.eagle3`): one decoder layer over [embedding; feature] (2 D wide), its
    feature `fc` over three tapped target layers for committed entries and the previous entry's output for drafts,
    its own position-indexed cache and a head over a draft vocabulary mapped into the target's (`vocab_ids`)."""

    cfg: Any  # Eagle3Config (reads: hidden_size, own_embedding, vocab_size, layer_ids(n), check_target)
    dtype: Any

    def project_features(self, taps: jax.Array) -> jax.Array:
        """taps [B, T, 3 D_t] (the tapped layers' outputs in the head's layer order) -> g [B, T, D]."""
        ...

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> [B, T, D] from the head's own table (only heads with `cfg.own_embedding` have one)."""
        ...

    def init_cache(self, batch: int, size: int) -> Cache:
        """An empty cache of the head's entries for B = `batch` rows of S = `size` positions."""
        ...

    def step(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, cache: Cache
             ) -> tuple[jax.Array, Cache]:
        """Entries at positions [B, T] from embeds and hidden [B, T, D] (g, or a previous entry's output) -> (their
        outputs [B, T, D], the cache with them written). Each query sees entries at positions <= its own."""
        ...

    def logits(self, outputs: jax.Array) -> jax.Array:
        """Draft-vocabulary logits [..., V'] float32 from entry outputs [..., D]."""
        ...

    def target_logits(self, outputs: jax.Array) -> jax.Array:
        """The same over the target's vocabulary [..., V]: -inf outside the draft vocabulary."""
        ...

"""History-dependent logits processors, exact for every position of a verify block.

A verify block scores W positions at once: position j predicts the token after prompt, committed tokens and drafts
d_1..d_j. A processor that depends on history (repetition penalty, no-repeat n-grams, bad word sequences,
min_new_tokens) must see exactly that prefix at position j, or greedy identity and exact sampling break. Here every
processor reads the row's token buffer, where this round's drafts are already written after the committed tokens,
and a per-position prefix length `start + j`; a drafter scoring one position at a time passes W = 1.

HF's order and semantics (`transformers.generation.logits_process`): repetition penalty, no-repeat n-gram, bad
words, min_new_tokens, suppressed tokens. The removals are -inf masks and commute; only the penalty, which rescales,
comes first. jaxspec's history is each row's own prompt and output; HF's is the padded `input_ids`, so in a
left-padded batch HF also penalises the pad token and matches n-grams across padding (batch 1 is identical).

Every setting is a run-time array (`Processing`): changing a penalty reuses the compiled loop. Branches that are off
cost nothing at run time (`lax.cond`). What is static is only shapes: the number and length of bad word sequences
(padded to buckets; up to 4 sequences of up to 5 tokens need no recompile) and the largest n-gram size the compiled loop can check (`ngram_slots`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .sampling import NEG_INF, warp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Processing:
    """Run-time logits settings: every field an array, so new values never recompile."""

    temperature: jax.Array  # [] float32
    top_k: jax.Array  # [] int32, 0: off
    top_p: jax.Array  # [] float32, 1: off
    min_p: jax.Array  # [] float32, 0: off
    repetition_penalty: jax.Array  # [] float32, 1: off
    no_repeat_ngram_size: jax.Array  # [] int32, 0: off
    min_new_tokens: jax.Array  # [] int32, 0: off
    suppressed: jax.Array  # [V] bool: suppress_tokens and one-token bad words, always removed
    bad_prefixes: jax.Array  # [N, P] int32: multi-token bad words without their last token, right-aligned, -1 pad
    bad_last: jax.Array  # [N] int32: the token each bad word sequence bans after its prefix (-1: empty slot)
    eos: jax.Array  # [E] int32: tokens min_new_tokens holds back (-1 pad)


@dataclasses.dataclass(frozen=True)
class History:
    """What position j of a scored block has seen: tokens[b, :start[b] + j]."""

    tokens: jax.Array  # [B, S] committed tokens, then this block's drafts
    start: jax.Array  # [B] prefix length at position 0 of the block
    prompt_lengths: jax.Array  # [B]

    def prefix_lengths(self, width: int) -> jax.Array:  # [B, W]
        return self.start[:, None] + jnp.arange(width)[None, :]


def process(logits: jax.Array, history: History, p: Processing, do_sample: bool, ngram_slots: int) -> jax.Array:
    """HF's processors, then (when sampling) its warpers: [B, W, V] raw logits -> [B, W, V] processed float32."""
    logits = logits.astype(jnp.float32)
    width, vocab = logits.shape[1], logits.shape[2]
    logits = jax.lax.cond(p.repetition_penalty != 1.0,
                          lambda x: _repetition_penalty(x, history, p.repetition_penalty), lambda x: x, logits)
    banned = jnp.broadcast_to(p.suppressed, logits.shape)
    if ngram_slots:
        banned = banned | jax.lax.cond(
            p.no_repeat_ngram_size > 0,
            lambda: _repeated_ngram_bans(history, p.no_repeat_ngram_size, width, vocab, ngram_slots),
            lambda: jnp.zeros(logits.shape, bool))
    banned = banned | jax.lax.cond(jnp.any(p.bad_last >= 0), lambda: _bad_word_bans(history, p, width, vocab),
                                   lambda: jnp.zeros(logits.shape, bool))
    generated = history.prefix_lengths(width) - history.prompt_lengths[:, None]  # [B, W] new tokens before j
    holding_eos = (generated < p.min_new_tokens)[..., None] & _one_hot_any(p.eos, vocab)  # [B, W, V]
    logits = jnp.where(banned | holding_eos, NEG_INF, logits)
    if do_sample:
        logits = warp(logits, p.temperature, p.top_k, p.top_p, p.min_p)
    return logits


def _one_hot_any(ids: jax.Array, vocab: int) -> jax.Array:
    """[..., N] ids (-1: none) -> [..., V] bool, True at each id."""
    return jnp.zeros(ids.shape[:-1] + (vocab + 1,), bool).at[..., jnp.where(ids < 0, vocab, ids)].set(True)[..., :vocab]


def seen_tokens(history: History, width: int, vocab: int) -> jax.Array:
    """[B, W, V] bool: whether each token occurs in the prefix of position j."""
    tokens, start = history.tokens, history.start
    batch, size = tokens.shape
    index = jnp.arange(size)[None, :]
    rows = jnp.arange(batch)[:, None]
    committed = jnp.zeros((batch, vocab + 1), bool).at[rows, jnp.where(index < start[:, None], tokens, vocab)].set(True)
    # The block's own tokens: position j has also seen the j tokens at start .. start + j - 1.
    block_index = jnp.clip(start[:, None] + jnp.arange(width - 1)[None, :], 0, size - 1)  # [B, W-1]
    block = jax.nn.one_hot(jnp.take_along_axis(tokens, block_index, axis=1), vocab, dtype=jnp.int32)  # [B, W-1, V]
    so_far = jnp.cumsum(jnp.concatenate([jnp.zeros((batch, 1, vocab), jnp.int32), block], axis=1), axis=1) > 0
    return committed[:, None, :vocab] | so_far


def _repetition_penalty(logits: jax.Array, history: History, penalty: jax.Array) -> jax.Array:
    """HF's RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the penalty if positive, else
    multiplied by it."""
    seen = seen_tokens(history, logits.shape[1], logits.shape[2])
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def _repeated_ngram_bans(history: History, n: jax.Array, width: int, vocab: int, slots: int) -> jax.Array:
    """HF's NoRepeatNGramLogitsProcessor: ban every token that would complete an n-gram already in the prefix.

    At prefix length P >= n: each window t[i .. i+n-1] with i <= P - n whose first n-1 tokens equal the prefix's
    last n-1 tokens bans t[i+n-1]. `slots` is the static upper bound of n - 1 that the loop was compiled for.
    """
    tokens = history.tokens
    batch, size = tokens.shape
    prefix = history.prefix_lengths(width)  # [B, W]
    starts = jnp.arange(size)  # window starts i
    padded = jnp.concatenate([tokens, jnp.full((batch, slots + 1), -1, tokens.dtype)], axis=1)  # [B, S + slots + 1]
    matches = (starts[None, None, :] <= (prefix - n)[..., None]) & (prefix >= n)[..., None]  # [B, W, S]
    for m in range(slots):
        suffix_token = jnp.take_along_axis(tokens, jnp.clip(prefix - n + 1 + m, 0, size - 1), axis=1)  # [B, W]
        window_token = padded[:, m: m + size]  # [B, S]: t[i + m]
        same = window_token[:, None, :] == suffix_token[..., None]
        matches &= same | (m >= n - 1)
    completing = jnp.take_along_axis(padded, jnp.broadcast_to(jnp.clip(starts + n - 1, 0, size), (batch, size)), axis=1)
    completing = jnp.where(matches, completing[:, None, :], vocab)  # [B, W, S]; vocab: no ban
    rows = jnp.arange(batch)[:, None, None]
    positions = jnp.arange(width)[None, :, None]
    return jnp.zeros((batch, width, vocab + 1), bool).at[rows, positions, completing].set(True)[..., :vocab]


def _bad_word_bans(history: History, p: Processing, width: int, vocab: int) -> jax.Array:
    """HF's NoBadWordsLogitsProcessor for sequences of 2+ tokens: after a prefix that ends with a bad word's first
    tokens, its last token is banned."""
    tokens = history.tokens
    size = tokens.shape[1]
    prefix = history.prefix_lengths(width)  # [B, W]
    slots = p.bad_prefixes.shape[1]
    # The last `slots` tokens of each position's prefix, aligned with the right-aligned bad prefixes.
    index = prefix[..., None] - slots + jnp.arange(slots)  # [B, W, P]
    recent = jnp.where(index >= 0, jnp.take_along_axis(tokens[:, None, :], jnp.clip(index, 0, size - 1), axis=2), -2)
    wanted = p.bad_prefixes[None, None]  # [1, 1, N, P]
    hit = jnp.all((wanted == -1) | (recent[:, :, None, :] == wanted), axis=-1) & (p.bad_last >= 0)  # [B, W, N]
    banned_token = jnp.where(hit, p.bad_last, vocab)  # [B, W, N]
    batch = tokens.shape[0]
    rows = jnp.arange(batch)[:, None, None]
    positions = jnp.arange(width)[None, :, None]
    return jnp.zeros((batch, width, vocab + 1), bool).at[rows, positions, banned_token].set(True)[..., :vocab]

"""Training data for DFlash drafters: token rows with the frozen target's tapped hidden states, cached once.

A DFlash drafter reads, at every committed position, the outputs of the target's decoder layers `target_layer_ids`
(concatenated in that order; the last layer's entry final-normed, as transformers' `hidden_states[-1]` is and as
the decode strategy hands it over, jaxspec/strategies/dflash.py), and it learns the target's next-token
distribution, the LM head over the target's final-normed state. Both come from one teacher-forced forward of the
target per row, here, and are cached on disk (`data.save` / `data.load`); training never runs the target's layers.

Rows are the target's own greedy answers (`data.greedy_generations`: the sequences decoding meets, where a draft is
accepted exactly when it is the row's next token) and, optionally, windows of text (`data.stdlib_windows`).

Memory: a position holds n*D + D bfloat16 values (n tapped layers of width D, and the final-normed state) and one
int32 token, 2*(n + 1)*D + 4 bytes: with SmolLM2-135M's D = 576 and n = 3, 4.6 kB, so 2,560 rows of 256 positions
take 3.0 GB (`corpus_bytes`). The arrays load memory-mapped, so training pages in only the rows each batch reads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.strategies.base import run_tapped_layers

from .data import HIDDEN_DTYPE, greedy_generations, token_frequencies


@dataclasses.dataclass
class BlockCorpus:
    """N rows of T positions. Row b holds tokens[b, :lengths[b]]; positions before starts[b] are its prompt (0 for
    text windows). At position i: features[b, i] is the target's tapped layers' outputs after reading
    tokens[b, :i+1] (the drafter's context input, in `layer_ids` order) and hidden[b, i] its final-normed state
    there, whose LM head gives the target's distribution of the token at i+1."""

    tokens: np.ndarray  # [N, T] int32
    lengths: np.ndarray  # [N] int32
    starts: np.ndarray  # [N] int32
    hidden: np.ndarray  # [N, T, D] HIDDEN_DTYPE
    features: np.ndarray  # [N, T, n*D] HIDDEN_DTYPE
    layer_ids: np.ndarray  # [n] int32: the target layers of `features`, in order (not a per-row array)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def take(self, rows) -> BlockCorpus:
        return BlockCorpus(self.tokens[rows], self.lengths[rows], self.starts[rows], self.hidden[rows],
                           self.features[rows], self.layer_ids)

    def anchor_counts(self) -> np.ndarray:
        """[N] how many positions of each row a block can be anchored at (`anchor_bounds`)."""
        low, high = anchor_bounds(self.starts, self.lengths)
        return np.maximum(high - low + 1, 0)


def anchor_bounds(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first and last position a block may be anchored at in each row, inclusive: [N], [N].

    A decoding round's block starts at the newest committed token (the bonus), and its context is every position
    before it. The first round after a prompt of length s anchors at s (the token the prefill produced) with the
    prompt as context; a text window (s = 0) needs one position of context, so it starts at 1. The block must
    predict at least one token of the row, so the last anchor is length - 2."""
    return np.maximum(starts, 1), lengths - 2


def rarest_token(corpus: BlockCorpus, vocab_size: int) -> int:
    """The largest of the ids that occur least often among the corpus's tokens (never, for a large vocabulary): a
    mask token for a target whose vocabulary has none. The drafter reads its embedding at every mask position, and
    a token the target's rows never use is one whose meaning no row leans on."""
    counts = token_frequencies(corpus, vocab_size)
    return int(np.flatnonzero(counts == counts.min())[-1])


def corpus_bytes(rows: int, seq_len: int, hidden_size: int, num_layer_ids: int) -> int:
    """Bytes a corpus of `rows` rows of `seq_len` positions takes: features, final states and tokens."""
    return rows * seq_len * (2 * (num_layer_ids + 1) * hidden_size + 4)


# ----------------------------------------------------------------------------------------------------------------
# Running the target once


def target_taps(target, tokens: jax.Array, layer_ids: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] -> (features [B, T, n*D], hidden [B, T, D]): one teacher-forced forward of the target.

    features: the outputs of the decoder layers `layer_ids`, concatenated in that order, the last layer's
    final-normed, which is what the decode strategy projects into the drafter's context (`BlockDrafter._write`);
    hidden: the final-normed state (the LM head's input)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    tapped = tuple(sorted(set(layer_ids)))
    x, _, taps = run_tapped_layers(target, target.embed_tokens(tokens), positions, target.init_cache(b, t), tapped)
    hidden = target.final_hidden(x)
    width = target.cfg.hidden_size
    by_layer = {layer: taps[..., i * width:(i + 1) * width] for i, layer in enumerate(tapped)}
    last = target.cfg.num_layers - 1
    if last in by_layer:
        by_layer[last] = hidden  # = final_hidden(the last layer's output)
    return jnp.concatenate([by_layer[layer] for layer in layer_ids], axis=-1), hidden


@functools.partial(jax.jit, static_argnums=(0, 3))
def _target_taps(graphdef, state, tokens, layer_ids):
    features, hidden = target_taps(nnx.merge(graphdef, state), tokens, layer_ids)
    return features.astype(HIDDEN_DTYPE), hidden.astype(HIDDEN_DTYPE)


def check_layer_ids(target_cfg, layer_ids: Sequence[int]) -> tuple[int, ...]:
    """`layer_ids` as a tuple, or a ValueError naming the layers the target lacks."""
    layer_ids = tuple(int(layer) for layer in layer_ids)
    missing = [layer for layer in layer_ids if not 0 <= layer < target_cfg.num_layers]
    if not layer_ids or missing:
        raise ValueError(f"the drafter taps target layers {list(layer_ids)}, but the target has layers 0.."
                         f"{target_cfg.num_layers - 1} only" + (f" (no layer {missing})" if missing else "") + ".")
    return layer_ids


def block_corpus(module, tokens: np.ndarray, lengths: np.ndarray, starts: np.ndarray, layer_ids: Sequence[int],
                 batch_size: int, progress: Callable[[int], None] | None = None) -> BlockCorpus:
    """Rows [N, T] (valid up to `lengths`, prompts up to `starts`) with the target's taps at `layer_ids` and its
    final-normed states, one forward per batch of `batch_size` rows; `progress(n)` after each batch of n rows."""
    layer_ids = check_layer_ids(module.cfg, layer_ids)
    n, t = tokens.shape
    d = module.cfg.hidden_size
    features = np.empty((n, t, len(layer_ids) * d), HIDDEN_DTYPE)
    hidden = np.empty((n, t, d), HIDDEN_DTYPE)
    graphdef, state = nnx.split(module)
    for begin in range(0, n, batch_size):
        rows = tokens[begin: begin + batch_size]
        padded = np.concatenate([rows, np.repeat(rows[:1], batch_size - len(rows), axis=0)])  # one compiled shape
        f, h = _target_taps(graphdef, state, jnp.asarray(padded, jnp.int32), layer_ids)
        features[begin: begin + len(rows)] = np.asarray(f)[: len(rows)]
        hidden[begin: begin + len(rows)] = np.asarray(h)[: len(rows)]
        if progress:
            progress(len(rows))
    return BlockCorpus(tokens.astype(np.int32), np.asarray(lengths, np.int32), np.asarray(starts, np.int32),
                       hidden, features, np.asarray(layer_ids, np.int32))


def generated_block_corpus(module, prompts: Sequence[Sequence[int]], seq_len: int, batch_size: int,
                           eos_ids: Sequence[int], layer_ids: Sequence[int], chunk: int = 256,
                           progress: Callable[[int], None] | None = None) -> BlockCorpus:
    """The target's greedy answers to `prompts` (up to `seq_len` tokens or the first EOS) with its taps, in
    `prompts` order, without the answers a block cannot be anchored in (an EOS straight after the prompt).

    Prompts are answered `chunk` at a time and each chunk's taps written into arrays allocated once, so building
    never holds more than the corpus and one chunk's generations. `progress(n)` after each batch of n prompts."""
    layer_ids = check_layer_ids(module.cfg, layer_ids)
    n, d = len(prompts), module.cfg.hidden_size
    out = BlockCorpus(np.zeros((n, seq_len), np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32),
                      np.empty((n, seq_len, d), HIDDEN_DTYPE), np.empty((n, seq_len, len(layer_ids) * d), HIDDEN_DTYPE),
                      np.asarray(layer_ids, np.int32))
    kept = 0
    for begin in range(0, n, chunk):
        rows = greedy_generations(module, prompts[begin: begin + chunk], seq_len, batch_size, eos_ids, progress)
        low, high = anchor_bounds(rows.starts, rows.lengths)
        keep = np.flatnonzero(high >= low)
        part = block_corpus(module, rows.tokens[keep], rows.lengths[keep], rows.starts[keep], layer_ids, batch_size)
        for field in ("tokens", "lengths", "starts", "hidden", "features"):
            getattr(out, field)[kept: kept + len(keep)] = getattr(part, field)
        kept += len(keep)
    return out.take(slice(0, kept))  # views: no copy


def concat(parts: Sequence[BlockCorpus]) -> BlockCorpus:
    """One corpus of the rows of `parts`, padded to the longest row length; they must tap the same layers."""
    if len({tuple(p.layer_ids.tolist()) for p in parts}) != 1:
        raise ValueError(f"corpora of different tapped layers cannot be joined: "
                         f"{[p.layer_ids.tolist() for p in parts]}.")
    t = max(p.tokens.shape[1] for p in parts)

    def padded(value: np.ndarray) -> np.ndarray:
        if value.ndim < 2 or value.shape[1] == t:
            return value
        return np.pad(value, [(0, 0), (0, t - value.shape[1])] + [(0, 0)] * (value.ndim - 2))

    fields = ("tokens", "lengths", "starts", "hidden", "features")
    return BlockCorpus(*(np.concatenate([padded(getattr(p, name)) for p in parts]) for name in fields),
                       parts[0].layer_ids)

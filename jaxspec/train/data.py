"""Training data for MTP layers: token rows with the frozen target's final-normed hidden state at every position.

Everything an MTP layer trains on comes from the target once: its hidden states feed depth 0, and its own next-token
distribution at each position (the LM head over those hidden states) is the soft target of every depth. So the
target runs once per corpus, here, and the result is cached on disk (`save` / `load`); training never runs it.

Two offline sources (see jaxspec/train/prompts.py and scripts/train_mtp.py):
- the target's own greedy generations from a prompt set: the sequences MTP drafting meets at decode time, where an
  accepted draft is by definition the target's own token;
- windows of the Python standard library's sources (every Python installation has them): varied code and prose at
  the cost of one forward per token, no generation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxspec.checkpoint import atomic_folder

HIDDEN_DTYPE = ml_dtypes.bfloat16  # cached hidden states: half the memory of float32, ample for inputs and targets


@dataclasses.dataclass
class Corpus:
    """N rows of T positions. Row b holds tokens[b, :lengths[b]]; hidden[b, i] is the target's final-normed hidden
    state after reading tokens[b, :i+1] and lse[b, i] the logsumexp of its logits there (the normaliser of p over
    the full vocabulary, so training on a draft vocabulary never needs the full head), both valid for
    i < lengths[b] - 1 (what follows the last token is never trained on, so its state is not needed).
    Positions before starts[b] are a prompt (0 for text windows): held-out acceptance is measured from there on, as
    decoding starts after the prompt."""

    tokens: np.ndarray  # [N, T] int32
    lengths: np.ndarray  # [N] int32
    starts: np.ndarray  # [N] int32
    hidden: np.ndarray  # [N, T, D] HIDDEN_DTYPE
    lse: np.ndarray  # [N, T] float32

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def take(self, rows) -> "Corpus":
        return Corpus(self.tokens[rows], self.lengths[rows], self.starts[rows], self.hidden[rows], self.lse[rows])

    @staticmethod
    def concat(parts: Sequence["Corpus"]) -> "Corpus":
        return Corpus(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Corpus)))


# ----------------------------------------------------------------------------------------------------------------
# Sources


def text_windows(tokenizer, documents: Sequence[str], seq_len: int, max_rows: int) -> np.ndarray:
    """Documents tokenized and cut into full windows of `seq_len` tokens (a short tail is dropped): [N, T]."""
    rows = []
    for text in documents:
        ids = tokenizer(text)["input_ids"]
        rows += [ids[start: start + seq_len] for start in range(0, len(ids) - seq_len + 1, seq_len)]
        if len(rows) >= max_rows:
            break
    return np.asarray(rows[:max_rows], np.int32).reshape(-1, seq_len)


def prompt_ids(tokenizer, heldout: bool, count: int, stdlib_share: float, max_len: int,
               seed: int) -> list[list[int]]:
    """Token ids of `count` prompts of the training or the held-out set (jaxspec/train/prompts.py), each of at most
    `max_len` tokens, in a seeded order. A quarter more are drawn than needed: longer ones are dropped when encoded."""
    from . import prompts

    drawn = prompts.prompt_set(heldout, count * 5 // 4, stdlib_share, seed=seed)
    ids = encode_prompts(tokenizer, drawn, max_len)
    random.Random(seed).shuffle(ids)
    return ids[:count]


def stdlib_windows(tokenizer, seq_len: int, count: int, seed: int) -> np.ndarray:
    """`count` windows of `seq_len` tokens of the Python standard library's training modules (the held-out tenth
    excluded), from the files in a seeded order: [N, T]."""
    from . import prompts

    if count == 0:
        return np.zeros((0, seq_len), np.int32)
    documents = []
    for path in prompts.training_files():
        with open(path, encoding="utf-8", errors="replace") as handle:
            documents.append(handle.read())
    random.Random(seed).shuffle(documents)
    return text_windows(tokenizer, documents, seq_len, count)


def encode_prompts(tokenizer, prompts, max_len: int) -> list[list[int]]:
    """Token ids of each `Prompt` (chat template or raw text), keeping only prompts of at most `max_len` tokens.
    A tokenizer without a chat template continues every prompt as raw text."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for prompt in prompts:
        if prompt.chat and has_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        if 0 < len(ids) <= max_len:
            out.append(list(ids))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Running the target once


def text_corpus(module: nnx.Module, tokens: np.ndarray, batch_size: int,
                progress: Callable[[int], None] | None = None) -> Corpus:
    """Full rows of text [N, T] with the target's hidden states and logsumexps (one forward per batch)."""
    graphdef, state = nnx.split(module)
    forward = jax.jit(_forward_hidden, static_argnums=0)
    hidden, lse = [], []
    for begin in range(0, len(tokens), batch_size):
        rows = tokens[begin: begin + batch_size]
        padded = np.concatenate([rows, np.repeat(rows[:1], batch_size - len(rows), axis=0)])  # one shape
        h, s = forward(graphdef, state, jnp.asarray(padded))
        hidden.append(np.asarray(h)[: len(rows)].astype(HIDDEN_DTYPE))
        lse.append(np.asarray(s)[: len(rows)])
        if progress:
            progress(int(rows.size))
    n, t = tokens.shape
    return Corpus(tokens.astype(np.int32), np.full(n, t, np.int32), np.zeros(n, np.int32),
                  np.concatenate(hidden) if hidden else np.zeros((0, t, module.cfg.hidden_size), HIDDEN_DTYPE),
                  np.concatenate(lse) if lse else np.zeros((0, t), np.float32))


def _forward_hidden(graphdef, state, tokens):
    module = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, hidden, _ = module(tokens, positions, module.init_cache(b, t))
    return hidden, jax.nn.logsumexp(logits, axis=-1)


def greedy_generations(module: nnx.Module, prompts: Sequence[Sequence[int]], seq_len: int, batch_size: int,
                       eos_ids: Sequence[int], progress: Callable[[int], None] | None = None) -> Corpus:
    """The target's greedy continuation of each prompt up to `seq_len` tokens or its first EOS, with its hidden
    states; `progress(n)` after each batch of n prompts. One token per step with a KV cache, like plain decoding,
    so the rows are what jaxspec.generate's greedy output would be. Prompts are grouped by length so that a batch's
    prompt bucket wastes little."""
    too_long = [len(p) for p in prompts if not 0 < len(p) < seq_len]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) have lengths {sorted(set(too_long))[:5]} outside "
                         f"1..{seq_len - 1}: each needs room for a generated token in seq_len={seq_len}.")
    graphdef, state = nnx.split(module)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    parts = []
    for begin in range(0, len(order), batch_size):
        chosen = [prompts[i] for i in order[begin: begin + batch_size]]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        lengths = np.full((batch_size,), len(chosen[0]), np.int32)  # padding rows repeat the first prompt
        for row in range(batch_size):
            ids = chosen[row] if row < len(chosen) else chosen[0]
            tokens[row, : len(ids)], lengths[row] = ids, len(ids)
        bucket = min(seq_len, -(-int(lengths.max()) // 32) * 32)
        out_tokens, out_lengths, hidden, lse = _generate(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths),
                                                         bucket, tuple(eos_ids))
        n = len(chosen)
        out_lengths = np.asarray(out_lengths)[:n]
        parts.append(Corpus(np.asarray(out_tokens)[:n], out_lengths, lengths[:n].copy(),
                            np.asarray(hidden)[:n].astype(HIDDEN_DTYPE), np.asarray(lse)[:n]))
        if progress:
            progress(n)
    order_back = np.argsort(order)
    return Corpus.concat(parts).take(order_back)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _generate(graphdef, state, tokens, prompt_lengths, bucket: int, eos_ids: tuple[int, ...]):
    """tokens: [B, T] prompts from position 0, prompt_lengths: [B].
    Returns (tokens, lengths, hidden [B, T, D], lse [B, T])."""
    module = nnx.merge(graphdef, state)
    b, t = tokens.shape
    rows = jnp.arange(b)
    cache = module.init_cache(b, t)
    positions = jnp.broadcast_to(jnp.arange(bucket), (b, bucket))
    logits, prompt_hidden, cache = module(tokens[:, :bucket], positions, cache)
    hidden = jnp.zeros((b, t, prompt_hidden.shape[-1]), prompt_hidden.dtype).at[:, :bucket].set(prompt_hidden)
    lse = jnp.zeros((b, t), jnp.float32).at[:, :bucket].set(jax.nn.logsumexp(logits, axis=-1))
    first = jnp.argmax(logits[rows, prompt_lengths - 1], axis=-1).astype(jnp.int32)
    tokens = tokens.at[rows, prompt_lengths].set(first, mode="drop")
    # A row is done once it has written an EOS or filled the buffer; `lengths` counts its valid tokens.
    lengths = jnp.minimum(prompt_lengths + 1, t)
    done = _is_eos(first, eos_ids) | (lengths >= t)

    def step(carry):
        offset, tokens, lengths, done, hidden, lse, cache = carry
        position = prompt_lengths + offset  # [B] the newest token of each row
        live = position < t
        token = tokens[rows, jnp.minimum(position, t - 1)]
        logits, h, cache = module(token[:, None], position[:, None], cache)
        hidden = hidden.at[rows, position].set(h[:, 0], mode="drop")
        lse = lse.at[rows, position].set(jax.nn.logsumexp(logits[:, 0], axis=-1), mode="drop")
        write = ~done & live
        next_token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        tokens = tokens.at[rows, jnp.where(write, position + 1, t)].set(next_token, mode="drop")
        lengths = jnp.where(write, jnp.minimum(position + 2, t), lengths)
        done = done | (write & _is_eos(next_token, eos_ids)) | (lengths >= t)
        return offset + 1, tokens, lengths, done, hidden, lse, cache

    def running(carry):
        offset, done = carry[0], carry[3]
        return (offset < t - jnp.min(prompt_lengths)) & ~jnp.all(done)

    carry = (jnp.zeros((), jnp.int32), tokens, lengths, done, hidden, lse, cache)
    _, tokens, lengths, _, hidden, lse, _ = jax.lax.while_loop(running, step, carry)
    return tokens, lengths, hidden, lse


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros(tokens.shape, bool)


# ----------------------------------------------------------------------------------------------------------------
# Draft vocabulary


def token_frequencies(corpus: Corpus, vocab_size: int) -> np.ndarray:
    """How often each token id occurs among the corpus's valid tokens: [V]."""
    valid = np.arange(corpus.tokens.shape[1])[None, :] < corpus.lengths[:, None]
    return np.bincount(corpus.tokens[valid], minlength=vocab_size)


def draft_vocabulary(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids (ties by id, so the choice is deterministic), sorted by id: [V']."""
    order = np.lexsort((np.arange(len(counts)), -counts))
    return np.sort(order[:size]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Cache on disk


def save(corpus, folder: str, meta: dict) -> None:
    """Write `corpus` (a `Corpus`, or any dataclass of arrays such as `dflash_data.BlockCorpus`) to `folder`
    atomically (a temporary sibling renamed when complete); `meta` describes what it was built from, so `load` can
    refuse a cache built from another model or recipe."""
    with atomic_folder(folder) as tmp:
        for field in dataclasses.fields(corpus):
            value = getattr(corpus, field.name)
            if value.dtype == HIDDEN_DTYPE:
                value = value.view(np.uint16)  # .npy has no bfloat16; the bits round-trip exactly
            np.save(os.path.join(tmp, f"{field.name}.npy"), value)
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as handle:
            json.dump(meta, handle, indent=2, sort_keys=True)


def load(folder: str, meta: dict, kind: type = Corpus):
    """The `kind` corpus cached in `folder` if it was built with exactly `meta`, else None. The arrays are
    memory-mapped: a batch pages in only the rows it reads."""
    try:
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as handle:
            if json.load(handle) != json.loads(json.dumps(meta)):
                return None
        arrays = {f.name: np.load(os.path.join(folder, f"{f.name}.npy"), mmap_mode="r")
                  for f in dataclasses.fields(kind)}
    except (OSError, ValueError):
        return None
    # No field is stored as uint16 but the bfloat16 ones (`save`).
    return kind(**{name: value.view(HIDDEN_DTYPE) if value.dtype == np.uint16 else np.asarray(value)
                   for name, value in arrays.items()})

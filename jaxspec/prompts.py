"""Prompt inputs: each row's real tokens from `input_ids` / `attention_mask`, checked, and the token buffer they go in.

Every check runs on the host, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

MIN_BUFFER = 256  # smallest token buffer / cache length, unless $JAXSPEC_MIN_BUFFER says otherwise (min_buffer)
LARGE_BUFFER = 2048  # buffers up to this are powers of two ...
BUFFER_STEP = 512  # ... longer ones multiples of this


def prompt_rows(input_ids: Any, attention_mask: Any, pad_id: int, eos_ids: tuple[int, ...]) -> list[np.ndarray]:
    """Each row's real tokens. Rows may be left- or right-padded (mask zeros at one end), or a list of rows.

    Without a mask, an array of ids gets one inferred from the pad id when the ids contain it and it is not an EOS
    id, as HF does (`_prepare_attention_mask_for_generation`). A list of rows without a mask is taken as it is,
    each row exactly its tokens: a chat template's end-of-turn token is often the pad token too.
    """
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, np.ndarray)):
        if attention_mask is None:
            rows = [np.asarray(r, np.int64) for r in input_ids]
            if any(r.ndim != 1 for r in rows):
                raise ValueError("input_ids rows must be 1-D sequences of token ids.")
            return checked_rows(rows)
        input_ids = np.asarray(input_ids)
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [batch, length]; got {ids.shape}.")
    if ids.shape[0] == 0:
        raise ValueError("input_ids has no rows.")
    inferred = attention_mask is None
    if inferred:
        if pad_id in ids and pad_id not in eos_ids:
            attention_mask = ids != pad_id
        else:
            return checked_rows(list(ids))
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids shape {ids.shape}.")
    rows = []
    for b in range(ids.shape[0]):
        real = np.flatnonzero(mask[b])
        if len(real) and real[-1] - real[0] + 1 != len(real):
            if inferred:
                raise ValueError(
                    f"No attention_mask was given, so padding was inferred from pad_token_id={pad_id} (as "
                    f"transformers does when it is not an EOS id), but row {b} holds that token between real tokens "
                    "(a chat template's end-of-turn token, say). Pass attention_mask, or the rows as a list of "
                    "token lists.")
            raise ValueError(f"attention_mask row {b} has padding between real tokens; only left or right padding "
                             "is supported.")
        rows.append(ids[b, real])
    return checked_rows(rows)


def checked_rows(rows: list[np.ndarray]) -> list[np.ndarray]:
    for b, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"Prompt row {b} is empty: every row needs at least one token.")
    return [np.asarray(r, np.int32) for r in rows]


def check_budget(model, prompts: list[np.ndarray], max_new_tokens: int) -> None:
    longest = max(len(p) for p in prompts)
    limit = model.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"Prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} exceeds the "
            f"model's max_position_embeddings ({limit})."
        )
    vocab = model.config.vocab_size
    for b, p in enumerate(prompts):
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"Prompt row {b} has token ids outside the vocabulary [0, {vocab}).")


def given_layout(input_ids, prompts, pad_id) -> np.ndarray:
    """The prompts as the caller laid them out (HF returns them unchanged ahead of the new tokens)."""
    try:
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim == 2 and ids.dtype != object:
            return ids.astype(np.int32)
    except ValueError:
        pass
    longest = max(len(p) for p in prompts)  # a ragged list: left-pad it, as HF tokenizers do for generation
    out = np.full((len(prompts), longest), pad_id, np.int32)
    for row, p in enumerate(prompts):
        out[row, longest - len(p):] = p
    return out


def power_of_two_setting(name: str, default: int) -> int:
    """The environment variable `name` as a power of two (at least 8), or `default` when it is unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 8 or int(value) & (int(value) - 1):
        raise ValueError(f"${name} must be a power of two of at least 8, got {value!r}.")
    return int(value)


def choice_setting(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name`, one of `choices` (case-insensitive), or the first of them when it is unset;
    any other value is an error that names the variable and the choices, not a silent fallback."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}.")
    return value


def min_buffer() -> int:
    """The smallest token buffer / cache length: MIN_BUFFER, or $JAXSPEC_MIN_BUFFER. A larger floor lets calls
    of different short lengths share one executable; a smaller one saves memory and time when a call is short and
    its batch is large (the test suite runs thousands of 4-token rows with 32)."""
    return power_of_two_setting("JAXSPEC_MIN_BUFFER", MIN_BUFFER)


def buffer_size(needed: int, chunk: int) -> int:
    """Token buffer / cache length for `needed` positions, rounded so that nearby prompt lengths and budgets share
    executables: a power of two up to LARGE_BUFFER, then a multiple of BUFFER_STEP (a long context wastes less than
    a step of cache); at least `min_buffer()`, and a multiple of the prefill chunk, so that its chunks tile it
    exactly."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two, got {chunk}.")
    if needed <= LARGE_BUFFER:
        size = max(min_buffer(), 1 << (needed - 1).bit_length())
    else:
        size = -(-needed // BUFFER_STEP) * BUFFER_STEP
    return -(-size // chunk) * chunk


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """A call's prompts: each row's real tokens, and the layout the caller gave them in."""

    rows: list[np.ndarray]  # [T_b] int32 each
    lengths: np.ndarray  # [B] int32
    given: np.ndarray  # [B, T_in] int32: the prompts as laid out by the caller (transformers returns them so)

    @classmethod
    def parse(cls, input_ids: Any, attention_mask: Any, pad_id: int, eos_ids: tuple[int, ...]) -> "PromptBatch":
        rows = prompt_rows(input_ids, attention_mask, pad_id, eos_ids)
        return cls(rows, np.array([len(r) for r in rows], np.int32), given_layout(input_ids, rows, pad_id))

    @property
    def size(self) -> int:
        return len(self.rows)

    def token_buffer(self, size: int) -> np.ndarray:
        """[B, size] int32: each prompt left-aligned, zeros after it."""
        tokens = np.zeros((self.size, size), np.int32)
        for row, prompt in enumerate(self.rows):
            tokens[row, : len(prompt)] = prompt
        return tokens

"""Sampling, logits processing and stopping: `SamplingConfig` (the call's values, transformers' names) resolved into
`Settings` (every value filled in and checked), split into static and run-time parts.

Each value comes from the call's keyword argument, else the model's generation_config.json, else HF's default
(`GenerationConfig._get_default_generation_params` in transformers 5.23: sampling uses top_k=50 unless told
otherwise). Everything is checked here, on the host, before anything compiles.

The split that keeps compiles rare: only shapes, the strategy and greedy-vs-sampling are static. Temperature,
top-k/p, min-p, penalties, n-gram sizes, min_new_tokens, suppressed tokens and bad words enter the compiled loop as
arrays (`jaxspec.processors.Processing`), so a new value reuses the executable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from .processors import Processing

# HF's defaults for the values generation_config.json may set (transformers 5.23).
HF_DEFAULTS: dict[str, Any] = dict(
    do_sample=False,
    temperature=1.0,
    top_k=50,
    top_p=1.0,
    min_p=None,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    min_new_tokens=0,
    bad_words_ids=None,
    suppress_tokens=None,
    max_new_tokens=None,
)
# n-gram sizes up to this need no recompile; a larger one compiles a loop that checks longer n-grams.
NGRAM_SLOTS = 4
# Multi-token bad words are padded to power-of-two buckets of count and prefix length (at least these).
BAD_WORDS_MIN_COUNT, BAD_WORDS_MIN_LENGTH = 4, 4


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """A call's sampling, processing and stopping values, with transformers' names. None: not given, so the model's
    generation_config.json decides, else transformers' default (`top_k=50` when sampling; pass `top_k=0` to turn it
    off). Adding a field here adds a `generate()` keyword argument."""

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    bad_words_ids: Sequence[Sequence[int]] | None = None
    suppress_tokens: Sequence[int] | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    seed: int = 0

    def resolve(self, model) -> "Settings":
        return resolve(model, self)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A call's resolved sampling, processing and stopping settings (strategy settings live in the drafter)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1: off
    min_p: float  # 0: off
    repetition_penalty: float  # 1: off
    no_repeat_ngram_size: int  # 0: off
    min_new_tokens: int
    bad_words_ids: tuple[tuple[int, ...], ...]
    suppress_tokens: tuple[int, ...]
    eos_ids: tuple[int, ...]
    pad_id: int
    seed: int

    @property
    def ngram_slots(self) -> int:
        """Static: how many n-gram positions the compiled loop compares (n - 1, rounded up to a power of two)."""
        needed = max(self.no_repeat_ngram_size - 1, 1)
        return max(NGRAM_SLOTS, 1 << (needed - 1).bit_length())

    def multi_token_bad_words(self) -> list[tuple[int, ...]]:
        return [seq for seq in self.bad_words_ids if len(seq) > 1]

    @property
    def bad_words_shape(self) -> tuple[int, int]:
        """Static: (sequences, prefix length) of the padded table of multi-token bad words. Up to
        BAD_WORDS_MIN_COUNT sequences of up to BAD_WORDS_MIN_LENGTH + 1 tokens fit the default table, so adding or
        changing bad words does not recompile."""
        sequences = self.multi_token_bad_words()
        count = max(len(sequences), 1)
        longest = max([len(seq) - 1 for seq in sequences] + [1])
        return (max(BAD_WORDS_MIN_COUNT, 1 << (count - 1).bit_length()),
                max(BAD_WORDS_MIN_LENGTH, 1 << (longest - 1).bit_length()))

    def processing(self, vocab_size: int) -> Processing:
        """The run-time part, as host arrays (they enter the compiled loop as arguments)."""
        suppressed = np.zeros(vocab_size, bool)
        suppressed[list(self.suppress_tokens)] = True
        for seq in self.bad_words_ids:
            if len(seq) == 1:
                suppressed[seq[0]] = True
        count, length = self.bad_words_shape
        prefixes = np.full((count, length), -1, np.int32)
        last = np.full((count,), -1, np.int32)
        for row, seq in enumerate(self.multi_token_bad_words()):
            prefixes[row, length - (len(seq) - 1):] = seq[:-1]
            last[row] = seq[-1]
        eos = np.array(self.eos_ids or (-1,), np.int32)
        return Processing(
            temperature=np.float32(self.temperature),
            top_k=np.int32(self.top_k),
            top_p=np.float32(self.top_p),
            min_p=np.float32(self.min_p),
            repetition_penalty=np.float32(self.repetition_penalty),
            no_repeat_ngram_size=np.int32(self.no_repeat_ngram_size),
            min_new_tokens=np.int32(self.min_new_tokens),
            suppressed=suppressed,
            bad_prefixes=prefixes,
            bad_last=last,
            eos=eos,
        )


def resolve(model, call: SamplingConfig | None = None, **values) -> Settings:
    """The call's value (`call`, or its fields as keyword arguments), else the model's generation_config, else HF's
    default; every value validated."""
    call = dataclasses.replace(call or SamplingConfig(), **values)
    config = getattr(model, "generation_config", None) or {}

    def pick(name, value):
        if value is not None:
            return value
        return config[name] if config.get(name) is not None else HF_DEFAULTS[name]

    vocab = model.config.vocab_size
    max_new_tokens = pick("max_new_tokens", call.max_new_tokens)
    if max_new_tokens is None:
        raise ValueError("Pass max_new_tokens (the model's generation_config does not set it).")
    _check_int("max_new_tokens", max_new_tokens, minimum=1)
    do_sample = pick("do_sample", call.do_sample)
    if not isinstance(do_sample, (bool, np.bool_)):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}.")
    temperature = float(pick("temperature", call.temperature))
    top_k = pick("top_k", call.top_k)
    top_p = float(pick("top_p", call.top_p))
    min_p = pick("min_p", call.min_p)
    if do_sample:
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}.")
        _check_int("top_k", top_k, minimum=0, note=" (0 or None disables it)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}.")
        if min_p is not None and not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (None or 0 disables it), got {min_p}.")
    repetition_penalty = float(pick("repetition_penalty", call.repetition_penalty))
    if not (repetition_penalty > 0 and math.isfinite(repetition_penalty)):
        raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {repetition_penalty}.")
    no_repeat_ngram_size = pick("no_repeat_ngram_size", call.no_repeat_ngram_size)
    _check_int("no_repeat_ngram_size", no_repeat_ngram_size, minimum=0, note=" (0 disables it)")
    min_new_tokens = pick("min_new_tokens", call.min_new_tokens)
    _check_int("min_new_tokens", min_new_tokens, minimum=0)
    eos_ids = _eos_ids(model, config, call.eos_token_id)
    bad_words = _token_sequences("bad_words_ids", pick("bad_words_ids", call.bad_words_ids), vocab)
    # As HF: a one-token bad word that is an EOS id is dropped (banning EOS would make generation never stop).
    bad_words = tuple(seq for seq in bad_words if not (len(seq) == 1 and seq[0] in eos_ids))
    suppress = _token_ids("suppress_tokens", pick("suppress_tokens", call.suppress_tokens), vocab)
    _check_int("seed", call.seed, minimum=0)
    return Settings(
        max_new_tokens=int(max_new_tokens),
        do_sample=bool(do_sample),
        temperature=temperature if do_sample else 1.0,
        top_k=int(top_k or 0) if do_sample else 0,
        top_p=top_p if do_sample else 1.0,
        min_p=float(min_p or 0.0) if do_sample else 0.0,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=int(no_repeat_ngram_size),
        min_new_tokens=int(min_new_tokens),
        bad_words_ids=bad_words,
        suppress_tokens=suppress,
        eos_ids=eos_ids,
        pad_id=_pad_id(model, config, call.pad_token_id, eos_ids),
        seed=int(call.seed),
    )


def _check_int(name: str, value, minimum: int, note: str = "") -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{note}, got {value!r}.")


def _eos_ids(model, config, eos_token_id) -> tuple[int, ...]:
    """As HF: the call's EOS ids, else the generation config's, else the model config's."""
    for candidate in (eos_token_id, config.get("eos_token_id")):
        if candidate is not None:
            ids = tuple(candidate) if isinstance(candidate, (list, tuple)) else (candidate,)
            return tuple(int(i) for i in ids)
    return tuple(model.config.eos_token_id)


def _pad_id(model, config, pad_token_id, eos_ids) -> int:
    """As HF: the given pad id, else the generation config's, else the model config's, else the first EOS id, else 0."""
    for candidate in (pad_token_id, config.get("pad_token_id"), getattr(model.config, "pad_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return eos_ids[0] if eos_ids else 0


def _token_ids(name: str, ids: Sequence[int] | None, vocab: int) -> tuple[int, ...]:
    if ids is None:
        return ()
    ids = tuple(ids)
    if not all(isinstance(i, (int, np.integer)) and 0 <= i < vocab for i in ids):
        raise ValueError(f"{name} must be token ids in [0, {vocab}), got {list(ids)!r}.")
    return tuple(int(i) for i in ids)


def _token_sequences(name: str, sequences, vocab: int) -> tuple[tuple[int, ...], ...]:
    if sequences is None:
        return ()
    if not isinstance(sequences, (list, tuple)) or not all(isinstance(s, (list, tuple)) and s for s in sequences):
        raise ValueError(f"{name} must be a list of non-empty lists of token ids, got {sequences!r}.")
    return tuple(_token_ids(name, seq, vocab) for seq in sequences)

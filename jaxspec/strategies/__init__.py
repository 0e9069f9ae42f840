"""HF-style generate() arguments -> one drafter. Every check here runs on the host, before anything compiles."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Drafter

HF_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
               "assistant_confidence_threshold": 0.4}


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    name: str
    drafter: Drafter
    assistant: Any = None  # the Model whose weights the drafter runs, if any


def choose_strategy(
    model,
    *,
    do_sample: bool,
    assistant_model=None,
    num_assistant_tokens: int | None = None,
    num_assistant_tokens_schedule: str | None = None,
    assistant_confidence_threshold: float | None = None,
    max_assistant_tokens: int | None = None,
    assistant_ensemble_weight: float | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    assistant_early_exit: int | None = None,
    use_mtp: bool = False,
    tokenizer=None,
    assistant_tokenizer=None,
) -> StrategyChoice:
    chosen = [name for name, value in (
        ("assistant_model", assistant_model),
        ("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
        ("assistant_early_exit", assistant_early_exit),
        ("use_mtp", use_mtp or None),
    ) if value is not None]
    if len(chosen) > 1:
        # HF silently lets one win by a fixed precedence; a silent choice hides a mistake, so say it.
        raise ValueError(f"Choose one assisted-decoding strategy; got {chosen}.")
    if assistant_ensemble_weight is not None and not 0.0 < assistant_ensemble_weight < 1.0:
        raise ValueError(
            f"assistant_ensemble_weight must be in the open interval (0, 1), got {assistant_ensemble_weight}. "
            "Use None for standard (lossless) speculative decoding."
        )
    if not chosen:
        if assistant_ensemble_weight is not None:
            raise ValueError("assistant_ensemble_weight needs a drafter that produces draft distributions "
                             "(assistant_model, assistant_early_exit or use_mtp).")
        return StrategyChoice("sample" if do_sample else "greedy", Drafter())

    if prompt_lookup_num_tokens is not None:
        from .prompt_lookup import PromptLookupDrafter

        if assistant_ensemble_weight is not None:
            raise ValueError("assistant_ensemble_weight requires draft distributions; prompt lookup has none "
                             "(its drafts are copied tokens).")
        _check_positive_int("prompt_lookup_num_tokens", prompt_lookup_num_tokens)
        ngram = max_matching_ngram_size or 2  # HF: `or 2`, so 0 also means 2
        _check_positive_int("max_matching_ngram_size", ngram)
        return StrategyChoice("prompt_lookup", PromptLookupDrafter(max_draft=prompt_lookup_num_tokens,
                                                                   max_ngram=ngram))

    keep_probs = do_sample or assistant_ensemble_weight is not None
    if use_mtp:
        return _mtp_strategy(model, num_assistant_tokens, num_assistant_tokens_schedule,
                             assistant_confidence_threshold, keep_probs)

    settings = _draft_length_settings(
        assistant_model if assistant_model is not None else model,
        num_assistant_tokens, num_assistant_tokens_schedule, assistant_confidence_threshold, max_assistant_tokens,
    )
    if assistant_early_exit is not None:
        from .early_exit import EarlyExitDrafter

        layers = model.config.num_layers
        if not isinstance(assistant_early_exit, int) or not 1 <= assistant_early_exit <= layers - 1:
            raise ValueError(f"assistant_early_exit must be a layer count in 1..{layers - 1} (the model has {layers} "
                             f"layers), got {assistant_early_exit!r}.")
        return StrategyChoice("early_exit", EarlyExitDrafter(exit_layer=assistant_early_exit, keep_probs=keep_probs,
                                                             **settings))

    from .draft_model import DraftModelDrafter

    _check_assistant(model, assistant_model, tokenizer, assistant_tokenizer)
    return StrategyChoice("speculative", DraftModelDrafter(keep_probs=keep_probs, **settings), assistant_model)


def _mtp_strategy(model, num_tokens, schedule, threshold, keep_probs) -> StrategyChoice:
    from .mtp import MtpDrafter

    layers = getattr(model.module, "num_mtp_layers", 0)
    if not layers:
        raise ValueError(
            f"use_mtp=True needs multi-token-prediction layers, but this {model.config.__class__.__name__} has none "
            "(config.json's num_nextn_predict_layers is 0 or absent, or the family has no MTP layers)."
        )
    if schedule not in (None, "constant") or threshold is not None:
        raise ValueError("MTP drafts a fixed number of tokens per round: num_assistant_tokens_schedule and "
                         "assistant_confidence_threshold do not apply to use_mtp=True.")
    drafts = layers if num_tokens is None else num_tokens
    _check_positive_int("num_assistant_tokens", drafts)
    return StrategyChoice("mtp", MtpDrafter(max_draft=int(drafts), num_layers=layers, keep_probs=keep_probs))


def _draft_length_settings(source_model, num_tokens, schedule, threshold, cap) -> dict[str, Any]:
    """Arguments passed to generate win; then the drafting model's generation_config; then HF's defaults."""
    from .draft_model import SCHEDULES

    config = getattr(source_model, "generation_config", {}) or {}

    def pick(name, value):
        if value is not None:
            return value
        return config.get(name) if config.get(name) is not None else HF_DEFAULTS[name]

    num_tokens = pick("num_assistant_tokens", num_tokens)
    schedule = pick("num_assistant_tokens_schedule", schedule)
    threshold = pick("assistant_confidence_threshold", threshold)
    _check_positive_int("num_assistant_tokens", num_tokens)
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown num_assistant_tokens_schedule {schedule!r}; choose one of {SCHEDULES}.")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be in [0, 1] (0 disables it), got {threshold}.")
    if cap is None:
        # The heuristic schedules grow the draft length by 2 per fully accepted round; the draft buffer is static,
        # so growth stops at twice the starting length unless max_assistant_tokens says otherwise.
        cap = num_tokens if schedule == "constant" else 2 * num_tokens
    _check_positive_int("max_assistant_tokens", cap)
    if cap < num_tokens:
        raise ValueError(f"max_assistant_tokens ({cap}) must be >= num_assistant_tokens ({num_tokens}).")
    return dict(max_draft=int(cap), num_assistant_tokens=int(num_tokens), schedule=schedule,
                confidence_threshold=float(threshold))


def _check_assistant(model, assistant, tokenizer, assistant_tokenizer) -> None:
    if not hasattr(assistant, "module") or not hasattr(assistant, "config"):
        raise TypeError("assistant_model must be a model returned by jaxspec.load.")
    if tokenizer is not None or assistant_tokenizer is not None:
        raise NotImplementedError("Universal assisted decoding (an assistant with a different tokenizer, "
                                  "tokenizer= and assistant_tokenizer=) is not supported yet.")
    if assistant.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"The assistant's vocabulary ({assistant.config.vocab_size}) differs from the target's "
            f"({model.config.vocab_size}): its token ids mean other things. An assistant with a different tokenizer "
            "needs universal assisted decoding (tokenizer= and assistant_tokenizer=), which jaxspec does not "
            "support yet."
        )
    if not hasattr(assistant.module, "init_cache"):
        raise TypeError(f"{type(assistant.module).__name__} cannot serve as an assistant model (no KV cache).")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")

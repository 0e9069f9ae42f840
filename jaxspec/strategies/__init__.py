"""HF-style generate() arguments -> one drafter. Every check here runs on the host, before anything compiles.

Draft-length settings (`num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold`)
passed to `generate` win; then the drafting model's generation_config (the assistant's, or the target's own for
early exit), as HF reads it; then the defaults. jaxspec's default schedule is "adaptive" for every drafter (HF's is
"constant"); pass "constant" for HF's behaviour. An argument the chosen strategy does not use is an error that
names it: nothing is ignored in silence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .base import SCHEDULES, Drafter, Schedule, default_verify_costs, verify_widths
from .gemma4_drafter import is_gemma4_drafter

# HF's defaults for the assistant's settings, except the schedule (see the module docstring).
DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "adaptive",
            "assistant_confidence_threshold": 0.4}
# The static draft-buffer size K of HF's growing schedules when max_assistant_tokens is not given. It does not depend
# on the assistant's persisted num_assistant_tokens, so repeated calls reuse one compiled loop.
DEFAULT_MAX_ASSISTANT_TOKENS = 16
# The adaptive schedule's K when neither num_assistant_tokens nor max_assistant_tokens is set: verify widths 1, 2, 4
# and 8 (longer blocks rarely pay on a CPU; pass more on accelerators).
DEFAULT_ADAPTIVE_DRAFTS = 7

# The strategy arguments each strategy reads; any other one passed (not None) is an error.
USES = {
    "greedy": set(),
    "speculative": {"assistant_model", "num_assistant_tokens", "num_assistant_tokens_schedule",
                    "assistant_confidence_threshold", "max_assistant_tokens", "assistant_ensemble_weight",
                    "assistant_tokenizer"},
    "early_exit": {"assistant_early_exit", "num_assistant_tokens", "num_assistant_tokens_schedule",
                   "assistant_confidence_threshold", "max_assistant_tokens", "assistant_ensemble_weight"},
    "prompt_lookup": {"prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens_schedule"},
    "mtp": {"use_mtp", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_ensemble_weight"},
    # assistant_model= a Gemma 4 MTP drafter (gemma4_assistant), which drafts from the target's KV cache
    "mtp_drafter": {"assistant_model", "num_assistant_tokens", "num_assistant_tokens_schedule",
                    "assistant_confidence_threshold", "max_assistant_tokens", "assistant_ensemble_weight"},
}


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    name: str
    drafter: Drafter
    assistant: Any = None  # the Model whose weights the drafter runs, if any


def default_prefill_chunk() -> int:
    """Prompt tokens the target reads per forward: small on CPUs (compute-bound already), larger elsewhere."""
    return 64 if jax.default_backend() == "cpu" else 256


def choose_strategy(model, *, do_sample: bool, prefill_chunk: int | None = None, **arguments) -> StrategyChoice:
    """`arguments`: generate()'s strategy keyword arguments (None: not given)."""
    given = {name for name, value in arguments.items() if value is not None and value is not False}
    triggers = [name for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")
                if name in given]
    if len(triggers) > 1:
        # HF silently lets one win by a fixed precedence; a silent choice hides a mistake, so say it.
        raise ValueError(f"Choose one assisted-decoding strategy; got {triggers}.")
    name = {"assistant_model": "speculative", "prompt_lookup_num_tokens": "prompt_lookup",
            "assistant_early_exit": "early_exit", "use_mtp": "mtp"}.get(triggers[0] if triggers else "", "greedy")
    if name == "speculative" and is_gemma4_drafter(arguments["assistant_model"]):
        name = "mtp_drafter"
    unused = sorted(given - USES[name] - {"tokenizer"})  # tokenizer= also reads stop_strings, for any strategy
    if unused:
        what = "plain decoding" if name == "greedy" else f"the {name} strategy"
        raise ValueError(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by {what}; "
                         "remove it (jaxspec does not ignore arguments in silence).")
    weight = arguments.get("assistant_ensemble_weight")
    if weight is not None and not 0.0 < weight < 1.0:
        raise ValueError(f"assistant_ensemble_weight must be in the open interval (0, 1), got {weight}. "
                         "Use None for standard (lossless) speculative decoding.")
    keep_probs = do_sample or weight is not None
    if name == "greedy":
        return StrategyChoice("sample" if do_sample else "greedy", Drafter())
    if name == "prompt_lookup":
        return _prompt_lookup(arguments)
    if name == "mtp":
        return _mtp(model, arguments, keep_probs)
    if name == "mtp_drafter":
        from .gemma4_drafter import DRAFT_DEFAULTS, Gemma4Drafter, check_pair

        check_pair(model, arguments["assistant_model"])
        cost = weight_bytes(arguments["assistant_model"].module) / weight_bytes(model.module)
        max_draft, schedule, threshold = _draft_length(arguments["assistant_model"], arguments, DRAFT_DEFAULTS, cost)
        return StrategyChoice("mtp_drafter", Gemma4Drafter(max_draft=max_draft, schedule=schedule,
                                                           confidence_threshold=threshold, keep_probs=keep_probs),
                              arguments["assistant_model"])
    source = arguments["assistant_model"] if name == "speculative" else model
    if name == "speculative":
        _check_assistant(model, source)
        cost = weight_bytes(source.module) / weight_bytes(model.module)
    else:
        exit_layer, layers = arguments["assistant_early_exit"], model.config.num_layers
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer <= layers - 1:
            raise ValueError(f"assistant_early_exit must be a layer count in 1..{layers - 1} (the model has {layers} "
                             f"layers), got {exit_layer!r}.")
        head = head_share(model)  # a draft runs the first E layers and the LM head
        cost = head + (1 - head) * exit_layer / layers
    max_draft, schedule, threshold = _draft_length(source, arguments, DEFAULTS, cost)
    if name == "early_exit":
        from .early_exit import EarlyExitDrafter

        return StrategyChoice("early_exit", EarlyExitDrafter(max_draft=max_draft, schedule=schedule,
                                                             confidence_threshold=threshold, keep_probs=keep_probs,
                                                             exit_layer=exit_layer))
    from .draft_model import DraftModelDrafter
    from .universal import tokenizer_pair, universal_drafter

    settings = dict(max_draft=max_draft, schedule=schedule, confidence_threshold=threshold, keep_probs=keep_probs,
                    catch_up_width=prefill_chunk or default_prefill_chunk())
    pair = tokenizer_pair(model, source, arguments.get("tokenizer"), arguments.get("assistant_tokenizer"))
    if pair is not None:  # the assistant reads another vocabulary
        if weight is not None:
            raise NotImplementedError(
                "assistant_ensemble_weight with an assistant of another tokenizer: its drafts are its text "
                "re-tokenized for the target, with no draft distribution over the target's vocabulary to mix with "
                "the target's. Use the ensemble with an assistant that shares the target's tokenizer.")
        return StrategyChoice("universal", universal_drafter(model, source, *pair, **settings), source)
    return StrategyChoice("speculative", DraftModelDrafter(**settings), source)


def _prompt_lookup(arguments) -> StrategyChoice:
    from .prompt_lookup import PromptLookupDrafter

    k = arguments["prompt_lookup_num_tokens"]
    _check_positive_int("prompt_lookup_num_tokens", k)
    ngram = arguments.get("max_matching_ngram_size") or 2  # HF: `or 2`, so 0 also means 2
    _check_positive_int("max_matching_ngram_size", ngram)
    kind = _schedule_kind(arguments.get("num_assistant_tokens_schedule") or "adaptive", ("adaptive", "constant"),
                          "prompt lookup")
    return StrategyChoice("prompt_lookup", PromptLookupDrafter(max_draft=k, max_ngram=ngram,
                                                               schedule=make_schedule(kind, k, k, draft_cost=0.0)))


def _mtp(model, arguments, keep_probs: bool) -> StrategyChoice:
    from .mtp import MtpDrafter

    layers = getattr(model.module, "num_mtp_layers", 0)
    if not layers:
        raise ValueError(
            f"use_mtp=True needs multi-token-prediction layers, but this {model.config.__class__.__name__} has none "
            "(config.json's num_nextn_predict_layers is 0 or absent, or the family has no MTP layers)."
        )
    # Unless the caller sets it: the draft length the layers' config recommends (the shipped SmolLM2 set records the
    # K that scripts/bench_mtp.py measured best), else one draft per MTP layer.
    recommended = model.hf_config.get("mtp_num_assistant_tokens")
    if recommended is not None:
        _check_positive_int("config.json's mtp_num_assistant_tokens", recommended)
    drafts = arguments.get("num_assistant_tokens") or recommended or layers
    _check_positive_int("num_assistant_tokens", drafts)
    kind = _schedule_kind(arguments.get("num_assistant_tokens_schedule") or "adaptive", ("adaptive", "constant"),
                          "use_mtp")
    return StrategyChoice("mtp", MtpDrafter(max_draft=int(drafts), num_layers=layers, keep_probs=keep_probs,
                                            schedule=make_schedule(kind, int(drafts), int(drafts),
                                                                   draft_cost=mtp_draft_cost(model))))


def mtp_draft_cost(model) -> float:
    """One MTP draft in target decoding steps: a round drafting d tokens runs d depths (mtp.py), each an eh_proj,
    one decoder block of the target's kind and the draft head (over the draft vocabulary where the model has one).
    A MoE block is priced as if every expert were read, which overestimates it."""
    cfg = model.config
    head = head_share(model)
    block = (1 - head) / cfg.num_layers
    eh_proj = 2 * cfg.hidden_size**2 * np.dtype(model.dtype).itemsize / weight_bytes(model.module)
    drafted_vocab = getattr(cfg, "draft_vocab_size", 0) or cfg.vocab_size
    return block + eh_proj + head * drafted_vocab / cfg.vocab_size


def make_schedule(kind: str, initial: int, max_draft: int, draft_cost: float) -> Schedule:
    """A schedule; the adaptive one gets the loop's verify widths, their costs and the cost of one draft."""
    if kind != "adaptive":
        return Schedule(kind, initial=initial)
    widths = verify_widths(max_draft)
    return Schedule(kind, initial=initial, widths=widths, verify_costs=default_verify_costs(widths),
                    draft_cost=round(float(draft_cost), 3))


def weight_bytes(module) -> int:
    """Bytes of the params one decoding step reads (what it costs when memory-bound): all but the MTP layers, which
    only the MTP strategy runs (the catalogue's SmolLM2 carries three, which as an assistant it never reads)."""
    from flax import nnx

    params = nnx.state(module, nnx.Param)
    return sum(int(x.size) * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(params)
               if getattr(path[0], "key", None) != "mtp_layers")


def head_share(model) -> float:
    """The LM head's share of the weights a decoding step reads."""
    cfg = model.config
    return min(1.0, cfg.vocab_size * cfg.hidden_size * np.dtype(model.dtype).itemsize / weight_bytes(model.module))


def _draft_length(source_model, arguments, defaults, draft_cost: float) -> tuple[int, Schedule, float]:
    """(K, schedule, confidence threshold) of an assistant or early-exit drafter; `draft_cost` is one draft's cost
    in target decoding steps (the adaptive schedule weighs it)."""
    config = getattr(source_model, "generation_config", {}) or {}

    def pick(name):
        if arguments.get(name) is not None:
            return arguments[name]
        return config[name] if config.get(name) is not None else defaults[name]

    num_tokens, kind, threshold = (pick(name) for name in DEFAULTS)
    explicit = arguments.get("num_assistant_tokens") or config.get("num_assistant_tokens")
    _check_positive_int("num_assistant_tokens", num_tokens)
    kind = _schedule_kind(kind, SCHEDULES, "this strategy")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be in [0, 1] (0 disables it), got {threshold}.")
    cap = arguments.get("max_assistant_tokens")
    if cap is not None:
        _check_positive_int("max_assistant_tokens", cap)
    if kind == "constant":
        if cap is not None and cap < num_tokens:
            raise ValueError(f"max_assistant_tokens ({cap}) must be >= num_assistant_tokens ({num_tokens}).")
        max_draft = num_tokens if cap is None else cap
    elif kind == "adaptive":  # num_assistant_tokens is the most a round drafts (K); the schedule picks below it
        max_draft = cap or explicit or DEFAULT_ADAPTIVE_DRAFTS
        if cap is not None and explicit and explicit > cap:
            raise ValueError(f"num_assistant_tokens ({explicit}) exceeds max_assistant_tokens ({cap}).")
        num_tokens = max_draft
    else:
        max_draft = DEFAULT_MAX_ASSISTANT_TOKENS if cap is None else cap
        passed = arguments.get("num_assistant_tokens")
        if passed is not None and passed > max_draft:
            raise ValueError(f"num_assistant_tokens ({passed}) exceeds max_assistant_tokens ({max_draft}), the static "
                             f"draft-buffer size of the {kind!r} schedule; pass a larger max_assistant_tokens.")
        num_tokens = min(num_tokens, max_draft)  # a persisted or default length above the buffer starts at the cap
    return int(max_draft), make_schedule(kind, int(num_tokens), int(max_draft), draft_cost), float(threshold)


def _schedule_kind(kind, allowed, where: str) -> str:
    if kind not in allowed:
        raise ValueError(f"Unknown num_assistant_tokens_schedule {kind!r} for {where}; choose one of {allowed}.")
    return kind


def _check_assistant(model, assistant) -> None:
    if not hasattr(assistant, "module") or not hasattr(assistant, "config"):
        raise TypeError("assistant_model must be a model returned by jaxspec.load.")
    if not hasattr(assistant.module, "init_cache"):
        raise TypeError(f"{type(assistant.module).__name__} cannot serve as an assistant model (no KV cache).")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")

"""What a row of the strategy table is made of (jaxspec/strategies/table.py lists the rows).

A strategy is declared once, in its own file, as a `Strategy`: its name (also the CLI's `--strategy` choice and
`GenerateOutput.strategy`), the `generate()` argument that selects it, the `Option`s it accepts, a builder that turns
a call's options into a drafter, and what it persists across calls. `generate()`, `DraftingConfig` and the CLI all
read these rows, so an option is added by adding it to its strategy's row and reading it in that file's builder.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from ..prompts import power_of_two_setting
from ..schedule import SCHEDULES, Schedule, make_schedule
from ..tree import TreeShape
from .base import Drafter


@dataclasses.dataclass(frozen=True)
class Option:
    """One `generate()` keyword argument a strategy accepts, spelt as transformers spells it."""

    name: str
    help: str
    type: Callable[[str], Any] | None = int  # how the CLI parses it; None: not a CLI option (an object)
    choices: tuple[str, ...] = ()
    default: Any = None  # what the builder uses when the option is not given
    flag: str | None = None  # the CLI flag, if not --name-with-dashes
    loads_model: bool = False  # the CLI takes a path or catalogue name and passes jaxspec.load(path)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    """A call's strategy options (only those given), and what else a builder may read."""

    model: Any  # the target (jaxspec.loading.Model)
    options: dict[str, Any]
    do_sample: bool
    tokenizer: Any = None  # generate()'s tokenizer= (the target's, if it has none of its own)
    prefill_chunk: int | None = None

    def get(self, option: Option) -> Any:
        """The given value, else the option's default."""
        value = self.options.get(option.name)
        return option.default if value is None else value

    @property
    def keep_probs(self) -> bool:
        """Whether drafters must return their distribution q (sampling, or an ensemble to mix)."""
        return self.do_sample or self.options.get("assistant_ensemble_weight") is not None


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """The strategy one call runs: its row, the drafter, and the model whose weights the drafter runs, if any."""

    strategy: "Strategy"
    drafter: Drafter
    assistant: Any = None
    label: str | None = None  # what GenerateOutput.strategy says, if not the row's name ("sample")

    @property
    def name(self) -> str:
        return self.label or self.strategy.name


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One row of the strategy table."""

    name: str
    summary: str  # one line, for the CLI's help and the docs
    selected_by: str | None  # the option whose presence selects this row (None: plain decoding, the default)
    options: tuple[Option, ...]  # every option it accepts, `selected_by` included
    build: Callable[[BuildRequest], StrategyChoice]
    # Rows that share `selected_by` (the assistant_model rows) tell by the assistant which one a call is.
    claims: Callable[[BuildRequest], bool] | None = None
    # Whatever a call leaves behind for the next one (transformers' "heuristic" schedule adapts the assistant's
    # num_assistant_tokens across calls), or None.
    persist: Callable[[StrategyChoice, Any], None] | None = None

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset(option.name for option in self.options)


TREE = Option("tree", "draft a tree of N nodes at most D deep, verified in one forward ('N,D', or 'N,D,F': F "
              "candidates a depth, the N most probable kept; default: a chain)", type=str)


def tree_shape(request: BuildRequest, where: str) -> TreeShape | None:
    """The call's `tree=` as a TreeShape, or None for a chain; refused where verification cannot take a tree."""
    value = request.options.get("tree")
    if value is None:
        return None
    shape = TreeShape.parse(value)
    if request.options.get("assistant_ensemble_weight") is not None:
        raise NotImplementedError("assistant_ensemble_weight verifies a chain against a mixture; tree verification "
                                  "of the mixture is not implemented: drop tree= or the ensemble weight.")
    if not getattr(request.model.module, "tree_attention", False):
        raise NotImplementedError(f"tree= needs tree attention in the target's family; "
                                  f"{type(request.model.module).__name__} does not have it yet ({where}: draft a "
                                  f"chain, without tree=).")
    return shape


def tree_pricing(tree: TreeShape | None) -> dict:
    """`make_schedule`'s arguments for how a tree's depths fill its verify block: F entries per depth, N at most (the
    adaptive schedule prices a depth-d tree as a block of min(F d, N) + 1 entries), and every probe verified
    (`Schedule.shadow`); none for a chain."""
    if tree is None:
        return {}
    return {"entries_per_draft": tree.branching, "node_budget": tree.nodes if tree.selects else 0, "shadow": False}


def tree_schedule(schedule: Schedule, tree: TreeShape) -> Schedule:
    """A drafter's schedule for drafting trees: its drafts are depths, at most the tree's (`tree_pricing`)."""
    initial = min(schedule.initial, tree.depth)
    if schedule.kind != "adaptive":  # every round drafts the whole tree
        return dataclasses.replace(schedule, initial=initial, **tree_pricing(tree))
    return make_schedule(schedule.kind, initial, tree.depth, schedule.draft_cost, schedule.round_cost,
                         **tree_pricing(tree))


# ------------------------------------------------------------------------------------------------------------------
# Options shared by the drafters that draft with a model, and how they resolve into a draft length and schedule.

ASSISTANT_MODEL = Option("assistant_model", "a model from jaxspec.load that drafts (or a drafter checkpoint)",
                         type=str, flag="--assistant", loads_model=True)
ASSISTANT_TOKENIZER = Option("assistant_tokenizer", "the assistant's tokenizer, when it is not the assistant's own",
                             type=None)
NUM_ASSISTANT_TOKENS = Option("num_assistant_tokens", "drafts per round (the adaptive schedule's most)")
NUM_ASSISTANT_TOKENS_SCHEDULE = Option(
    "num_assistant_tokens_schedule", "draft-length schedule (default: adaptive; constant is transformers' default)",
    type=str, choices=SCHEDULES)
ASSISTANT_CONFIDENCE_THRESHOLD = Option("assistant_confidence_threshold",
                                        "stop drafting when the draft's probability falls below it (0: off)",
                                        type=float)
MAX_ASSISTANT_TOKENS = Option("max_assistant_tokens", "K, the static draft-buffer size")
ASSISTANT_ENSEMBLE_WEIGHT = Option("assistant_ensemble_weight",
                                   "verify against w*target + (1-w)*draft (lossy by design)", type=float)
DRAFT_LENGTH_OPTIONS = (NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS_SCHEDULE, ASSISTANT_CONFIDENCE_THRESHOLD,
                        MAX_ASSISTANT_TOKENS, ASSISTANT_ENSEMBLE_WEIGHT)

# transformers' defaults for the assistant's settings, except the schedule: jaxspec's default is "adaptive", which
# stops drafting while drafts keep being rejected ("constant" is transformers' behaviour).
DRAFT_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "adaptive",
                  "assistant_confidence_threshold": 0.4}
# The static draft-buffer size K of transformers' growing schedules when max_assistant_tokens is not given. It does
# not depend on the assistant's persisted num_assistant_tokens, so repeated calls reuse one compiled loop.
DEFAULT_MAX_ASSISTANT_TOKENS = 16
# The adaptive schedule's K when neither num_assistant_tokens nor max_assistant_tokens is set: verify widths 1, 2, 4
# and 8 (longer blocks rarely pay on a CPU; pass more on accelerators).
DEFAULT_ADAPTIVE_DRAFTS = 7


def draft_length(source_model, request: BuildRequest, draft_cost: float,
                 defaults: dict[str, Any] = DRAFT_DEFAULTS) -> tuple[int, Schedule, float]:
    """(K, schedule, confidence threshold) of a drafter that drafts with a model.

    Each setting comes from the call, else the drafting model's generation_config (the assistant's, or the target's
    own for early exit), as transformers reads it, else `defaults`. `draft_cost`: one draft in target decoding
    steps (the adaptive schedule weighs it)."""
    config = getattr(source_model, "generation_config", {}) or {}
    arguments = request.options

    def pick(name):
        if arguments.get(name) is not None:
            return arguments[name]
        return config[name] if config.get(name) is not None else defaults[name]

    num_tokens, kind, threshold = (pick(name) for name in DRAFT_DEFAULTS)
    explicit = arguments.get("num_assistant_tokens") or config.get("num_assistant_tokens")
    check_positive_int("num_assistant_tokens", num_tokens)
    kind = schedule_kind(kind, SCHEDULES, "this strategy")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be in [0, 1] (0 disables it), got {threshold}.")
    cap = arguments.get("max_assistant_tokens")
    if cap is not None:
        check_positive_int("max_assistant_tokens", cap)
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


def persist_heuristic_length(choice: StrategyChoice, output) -> None:
    """As transformers: the "heuristic" schedule's adapted length carries over to the assistant's next call."""
    if choice.drafter.schedule.kind == "heuristic":
        final = output.drafter_summary["num_assistant_tokens"]
        choice.assistant.generation_config["num_assistant_tokens"] = int(round(float(final.mean())))


def schedule_kind(kind, allowed, where: str) -> str:
    if kind not in allowed:
        raise ValueError(f"Unknown num_assistant_tokens_schedule {kind!r} for {where}; choose one of {allowed}.")
    return kind


def check_assistant(assistant) -> None:
    if not hasattr(assistant, "module") or not hasattr(assistant, "config"):
        raise TypeError("assistant_model must be a model returned by jaxspec.load.")
    if not hasattr(assistant.module, "init_cache"):
        raise TypeError(f"{type(assistant.module).__name__} cannot serve as an assistant model (no KV cache).")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def default_prefill_chunk() -> int:
    """Prompt tokens the target reads per forward: small on CPUs (compute-bound already), larger elsewhere;
    $JAXSPEC_PREFILL_CHUNK (a power of two) overrides it, as `generate_with_drafter(prefill_chunk=)` does for one
    call."""
    return power_of_two_setting("JAXSPEC_PREFILL_CHUNK", 64 if jax.default_backend() == "cpu" else 256)

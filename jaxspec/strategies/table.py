"""The strategy table: every strategy jaxspec runs, one row each, and how a call picks its row.

Each row (a `jaxspec.strategies.spec.Strategy`) is declared in its strategy's own file, next to its drafter: the
argument that selects it, the options it accepts, its builder, and what it persists across calls. `generate()`
validates and dispatches with these rows, `DraftingConfig` accepts exactly their options, and the CLI's
`--strategy` choices and option flags are generated from them.

A call selects a row by the argument that selects it (transformers' rule: `assistant_model`, `prompt_lookup_num_tokens`,
`assistant_early_exit`; jaxspec's `use_mtp`), or names it (`DraftingConfig(strategy=...)`, the CLI's `--strategy`).
The rows selected by `assistant_model` tell from the assistant which one a call is: a Gemma 4 drafter checkpoint,
a DFlash block drafter, an EAGLE-3 head, an assistant with another tokenizer, else a plain assistant. Anything a row
does not accept is an error that names it: nothing is ignored in silence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .dflash import DFLASH
from .draft_model import SPECULATIVE
from .eagle3 import EAGLE3
from .early_exit import EARLY_EXIT
from .gemma4_drafter import MTP_DRAFTER
from .mtp import MTP
from .plain import GREEDY
from .prompt_lookup import PROMPT_LOOKUP
from .spec import BuildRequest, Option, Strategy, StrategyChoice
from .universal import UNIVERSAL

# Plain decoding; model-free drafts; the target's own layers; then the assistant_model rows, most specific first
# (rows that share a selecting argument are tried in this order, and the first that claims the call wins).
STRATEGIES: tuple[Strategy, ...] = (GREEDY, PROMPT_LOOKUP, EARLY_EXIT, MTP, MTP_DRAFTER, DFLASH, EAGLE3, UNIVERSAL,
                                    SPECULATIVE)
BY_NAME: dict[str, Strategy] = {row.name: row for row in STRATEGIES}
# Every strategy option by name (rows share the draft-length options, as the same Option objects).
OPTIONS: dict[str, Option] = {option.name: option for row in STRATEGIES for option in row.options}
_SELECTORS = tuple(dict.fromkeys(row.selected_by for row in STRATEGIES if row.selected_by))


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class DraftingConfig:
    """How a call drafts: a strategy (a row name of STRATEGIES, or None: chosen from the options) and its options,
    with transformers' argument names. `DraftingConfig(assistant_model=draft, num_assistant_tokens=4)`.

    Options left at None are not given (as in `generate`); an unknown name is a TypeError. Options hold models,
    so a config compares and hashes by identity.
    """

    strategy: str | None
    options: Mapping[str, Any]

    def __init__(self, strategy: str | None = None, **options: Any):
        if strategy is not None and strategy not in BY_NAME:
            raise ValueError(f"Unknown strategy {strategy!r}; choose one of {', '.join(BY_NAME)}.")
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"DraftingConfig got unknown option(s) {', '.join(unknown)}; the strategy options are "
                            f"{', '.join(sorted(OPTIONS))}.")
        # use_mtp=False, like None, selects nothing.
        given = {name: value for name, value in options.items() if value is not None and value is not False}
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "options", given)

    def __getattr__(self, name: str) -> Any:
        if name in OPTIONS:
            return self.options.get(name)
        raise AttributeError(name)

    def replace(self, **changes: Any) -> "DraftingConfig":
        """A copy with `changes` (strategy= included) applied."""
        strategy = changes.pop("strategy", self.strategy)
        return DraftingConfig(strategy, **(dict(self.options) | changes))


def choose_strategy(model, drafting: DraftingConfig, *, do_sample: bool, tokenizer: Any = None,
                    prefill_chunk: int | None = None) -> StrategyChoice:
    """The row `drafting` selects, built into a drafter for `model`. Every check runs here, on the host, before
    anything compiles."""
    given = dict(drafting.options)
    triggers = [selector for selector in _SELECTORS if selector in given]
    if len(triggers) > 1:
        # transformers silently lets one win by a fixed precedence; a silent choice hides a mistake, so say it.
        raise ValueError(f"Choose one assisted-decoding strategy; got {triggers}.")
    named = BY_NAME[drafting.strategy] if drafting.strategy is not None else None
    if named is not None and named.selected_by is not None and named.selected_by not in given:
        default = next(o.default for o in named.options if o.name == named.selected_by)
        if default is None:
            raise ValueError(f"strategy {named.name!r} needs {named.selected_by}.")
        given[named.selected_by] = default
    request = BuildRequest(model=model, options=given, do_sample=do_sample, tokenizer=tokenizer,
                           prefill_chunk=prefill_chunk)
    row = _infer(request)
    if named is not None and named is not row:
        raise ValueError(f"strategy {named.name!r} was named, but the arguments select {row.name!r} "
                         f"({row.summary}).")
    unused = sorted(set(given) - row.option_names)
    if unused:
        what = "plain decoding" if row is GREEDY else f"the {row.name} strategy"
        raise ValueError(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by {what}; "
                         "remove it (jaxspec does not ignore arguments in silence).")
    weight = given.get("assistant_ensemble_weight")
    if weight is not None and not 0.0 < weight < 1.0:
        raise ValueError(f"assistant_ensemble_weight must be in the open interval (0, 1), got {weight}. "
                         "Use None for standard (lossless) speculative decoding.")
    return row.build(request)


def _infer(request: BuildRequest) -> Strategy:
    """The row the given options select: plain decoding when none; among rows sharing the selecting argument, the
    first in table order whose `claims` holds (a row without `claims`, last, takes the rest)."""
    for selector in _SELECTORS:
        if selector in request.options:
            rows = [row for row in STRATEGIES if row.selected_by == selector]
            return next(row for row in rows if row.claims is None or row.claims(request))
    return GREEDY

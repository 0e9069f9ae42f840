"""Plain decoding: the K = 0 drafter (jaxspec.strategies.base.Drafter), the row every call falls back to."""

from __future__ import annotations

from .base import Drafter
from .spec import BuildRequest, Strategy, StrategyChoice


def build(request: BuildRequest) -> StrategyChoice:
    return StrategyChoice(GREEDY, Drafter(), label="sample" if request.do_sample else None)


GREEDY = Strategy(
    name="greedy",
    summary="plain decoding, one target forward per token (with --do-sample, or --strategy sample: sampling)",
    selected_by=None,
    options=(),
    build=build,
)

"""The strategies: the drafter interface (base.py), one file per strategy (its drafter and its table row), and the
table that lists them (table.py). See table.py to find any strategy's definition."""

from .base import Draft, Drafter, DraftStep
from .spec import BuildRequest, Option, Strategy, StrategyChoice, default_prefill_chunk
from .table import BY_NAME, OPTIONS, STRATEGIES, DraftingConfig, choose_strategy

__all__ = ["BY_NAME", "OPTIONS", "STRATEGIES", "BuildRequest", "Draft", "Drafter", "DraftStep", "DraftingConfig",
           "Option", "Strategy", "StrategyChoice", "choose_strategy", "default_prefill_chunk"]

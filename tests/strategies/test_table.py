"""The strategy table is the one vocabulary: generate()'s keyword arguments, the config objects, and the CLI's
--strategy choices and option flags all come from its rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxspec
from jaxspec.cli import generate as cli
from jaxspec.settings import SamplingConfig
from jaxspec.strategies import BY_NAME, OPTIONS, STRATEGIES, DraftingConfig
from jaxspec.streaming import StreamingConfig


def test_every_row_is_whole():
    names = [row.name for row in STRATEGIES]
    assert len(set(names)) == len(names)
    for row in STRATEGIES:
        assert row.summary and callable(row.build)
        assert row.selected_by is None or row.selected_by in row.option_names, row.name
    rows_by_selector = {}
    for row in STRATEGIES:
        rows_by_selector.setdefault(row.selected_by, []).append(row)
    for selector, rows in rows_by_selector.items():
        # Rows that share a selecting argument must tell calls apart; exactly one takes what the others leave.
        if selector is not None:
            assert sum(row.claims is None for row in rows) == 1, selector


def test_cli_vocabulary_is_the_table():
    parser_args = cli.parse_args([])
    assert set(cli.STRATEGY_CHOICES) == set(BY_NAME) | {"sample"}
    for option in OPTIONS.values():
        if option.type is not None:  # objects (tokenizers) and use_mtp (implied by --strategy mtp) are not flags
            assert hasattr(parser_args, option.name), option.name
            args = cli.parse_args(_cli_args_for(option))
            assert cli.given_options(args)[option.name] is not None


def _cli_args_for(option):
    row = next(row for row in STRATEGIES if option in row.options)
    value = option.choices[0] if option.choices else "1"
    args = ["--strategy", row.name, option.cli_flag, value]
    selector = OPTIONS.get(row.selected_by)
    if selector is not None and selector is not option and selector.type is not None and selector.default is None:
        args += [selector.cli_flag, "1"]
    return args


def test_cli_names_the_strategy_that_uses_an_option(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--strategy", "mtp", "--assistant", "somewhere"])
    error = capsys.readouterr().err
    assert "--assistant is not used by --strategy mtp" in error and "mtp_drafter" in error
    with pytest.raises(SystemExit):
        cli.parse_args(["--strategy", "early_exit"])
    assert "--strategy early_exit needs --assistant-early-exit" in capsys.readouterr().err


def test_drafting_config_rejects_unknown_names():
    with pytest.raises(TypeError, match="unknown option.*num_asistant_tokens"):
        DraftingConfig(num_asistant_tokens=3)
    with pytest.raises(ValueError, match="Unknown strategy 'lookahead'"):
        DraftingConfig(strategy="lookahead")
    config = DraftingConfig(num_assistant_tokens=3, use_mtp=False, max_matching_ngram_size=None)
    assert config.options == {"num_assistant_tokens": 3}  # False and None select nothing, as in generate()
    assert config.num_assistant_tokens == 3 and config.assistant_model is None


def test_kwargs_and_config_objects_are_one_call(target):
    ids = [[5, 6, 7, 8, 9, 5, 6, 7]]
    by_kwargs = jaxspec.generate(target, ids, max_new_tokens=12, prompt_lookup_num_tokens=3)
    by_objects = jaxspec.generate(target, ids, sampling=SamplingConfig(max_new_tokens=12),
                                  drafting=DraftingConfig(prompt_lookup_num_tokens=3))
    mixed = jaxspec.generate(target, ids, sampling=SamplingConfig(max_new_tokens=12),
                             drafting=DraftingConfig(strategy="prompt_lookup"), prompt_lookup_num_tokens=3)
    assert by_kwargs.strategy == by_objects.strategy == mixed.strategy == "prompt_lookup"
    np.testing.assert_array_equal(by_kwargs.sequences, by_objects.sequences)
    np.testing.assert_array_equal(by_kwargs.sequences, mixed.sequences)
    assert by_kwargs.rounds == by_objects.rounds == mixed.rounds


def test_generate_names_each_mistake(target, draft):
    ids = [[5, 6, 7]]
    with pytest.raises(TypeError, match="'max_new_token' \\(did you mean 'max_new_tokens'\\?\\)"):
        jaxspec.generate(target, ids, max_new_token=4)
    with pytest.raises(ValueError, match="max_new_tokens given both"):
        jaxspec.generate(target, ids, sampling=SamplingConfig(max_new_tokens=4), max_new_tokens=5)
    with pytest.raises(ValueError, match="stop_strings given both"):
        jaxspec.generate(target, ids, max_new_tokens=4, streaming=StreamingConfig(stop_strings="a"), stop_strings="b")
    with pytest.raises(ValueError, match="strategy 'speculative' needs assistant_model"):
        jaxspec.generate(target, ids, max_new_tokens=4, drafting=DraftingConfig(strategy="speculative"))
    with pytest.raises(ValueError, match="strategy 'mtp_drafter' was named, but the arguments select 'speculative'"):
        jaxspec.generate(target, ids, max_new_tokens=4, drafting=DraftingConfig(strategy="mtp_drafter",
                                                                                 assistant_model=draft))


def test_named_strategy_runs_its_row(target, draft):
    ids = [[5, 6, 7, 8]]
    plain = jaxspec.generate(target, ids, max_new_tokens=8)
    named = jaxspec.generate(target, ids, max_new_tokens=8,
                             drafting=DraftingConfig(strategy="speculative", assistant_model=draft))
    assert named.strategy == "speculative" and named.draft_forwards > 0
    np.testing.assert_array_equal(named.sequences, plain.sequences)
    assert jaxspec.generate(target, ids, max_new_tokens=8, do_sample=True).strategy == "sample"


def test_config_objects_are_frozen():
    for config in (SamplingConfig(), StreamingConfig(), DraftingConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.strategy = "x"

"""What the three trainers share: the command lines' run flags, and the drafters shipped for the default model
decoding on the real checkpoint (the slow test; each trainer's own module checks its asset's shapes without it)."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

import jaxspec

TRAINERS = ("train_mtp", "train_dflash", "train_eagle3")


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("flags, named", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    (["--lr", "0"], "--lr must be positive"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--stop-after", "0"], "--stop-after must be >= 1"),
    (["--train-prompts", "0"], "--train-prompts must be >= 1"),
])
def test_every_trainer_names_a_run_flag_it_cannot_use(trainer, flags, named, capsys):
    """One error naming the flag, exit 2, while parsing: before the target loads or anything is timed."""
    cli = importlib.import_module(f"jaxspec.cli.{trainer}")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(flags)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trainer_takes_the_shared_defaults(trainer):
    """The shared flags parse with each trainer's own defaults, and its workdir flag is its own."""
    args = importlib.import_module(f"jaxspec.cli.{trainer}").parse_args([])
    assert args.steps >= 1 and args.lr > 0 and args.warmup == 50 and args.stop_after is None
    assert args.workdir is None and not args.estimate_only


@pytest.mark.slow
@pytest.mark.parametrize("strategy, min_accepted_length", [("mtp", 1.2), ("dflash", 1.2), ("eagle3", 1.3)])
def test_the_default_model_decodes_with_each_shipped_drafter(strategy, min_accepted_length, capsys):
    """`--strategy mtp|dflash|eagle3` runs on the default model with no other step: the drafter shipped for it
    (MTP layers attached by `jaxspec.load`, the others loaded by name) equals plain greedy and accepts drafts."""
    from jaxspec import catalog
    from jaxspec.cli import generate as cli

    try:
        catalog.find_part_files(catalog.get_entry("smollm2-135m"))
    except FileNotFoundError as error:
        pytest.skip(str(error))
    model = jaxspec.load("smollm2-135m")
    if strategy == "mtp":
        assert model.config.num_mtp_layers >= 1 and model.config.draft_vocab_size > 0
        drafting = {"use_mtp": True}
    else:
        drafting = {"assistant_model": jaxspec.load(catalog.shipped_drafter("smollm2-135m", strategy))}
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "How do I sort a list in Python?"}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
    plain = jaxspec.generate(model, [ids], max_new_tokens=48)
    out = jaxspec.generate(model, [ids], max_new_tokens=48, num_assistant_tokens_schedule="constant", **drafting)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.strategy == strategy and out.mean_accepted_length > min_accepted_length, out.mean_accepted_length

    assert cli.main(["--strategy", strategy, "--max-new-tokens", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["strategy"] == strategy

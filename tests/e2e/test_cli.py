"""The generate CLI (jaxspec/cli/generate.py; scripts/generate.py runs it) end to end on a tiny model with a tokenizer:
text, counters and --json output, which names the strategy that ran and counts its drafts."""

from __future__ import annotations

import json

import pytest

from tests.fixtures import hf_models
from tests.fixtures.text import tiny_tokenizer


@pytest.fixture(scope="module")
def cli():
    from jaxspec.cli import generate

    return generate


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = hf_models.save_tiny("llama", tmp_path_factory.mktemp("cli"), seed=0)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def no_compilation_cache(monkeypatch):
    monkeypatch.setenv("JAXSPEC_COMPILATION_CACHE", "off")


@pytest.mark.parametrize("strategy, strategy_args", [
    pytest.param("greedy", [], id="greedy"),
    pytest.param("prompt_lookup", ["--strategy", "prompt_lookup", "--compare-plain"], id="prompt_lookup"),
    # A zero threshold: with the default one the tiny random model's early-exit drafts are all doubted, none proposed;
    # a constant schedule: the adaptive one would probe them in the shadow, verifying none.
    pytest.param("early_exit", ["--strategy", "early_exit", "--assistant-early-exit", "2",
                                "--assistant-confidence-threshold", "0", "--num-assistant-tokens-schedule", "constant"],
                 id="early_exit"),
])
def test_json_output_reports_the_strategy_that_ran(cli, folder, capsys, strategy, strategy_args):
    """--json reports the requested strategy, and a drafting strategy's drafts (prompt lookup finds the prompt's
    repeated bigram; early exit runs its draft forwards): the CLI ran that strategy, not plain decoding."""
    code = cli.main(["--model", folder, "--prompt", "w5 w6 w7 w5 w6", "--max-new-tokens", "6", "--json",
                     *strategy_args])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == strategy
    assert 1 <= len(report["new_ids"]) <= 6 and isinstance(report["text"], str)
    assert report["target_forwards"] >= 1 and "acceptance_rate" in report
    if strategy == "greedy":
        assert sum(report["drafted"]) == 0 and report["draft_forwards"] == 0
    else:
        assert sum(report["drafted"]) > 0
    if strategy == "early_exit":
        assert report["draft_forwards"] > 0
    if "--compare-plain" in strategy_args:
        assert report["same_tokens_as_plain"] is True


def test_text_output_shows_counters(cli, folder, capsys):
    assert cli.main(["--model", folder, "--prompt", "w5 w6", "--max-new-tokens", "4", "--do-sample", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "tok/s" in out and "target forwards" in out
    assert "note:" not in captured.err  # an answer that did not end at once (and no chat template to suggest)
    import bench_compile  # benchmarks/ is on sys.path (pyproject's pythonpath)

    assert bench_compile.CLI_REPORT.search(out), "benchmarks/bench_compile.py no longer reads the CLI's report line"


def test_an_answer_that_ends_at_once_on_a_chat_model_suggests_chat(cli, folder, capsys, tmp_path):
    """An instruct model given a bare prompt may answer end-of-sequence at once, and the run then prints nothing: the
    CLI says why and what to try. The tiny model stands in for one: its first token for the prompt is made its EOS,
    and its tokenizer gets a chat template."""
    import shutil

    assert cli.main(["--model", folder, "--prompt", "w5 w6", "--max-new-tokens", "4", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["new_ids"][0]
    chatty = shutil.copytree(folder, tmp_path / "chatty")
    generation = json.loads((chatty / "generation_config.json").read_text())
    (chatty / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": first}))
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(chatty)

    assert cli.main(["--model", str(chatty), "--prompt", "w5 w6", "--max-new-tokens", "4", "--no-stream"]) == 0
    captured = capsys.readouterr()
    assert "[greedy] 1 tokens" in captured.out
    assert f"note: {chatty} ended its answer at its first token" in captured.err and "--chat" in captured.err


def test_speculative_needs_an_assistant(cli, folder):
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", folder, "--strategy", "speculative"])


def test_dflash_drafts_with_the_shipped_drafter_or_needs_an_assistant(cli, folder, capsys):
    """`--strategy dflash` alone takes the drafter the catalogue ships for the model; a model without one is an
    error that says which models have one."""
    assert cli.parse_args(["--strategy", "dflash"]).assistant_model == "smollm2-135m-dflash"
    assert cli.parse_args(["--strategy", "dflash", "--assistant", "x"]).assistant_model == "x"
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", folder, "--strategy", "dflash"])
    assert "jaxspec ships a DFlash drafter only for smollm2-135m" in capsys.readouterr().err


@pytest.mark.slow  # ~8 s; the default suite runs the eagle3 row through generate()
def test_eagle3_drafts_with_a_head_folder(cli, folder, capsys, tmp_path):
    """`--strategy eagle3 --assistant FOLDER` drafts with the head and matches plain greedy; without --assistant, a
    model jaxspec ships no head for is an error that says so."""
    from tests.fixtures import eagle3 as eagle3_fixtures

    head = eagle3_fixtures.save(eagle3_fixtures.reference(seed=3), tmp_path / "head")
    code = cli.main(["--model", folder, "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--json", "--strategy",
                     "eagle3", "--assistant", head, "--num-assistant-tokens-schedule", "constant", "--compare-plain"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == "eagle3" and sum(report["drafted"]) > 0 and report["same_tokens_as_plain"] is True
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", folder, "--strategy", "eagle3"])
    assert "--strategy eagle3 needs --assistant PATH: jaxspec ships an EAGLE-3 head only for smollm2-135m" in \
        capsys.readouterr().err


def test_assistant_quantization_needs_an_assistant(cli, folder, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", folder, "--strategy", "prompt_lookup", "--assistant-quantization", "int8"])
    assert "--assistant-quantization quantizes the --assistant of a strategy that drafts with one" in capsys.readouterr().err


def test_chat_on_a_model_without_a_chat_template_is_named_before_anything_compiles(cli, folder, capsys):
    from jaxspec import loop

    traced = loop.trace_count()
    assert cli.main(["--model", folder, "--prompt", "w5 w6", "--max-new-tokens", "4", "--chat"]) == 2
    assert f"error: --chat: the tokenizer of {folder} has no chat template" in capsys.readouterr().err
    assert loop.trace_count() == traced

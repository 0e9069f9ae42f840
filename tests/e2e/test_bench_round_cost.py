"""benchmarks/bench_round_cost.py --random-config: a round's cost timed on a target of a config's shape with random
weights, so that a model too large to bring to a lent accelerator can still be timed there (docs/design.md, 'On a
GPU')."""

from __future__ import annotations

import json

import pytest

TINY_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2,
)


def test_random_config_times_rounds_of_that_shape(tmp_path, capsys):
    import bench_round_cost  # benchmarks/ is on sys.path (pyproject's pythonpath)

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    results = tmp_path / "results"
    # --batch rows of a --prompt-tokens prompt: the cache size at which a branch that copied it would show.
    bench_round_cost.main(["--random-config", str(config), "--drafts", "0,1", "--max-draft", "1", "--batch", "3",
                           "--prompt-tokens", "40", "--max-new-tokens", "4", "--repeats", "1", "--results", str(results)])
    printed = capsys.readouterr().out
    title = "random llama (2 layers of 64, config.json), 40-token prompt, 4 new tokens, batch 3, median of 1"
    assert title in printed
    for row in ("| plain decoding | ", "| K=1, 0 draft(s) | ", "| K=1, 1 draft(s) | "):
        assert row in printed, printed
    (record,) = results.iterdir()
    rows = json.loads(record.read_text())["rows"]
    assert [row["round"] for row in rows] == ["plain decoding", "K=1, 0 draft(s)", "K=1, 1 draft(s)"]
    assert all(row["ms"] > 0 for row in rows)


def test_random_config_refuses_an_assistant(tmp_path):
    import bench_round_cost

    with pytest.raises(SystemExit):
        bench_round_cost.main(["--random-config", str(tmp_path / "config.json"), "--assistant", "smollm2-135m"])


def test_prompt_tokens_needs_a_random_config():
    import bench_round_cost

    with pytest.raises(SystemExit):
        bench_round_cost.main(["--prompt-tokens", "40"])


def test_whole_vocab_needs_an_assistant(capsys):
    import bench_round_cost

    with pytest.raises(SystemExit):
        bench_round_cost.main(["--whole-vocab"])
    assert "--whole-vocab times a DFlash --assistant over its whole head" in capsys.readouterr().err


def test_idle_names_the_strategies_it_takes(capsys):
    import bench_round_cost

    with pytest.raises(SystemExit):
        bench_round_cost.main(["--idle", "mtp,lookahead"])
    assert "--idle takes mtp, prompt_lookup, dflash, eagle3, not lookahead" in capsys.readouterr().err


def test_idle_strategies_run_as_bench_batch_runs_them():
    import bench_batch
    import bench_round_cost

    assert set(bench_round_cost.IDLE_STRATEGIES) <= set(bench_batch.STRATEGY_KWARGS)


def test_without_feature_writes_needs_an_idle_feature_drafter(capsys):
    import bench_round_cost

    with pytest.raises(SystemExit):
        bench_round_cost.main(["--idle", "mtp", "--without-feature-writes"])
    assert "--without-feature-writes times the idle loops of dflash and eagle3" in capsys.readouterr().err

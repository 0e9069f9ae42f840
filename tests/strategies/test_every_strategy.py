"""Two properties a drafting strategy must keep, checked on four rows of the strategy table: prompt lookup, early
exit, an assistant model (speculative) and MTP. Universal decoding and the Gemma 4 drafter are not checked here.

- bfloat16 greedy output equals plain greedy: MTP and the assistant in the default suite, prompt lookup and early
  exit in the slow suite only.
- A 2x2 (data, model) mesh gives what one device gives: all four, and trees of prompt lookup and the assistant, in
  the slow suite (the default suite shards plain decoding on a 2x2 mesh in tests/decode/test_generate.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxspec
from tests.fixtures.moe import FAMILIES, save_checkpoint
from tests.fixtures.prompts import PROMPTS

# The users' verify widths, not the suite's two (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_verify_widths")

N = 20
STRATEGIES = {
    "prompt_lookup": dict(prompt_lookup_num_tokens=4),
    "early_exit": dict(assistant_early_exit=2, num_assistant_tokens=3, assistant_confidence_threshold=0.0),
    "speculative": "assistant",
    "mtp": dict(use_mtp=True),
}


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tiny_llama_draft_dir, tmp_path_factory):
    mtp = save_checkpoint("glm4_moe", str(tmp_path_factory.mktemp("glm")), 2, 2, FAMILIES["glm4_moe"], seed=2)
    return {"target": tiny_llama_dir, "draft": tiny_llama_draft_dir, "mtp": mtp}


TREES = {"prompt_lookup_tree": "prompt_lookup", "speculative_tree": "speculative"}  # the same rows, with tree=(6, 3)


def strategy_call(name, folders, dtype):
    """(target, generate kwargs) of a strategy (or a tree of TREES), with models loaded at `dtype`."""
    tree = name in TREES
    name = TREES.get(name, name)
    target = jaxspec.load(folders["mtp" if name == "mtp" else "target"], dtype=dtype)
    kwargs = STRATEGIES[name]
    if kwargs == "assistant":
        kwargs = dict(assistant_model=jaxspec.load(folders["draft"], dtype=dtype), num_assistant_tokens=3,
                      assistant_confidence_threshold=0.0)
    return target, kwargs | (dict(tree=(6, 3)) if tree else {})


# The default suite checks bfloat16 on the two strategies whose drafters run forwards of their own (MTP, an
# assistant); prompt lookup and early exit run in the slow suite.
@pytest.mark.parametrize("name", [name if name == "speculative" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in sorted(STRATEGIES)])
def test_bfloat16_greedy_equals_plain_greedy(folders, name):
    target, kwargs = strategy_call(name, folders, jnp.bfloat16)
    if name != "prompt_lookup":  # every round verifies drafts: the adaptive schedule would probe these random
        kwargs = kwargs | dict(num_assistant_tokens_schedule="constant")  # drafters in the shadow, verifying none
    plain = jaxspec.generate(target, PROMPTS, max_new_tokens=N)
    out = jaxspec.generate(target, PROMPTS, max_new_tokens=N, **kwargs)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.drafted.sum() > 0


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) for name in sorted(STRATEGIES | TREES)])
def test_a_2x2_mesh_equals_one_device(folders, name):
    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    target, kwargs = strategy_call(name, folders, jnp.float32)
    rows = PROMPTS + [[7, 7, 7, 1]]
    single = jaxspec.generate(target, rows, max_new_tokens=N, **kwargs)
    sharded = jaxspec.generate(target, rows, max_new_tokens=N, mesh=mesh, **kwargs)
    np.testing.assert_array_equal(sharded.sequences, single.sequences)
    np.testing.assert_array_equal(sharded.accepted_hist, single.accepted_hist)  # the same rounds, not just output


def mixed_rows(batch: int) -> list[list[int]]:
    """`batch` ragged prompts, alternately copy-heavy (a phrase repeated, so prompt lookup finds matches) and free
    (distinct ids, nothing to copy), of 4 to 14 tokens."""
    rng = np.random.default_rng(batch)
    rows = []
    for b in range(batch):
        if b % 2 == 0:
            phrase = rng.integers(3, 90, size=2 + b % 3).tolist()
            rows.append((phrase * 7)[: 6 + b % 9])
        else:
            rows.append(rng.permutation(np.arange(3, 90))[: 4 + b % 11].tolist())
    return rows


# Batch 8 and 32 for prompt lookup (rows that copy beside rows that cannot) in the default suite; an assistant at 32
# and the other strategies at 8 in the slow suite.
@pytest.mark.parametrize("name, batch", [
    ("prompt_lookup", 8), ("prompt_lookup", 32), pytest.param("speculative", 32, marks=pytest.mark.slow),
    pytest.param("early_exit", 8, marks=pytest.mark.slow), pytest.param("mtp", 8, marks=pytest.mark.slow),
])
def test_mixed_batches_equal_their_rows_alone(folders, name, batch):
    """A batch shares each round's verify block, and its width is chosen for the batch (prompt lookup's adaptive
    schedule; the model drafters verify a constant K): every row must still equal the row decoded alone with plain
    greedy. With prompt lookup, rows that copy draft while rows with nothing to copy
    draft less in the same rounds: every row runs every round until it is done, so different totals are different
    amounts within rounds."""
    target, kwargs = strategy_call(name, folders, jnp.float32)
    if name != "prompt_lookup":  # every round verifies drafts: the adaptive schedule would probe these random
        kwargs = kwargs | dict(num_assistant_tokens_schedule="constant")  # drafters in the shadow, verifying none
    rows = mixed_rows(batch)
    out = jaxspec.generate(target, rows, max_new_tokens=N, **kwargs)
    for b, row in enumerate(rows):
        alone = jaxspec.generate(target, [row], max_new_tokens=N)
        np.testing.assert_array_equal(out.new_tokens(b), alone.new_tokens(0), err_msg=f"row {b}")
    assert out.drafted.sum() > 0
    if name == "prompt_lookup":
        assert len(set(out.drafted.tolist())) > 2 and out.accepted.sum() > 0

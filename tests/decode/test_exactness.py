"""Exact sampling, end to end, and the negative controls that show the check can fail.

The harness: `generate` on a tiny model for many rows of one prompt (each row an independent sample; in equal
batches of BATCH rows, which share one compiled loop), then every new token position against the target's exact
law, enumerated with transformers' own warpers (`oracles.exact_marginals`), by `oracles.goodness_of_fit`. Rows come
from `oracles.rows_for`: enough that any bias of total variation TV = 3% at one position fails the test with
probability `oracles.POWER` = 0.9, at p-values below `oracles.ALPHA` = 1e-3 (each test's docstring gives the
smallest bias it catches).

Sampling settings: temperature 0.5 and top_k 5, where a drafter's raw distribution and the processed one its draft
was drawn from differ a lot, and the exact law of K + 2 = 5 positions needs only 5^4 prefixes.

Each negative control is jaxspec with one line changed (`mutated`: the function's own source, one substring
replaced, compiled in its module's namespace), run through the same harness, which must reject it (a p-value below
TINY) while the unbroken run passes. Controls run at CONTROL_ROWS, fewer rows than the check: their biases are far
larger than TV, and a bias caught at fewer rows is caught with higher probability at more (the Gemma 4 drafter's,
smaller, runs at the check's rows). Compiled loops are keyed by a spec that cannot see a patch, so they are dropped
before and after every broken run.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

import jaxspec
from jaxspec import tree as tree_module
from jaxspec import verify as verify_module
from jaxspec.strategies import draft_model, mtp
from tests.fixtures import hf_models, oracles
from tests.fixtures.patching import replaced

K = 3
PROMPT = [5, 6, 7, 8]
TEMPERATURE, TOP_K = 0.5, 5
TV = 0.03  # the total-variation bias every exactness check here must catch, at any one position
CONTROL_ROWS = 2000
TINY = 1e-9  # a control is rejected when some position's p-value is below this
SAMPLING = dict(max_new_tokens=K + 2, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, eos_token_id=[])
BATCH = 4000  # rows per generate call: a run of 4000 rows stays under 3 GB
CONSTANT = dict(num_assistant_tokens=K, num_assistant_tokens_schedule="constant")


def hf_warpers() -> hf.LogitsProcessorList:
    return hf.LogitsProcessorList([hf.TemperatureLogitsWarper(TEMPERATURE), hf.TopKLogitsWarper(TOP_K)])


# -- the harness ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    sequences: np.ndarray  # [rows, prompt + K + 2]
    accepted_hist: np.ndarray  # [rows, K + 1]


def sample(model, rows: int, seed: int, prompt: list[int] = PROMPT, **kwargs) -> Sample:
    """`rows` independent samples of the prompt's continuation, in equal batches of at most BATCH rows (so one
    compiled loop serves them all), each batch with its own seed. Rows round up to a whole number of batches."""
    batches = -(-rows // BATCH)
    size = -(-rows // batches)
    outs = [jaxspec.generate(model, [prompt] * size, seed=seed * 1000 + i, **kwargs) for i in range(batches)]
    return Sample(np.concatenate([np.asarray(o.sequences) for o in outs]),
                  np.concatenate([np.asarray(o.accepted_hist) for o in outs]))


def p_values(out, exact: np.ndarray, prompt: list[int] = PROMPT) -> list[float]:
    """Each new token position of `out` (one prompt, every row) against its exact law [positions, V]."""
    new = out.sequences[:, len(prompt):]
    return [oracles.goodness_of_fit(new[:, i], exact[i]) for i in range(len(exact))]


def multi_draft_rounds(out) -> int:
    """Rounds in which a row accepted two drafts or more."""
    return int(out.accepted_hist[:, 2:].sum())


def power_note(rows: int, exact: np.ndarray) -> str:
    """The smallest total variation each position's check catches (power `oracles.POWER`) at `rows`."""
    return ", ".join(f"{oracles.detectable_tv(rows, oracles.cells(law, rows)):.4f}" for law in exact)


def assert_exact(out, exact: np.ndarray, rows: int, prompt: list[int] = PROMPT) -> list[float]:
    values = p_values(out, exact, prompt)
    assert min(values) > oracles.ALPHA, (f"p-values {values} at {rows} rows (smallest TV caught per position: "
                                         f"{power_note(rows, exact)})")
    return values


def assert_rejected(out, exact: np.ndarray, prompt: list[int] = PROMPT) -> list[float]:
    values = p_values(out, exact, prompt)
    assert min(values) < TINY, f"the broken sampler passed: p-values {values}"
    return values


# -- breaking jaxspec on purpose -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mutation:
    owner: Any  # a module or a class
    name: str  # the function (or method) on it
    old: str  # a substring of its source
    new: str
    count: int = 1  # how many times `old` occurs: the control fails loudly if the source moved on


def mutated(mutation: Mutation) -> Callable:
    """`owner.name` compiled from its own source with `old` replaced by `new`, in its own module's globals."""
    function = inspect.getattr_static(mutation.owner, mutation.name)
    source = inspect.getsource(function)
    found = source.count(mutation.old)
    assert found == mutation.count, (f"{mutation.name}: expected {mutation.count} occurrence(s) of {mutation.old!r}, "
                                     f"found {found}; update the control")
    first = inspect.getsourcelines(function)[1]  # compiled at its own line numbers, so tracebacks point at it
    code = compile("\n" * (first - 1) + textwrap.dedent(source.replace(mutation.old, mutation.new)),
                   inspect.getsourcefile(function), "exec")
    namespace: dict[str, Any] = {}
    exec(code, function.__globals__, namespace)
    return namespace[mutation.name]


def broken(*mutations: Mutation):
    """jaxspec with the mutations applied; no compiled loop crosses the boundary in either direction."""
    return replaced(*((mutation.owner, mutation.name, mutated(mutation)) for mutation in mutations))


RESIDUAL = "residual = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)"
# Three ways for the sampling verifier to be subtly wrong; greedy decoding never runs it, so each keeps greedy
# invariance.
VERIFY_CONTROLS = {
    # Draft i judged by the target's distribution at position i + 1 (the one that judges draft i + 1).
    "verify_off_by_one": Mutation(verify_module, "speculative_sampling", "target_logits[:, :-1]",
                                  "target_logits[:, 1:]", count=2),
    # The Gumbel draw is scale-invariant, so "not renormalised" must mean something a sampler can do: an inverse-CDF
    # draw from the unnormalised residual max(p - q, 0) whose uniform lands past the residual's mass continues into
    # p. Its law is r + (1 - |r|) p instead of r / |r|.
    "residual_not_renormalised": Mutation(
        verify_module, "speculative_sampling", RESIDUAL,
        "residual = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0)"
        " + (1.0 - jnp.sum(jnp.maximum(p_n - q_n, 0.0), -1, keepdims=True)) * p_n, p_n)"),
    # After a fully accepted block, the bonus token drawn from q (the drafter's last distribution, the only one it
    # has) instead of the target's p at position K + 1.
    "bonus_from_q": Mutation(
        verify_module, "speculative_sampling", RESIDUAL,
        "residual = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), q[rows, jnp.minimum(n, width - 2)])"),
}
# q taken before processing: the drafter's raw softmax, not the processed distribution its draft was drawn from
# (transformers 5.23's Gemma 4 path verifies against raw logits). The draft itself is still drawn from the
# processed distribution. Speculative, early exit and the Gemma 4 drafter share `draft_loop`; MTP has its own.
Q_RAW = Mutation(draft_model.AutoregressiveDrafter, "draft_loop", "q = jax.nn.softmax(processed, axis=-1)",
                 "q = jax.nn.softmax(logits, axis=-1)")
# MTP draws its candidates and their laws in one call (jaxspec.tree.draw_candidates): its `law` hook gives q from the
# raw logits while the drafts still come from the processed ones.
Q_RAW_MTP = Mutation(mtp.MtpDrafter, "draft", "ctx.do_sample,\n" + " " * 44 + "self.keep_probs)",
                     "ctx.do_sample, self.keep_probs, law=lambda _: jax.nn.softmax(logits, axis=-1))")


# -- models --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_target(tiny_llama_dir):
    return hf_models.load_hf(tiny_llama_dir)


@pytest.fixture(scope="module")
def near_assistant(hf_target, tmp_path_factory):
    """`oracles.near_assistant`: here 33% of rounds accept no draft, 28% one, 14% two and 25% all three, so one run
    exercises acceptance, the residual and the bonus token."""
    folder = tmp_path_factory.mktemp("near_assistant")
    oracles.near_assistant(hf_target).save_pretrained(folder)
    return jaxspec.load(str(folder))


@pytest.fixture(scope="module")
def exact(hf_target):
    """[K + 2, V]: the exact law of every new token of a K + 2 budget (the prefill's token, a block of K drafts,
    the bonus token after it)."""
    return oracles.exact_marginals(hf_target, PROMPT, positions=K + 2, processors=hf_warpers())


@pytest.fixture(scope="module")
def rows(exact):
    return oracles.rows_for(TV, exact)


# -- the oracle itself ---------------------------------------------------------------------------------------------


def _merged_then_checked(tokens, probs, min_expected=5.0):
    """goodness_of_fit as it was: probability-0 tokens merged into the rare cell before any check."""
    from scipy import stats

    counts = np.bincount(tokens, minlength=len(probs)).astype(float)
    expected = probs * len(tokens)
    big = expected >= min_expected
    observed_cells = np.append(counts[big], counts[~big].sum())
    expected_cells = np.append(expected[big], expected[~big].sum())
    keep = expected_cells > 0
    assert observed_cells[~keep].sum() == 0
    return float(stats.chisquare(observed_cells[keep], expected_cells[keep]).pvalue)


def test_an_impossible_token_fails_before_cells_are_merged():
    """A token the law never produces, drawn once among 10^4 rows, hid in the merged rare cell: the chi-square passed.
    It must fail, naming the token."""
    probs = np.zeros(128)
    probs[:5] = 0.2 - 1e-4  # five likely tokens
    probs[10:60] = 5 * 1e-4 / 50  # fifty rare ones: together an expected count of 5, one merged cell
    assert probs[7] == 0 and np.isclose(probs.sum(), 1.0)
    tokens = np.random.default_rng(0).choice(128, size=10_000, p=probs / probs.sum())
    tokens[0] = 7
    assert _merged_then_checked(tokens, probs) > 0.01  # the old check: passes
    with pytest.raises(AssertionError, match="token 7 was drawn 1 time"):
        oracles.goodness_of_fit(tokens, probs)
    tokens[0] = 10  # a rare but possible token
    assert oracles.goodness_of_fit(tokens, probs) > 0.01


def test_power_holds_for_the_least_detectable_bias():
    """`rows_needed` promises power 0.9 against every bias of a total variation; the hardest one (mass moved in
    proportion from half of the probability to the other half) is caught that often in simulation, and a bias
    concentrated on one cell far more often."""
    rng = np.random.default_rng(1)
    probs = np.array([0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05])
    half = np.array([1, 0, 1, 0, 0, 0, 0], bool)  # probability 0.5
    tv = 0.03
    hardest = probs + tv * np.where(half, probs / 0.5, -probs / 0.5)
    concentrated = probs + tv * (np.arange(7) == 6) - tv * (np.arange(7) == 0)
    n = oracles.rows_needed(tv, cells=7)
    assert oracles.detectable_tv(n, 7) == pytest.approx(tv, rel=1e-3)

    def caught(law):
        draws = [rng.choice(7, size=n, p=law) for _ in range(400)]
        return np.mean([oracles.goodness_of_fit(d, probs) <= oracles.ALPHA for d in draws])

    assert caught(hardest) >= 0.85  # 0.9 up to simulation noise (sd 0.015) and the chi-square approximation
    assert caught(concentrated) >= 0.99
    assert caught(probs) <= 0.01


def test_exact_marginals_drop_only_impossible_prefixes(hf_target):
    """Extending only prefixes of positive probability gives the full enumeration's marginals."""
    warpers = hf.LogitsProcessorList([hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(3)])
    pruned = oracles.exact_marginals(hf_target, PROMPT, positions=3, processors=warpers)

    @torch.no_grad()
    def full(positions):
        marginals, probs, prefixes = [], np.ones(1), [()]
        for _ in range(positions):
            batch = torch.tensor([PROMPT + list(p) for p in prefixes])
            logits = warpers(batch, hf_target(batch).logits[:, -1]).double()
            joint = probs[:, None] * torch.softmax(logits, -1).numpy()
            marginals.append(joint.sum(0))
            prefixes, probs = [p + (v,) for p in prefixes for v in range(128)], joint.reshape(-1)
        return np.array(marginals)

    np.testing.assert_allclose(pruned, full(3), atol=1e-12)
    assert np.all(np.abs(pruned.sum(-1) - 1) < 1e-9)


# -- speculative sampling, end to end ------------------------------------------------------------------------------


def speculative(target, assistant, rows: int, seed: int) -> Sample:
    return sample(target, rows, seed, assistant_model=assistant, assistant_confidence_threshold=0.0, **CONSTANT,
                  **SAMPLING)


@pytest.mark.usefixtures("users_xla_for_large_batches")
def test_speculative_sampling_is_exact(target, near_assistant, exact, rows):
    """Every position of a K + 2 budget (the prefill's token, a round of K = 3 drafts, the token after it) follows
    the target's exact processed law, with an assistant whose drafts are often accepted, often all of them, and
    often rejected. Rows: what `oracles.rows_for` needs to catch a 3% TV bias at any one position with power 0.9
    at alpha 1e-3 (22,785 here, run as 6 x 3,798): the smallest bias caught is 1.7%, 2.2%, 2.6%, 2.9%, 3.0% at
    positions 0-4 (5, 22, 55, 97, 115 cells)."""
    out = speculative(target, near_assistant, rows, seed=3)
    n, seen, rejected = len(out.sequences), multi_draft_rounds(out), int(out.accepted_hist[:, 0].sum())
    assert seen >= n // 2, f"only {seen} rounds accepted >= 2 drafts, in {n} rows"
    assert rejected >= n // 2, f"only {rejected} rounds rejected the first draft, in {n} rows"  # residual draws
    assert_exact(out, exact, n)


@pytest.mark.usefixtures("users_xla_for_large_batches")
def test_the_bonus_token_after_a_fully_accepted_block_is_exact(target, exact, rows):
    """The target drafting for itself accepts every draft (but for float round-off between its one-token drafting
    forwards and the block forward), so each row's one round is a full block of K = 3 and its last token, position
    K + 1 of the budget, is the bonus token drawn from p after the block. Rows and power as in
    `test_speculative_sampling_is_exact`: a bias of 3% TV in the bonus token's law fails the test (power 0.9)."""
    out = speculative(target, target, rows, seed=4)
    n, full = len(out.sequences), int(out.accepted_hist[:, K].sum())
    assert full >= 0.999 * n, f"only {full} fully accepted blocks in {n} rows"
    assert_exact(out, exact, n)


def test_q_before_processing_is_rejected(target, near_assistant, exact):
    """Negative control: q taken from the assistant's raw logits instead of the processed distribution its draft was
    drawn from (transformers' Gemma 4 bug) fails the check of `test_speculative_sampling_is_exact` (measured:
    p-values down to 1e-195 at 2,000 rows; the unbroken run's smallest is above 0.05)."""
    with broken(Q_RAW):
        out = speculative(target, near_assistant, CONTROL_ROWS, seed=3)
    assert_rejected(out, exact)


@pytest.mark.slow  # three broken loops to compile: about 30 s
@pytest.mark.parametrize("name", sorted(VERIFY_CONTROLS))
def test_a_broken_verifier_is_rejected(target, near_assistant, exact, name):
    """Negative controls of the verifier, each rejected at CONTROL_ROWS by the check of the two tests above: the
    bonus token's control with the target drafting for itself (every row draws a bonus token), the others with the
    near assistant (a residual draw in three rounds of four)."""
    with broken(VERIFY_CONTROLS[name]):
        out = speculative(target, target if name == "bonus_from_q" else near_assistant, CONTROL_ROWS, seed=3)
    assert_rejected(out, exact)


# -- every drafter with a distribution: exact, and rejected with q taken before processing -------------------------


@dataclasses.dataclass
class Harness:
    target: Any
    kwargs: dict  # the strategy's arguments
    exact: np.ndarray  # [K + 2, V] the target's exact law at `temperature`, top_k 5
    temperature: float = TEMPERATURE
    min_multi_draft: float = 0.2  # rounds that accept >= 2 drafts, per row, at least
    control_rows: int | None = CONTROL_ROWS  # None: the check's own rows


def early_exit(tiny_llama_dir, tmp_path_factory) -> Harness:
    """The target's first 3 of 4 layers draft: close enough to it that multi-draft rounds are common."""
    exact = oracles.exact_marginals(hf_models.load_hf(tiny_llama_dir), PROMPT, positions=K + 2,
                                    processors=hf_warpers())
    return Harness(jaxspec.load(tiny_llama_dir),
                   dict(assistant_early_exit=3, assistant_confidence_threshold=0.0, **CONSTANT), exact)


def mtp_layers(tiny_llama_dir, tmp_path_factory) -> Harness:
    """A glm4_moe with K = 3 MTP layers that predict the target well, as trained ones do (random MTP layers are
    never accepted twice in a row, and q then barely matters). The main layers' outputs are zeroed, so the target
    is a bigram model: logits = head(final_norm(embed(t))). Each MTP layer's block outputs are zeroed too, its
    eh_proj passes the token's normed embedding (the identity on that half, zero on the state's half) and its out
    norm is the final norm: it computes the target's logits exactly. Noise of 0.3 / sqrt(2D) on eh_proj then
    makes it a near drafter. The exact law comes from jaxspec's own forward (transformers has no such model)."""
    from tests.fixtures.moe import FAMILIES, save_checkpoint

    model = jaxspec.load(save_checkpoint("glm4_moe", str(tmp_path_factory.mktemp("mtp")), 2, K,
                                         FAMILIES["glm4_moe"], seed=K))
    module = model.module
    for name in ("wo", "w_down", "we_down", "ws_down", "mtp_wo", "mtp_we_down", "mtp_ws_down"):
        param = getattr(module, name)
        param[...] = param[...] * 0.0
    d = module.embed[...].shape[1]
    module.mtp_enorm[...] = jnp.ones_like(module.mtp_enorm[...])
    module.mtp_out_norm[...] = jnp.broadcast_to(module.final_norm[...], module.mtp_out_norm[...].shape)
    noise = np.random.default_rng(0).standard_normal(module.mtp_eh_proj[...].shape) / np.sqrt(2 * d)
    identity = np.concatenate([np.eye(d), np.zeros((d, d))])[None]  # [1, 2D, D]
    module.mtp_eh_proj[...] = jnp.asarray(identity + 0.3 * noise, jnp.float32)

    @jax.jit
    def last_logits(batch):
        positions = jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)
        return module(batch, positions, module.init_cache(batch.shape[0], batch.shape[1]))[0][:, -1]

    exact = oracles.exact_marginals(lambda batch: last_logits(jnp.asarray(batch)), PROMPT, positions=K + 2,
                                    processors=hf_warpers())
    return Harness(model, dict(use_mtp=True, **CONSTANT), exact)


def gemma4_drafter(tiny_llama_dir, tmp_path_factory) -> Harness:
    """The Gemma 4 target and random drafter of tests/strategies/test_gemma4_drafter.py, at temperature 1.5 (top_k 5),
    where the drafter agrees with the target often enough for multi-draft rounds (0.5% of rows). Seldom agreeing,
    q weighs little in the residual: q before processing is a smaller bias here (p-values about 1e-7 at 2,000 rows),
    so its control runs at the check's rows."""
    hf_target = hf_models.build_tiny_gemma("gemma4_text", seed=13)
    hf_target.save_pretrained(target_dir := tmp_path_factory.mktemp("gemma4_target"))
    hf_models.build_tiny_gemma4_assistant(seed=1).save_pretrained(drafter_dir := tmp_path_factory.mktemp("drafter"))
    warpers = hf.LogitsProcessorList([hf.TemperatureLogitsWarper(1.5), hf.TopKLogitsWarper(TOP_K)])
    exact = oracles.exact_marginals(hf_target, PROMPT, positions=K + 2, processors=warpers)
    return Harness(jaxspec.load(str(target_dir)), dict(assistant_model=jaxspec.load(str(drafter_dir)), **CONSTANT),
                   exact, temperature=1.5, min_multi_draft=0.005, control_rows=None)


DRAFTERS = {"early_exit": early_exit, "mtp": mtp_layers, "gemma4_drafter": gemma4_drafter}


@pytest.mark.slow  # per drafter: two loops to compile and two or three runs of ~20,000 rows, 40-90 s
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_is_exact_and_q_before_processing_is_rejected(tiny_llama_dir, tmp_path_factory, name):
    """Each drafter with a distribution: the unbroken strategy passes the check at `oracles.rows_for` rows (3% TV,
    power 0.9, alpha 1e-3: 20,000-24,000 rows), and q taken before processing fails it. (The speculative assistant:
    the default-suite tests above.)"""
    harness = DRAFTERS[name](tiny_llama_dir, tmp_path_factory)
    rows = oracles.rows_for(TV, harness.exact)
    settings = SAMPLING | dict(temperature=harness.temperature)
    out = sample(harness.target, rows, 3, **harness.kwargs, **settings)
    n, seen = len(out.sequences), multi_draft_rounds(out)
    assert seen >= harness.min_multi_draft * n, f"only {seen} rounds accepted >= 2 drafts, in {n} rows"
    assert_exact(out, harness.exact, n)
    with broken(Q_RAW_MTP if name == "mtp" else Q_RAW):
        out = sample(harness.target, harness.control_rows or rows, 3, **harness.kwargs, **settings)
    assert_rejected(out, harness.exact)


# -- trees: recursive rejection sampling in the loop, and the two controls its proof names ------------------------

# Siblings drawn with replacement (independent draws from the step's law, so they may repeat the chain's token or each
# other) but verified with the laws of draws without replacement.
SIBLINGS_WITH_REPLACEMENT = Mutation(
    draft_model.AutoregressiveDrafter, "_alternatives",
    "return jax.lax.top_k(ranked, self.branches)[1].astype(jnp.int32)",
    "return jnp.concatenate([token[:, None], jax.random.categorical(jax.random.fold_in(key, 1), law[:, None, :], "
    "shape=(law.shape[0], self.branches - 1))], axis=1).astype(jnp.int32)")
# The residual left as the target's law after a rejected sibling: the next sibling is judged against p again.
RESIDUAL_NOT_UPDATED = Mutation(tree_module, "verify_tree", "law = jnp.where((exists & ~take)[:, None], residual, law)",
                                "law = law")


@pytest.mark.slow  # per drafter a check at ~23,000 rows (and, for the assistant, two broken runs): 30-60 s
@pytest.mark.parametrize("drafter", ["assistant", "assistant-budget", "eagle3"])
def test_sampled_trees_are_exact_and_the_sibling_controls_are_caught(target, near_assistant, hf_target, exact, rows,
                                                                     tmp_path_factory, drafter):
    """Trees of 3 candidates at each of K = 3 depths (the chain's token and two alternatives drawn without
    replacement from its law), sampled: the output passes the exactness check of the chains above at
    `oracles.rows_for` rows (3% TV, power 0.9, alpha 1e-3). With the near assistant, whose siblings are often what
    the target takes, each of the two mistakes the proof in jaxspec/tree.py names fails the same check: siblings
    drawn with replacement, and the residual not updated after a rejected sibling. The EAGLE-3 head here is random,
    far from the target (its siblings are seldom accepted, so those mistakes barely move its output); it checks that
    its own candidates and laws (`jaxspec.tree.draw_candidates`) are exact. Deterministic siblings (prompt lookup's)
    are checked with both controls on the verifier itself: tests/decode/test_tree.py. "assistant-budget" keeps the 2K
    most probable of the 3K candidates (`jaxspec.tree.select_by_probability`; its control, ranking alternatives by
    the drawn token's own probability, is in tests/decode/test_tree.py)."""
    if drafter.startswith("assistant"):
        kwargs = dict(assistant_model=near_assistant, assistant_confidence_threshold=0.0)
    else:
        from tests.fixtures import eagle3 as eagle3_fixtures

        reference = eagle3_fixtures.reference(seed=3)
        with torch.no_grad():
            reference.embed_tokens.weight.copy_(hf_target.model.embed_tokens.weight)
        kwargs = dict(assistant_model=jaxspec.load(eagle3_fixtures.save(reference, tmp_path_factory.mktemp("e3"))))
    tree = (2 * K, K, 3) if drafter == "assistant-budget" else (3 * K, K)
    kwargs |= dict(tree=tree, num_assistant_tokens_schedule="constant")
    out = sample(target, rows, 3, **kwargs, **SAMPLING)
    n, accepted = len(out.sequences), int((out.accepted_hist[:, 1:] * np.arange(1, K + 1)).sum())
    assert accepted >= (n // 20 if drafter == "eagle3" else n), f"only {accepted} drafts accepted in {n} rows"
    assert_exact(out, exact, n)
    if drafter == "assistant":
        for control in (SIBLINGS_WITH_REPLACEMENT, RESIDUAL_NOT_UPDATED):
            with broken(control):
                out = sample(target, CONTROL_ROWS, 3, **kwargs, **SAMPLING)
            assert_rejected(out, exact)

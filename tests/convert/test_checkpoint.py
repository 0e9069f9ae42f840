"""Conversion folders (orbax checkpoints of converted params): exact round trip, atomic writes, the catalogue cache."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxspec
from jaxspec import catalog, checkpoint, loading, loop
from tests.fixtures import hf_models
from tests.fixtures.paths import REPO_ROOT, SCRIPTS
from tests.fixtures.text import tiny_tokenizer

PROMPT = [[5, 6, 7]]
SCRIPT = os.path.join(SCRIPTS, "convert.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama HF folder with a tokenizer and a generation config beside the weights."""
    folder = hf_models.save_tiny("llama", tmp_path_factory.mktemp("hf"), seed=0, num_hidden_layers=2)
    tiny_tokenizer().save_pretrained(folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 9], "max_new_tokens": 8}, f)
    return folder


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    return checkpoint.save(jaxspec.load(hf_dir, dtype=jnp.float32), tmp_path_factory.mktemp("conv") / "out")


def pure_params(model: jaxspec.Model) -> dict[str, jax.Array]:
    """Every param by its path, e.g. "layers/0/wq"."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.split(model.module)[1]))
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def assert_identical_params(got: jaxspec.Model, expected: jaxspec.Model) -> None:
    got, expected = pure_params(got), pure_params(expected)
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]), err_msg=name)


def refuse_to_convert(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted again instead of restoring")

    monkeypatch.setattr(loading, "convert", fail)


def leftovers(parent) -> list[str]:
    return sorted(name for name in os.listdir(parent) if ".tmp-" in name or ".old-" in name)


def test_round_trip_is_exact_and_generates_the_same(hf_dir, converted, monkeypatch):
    original = jaxspec.load(hf_dir, dtype=jnp.float32)
    refuse_to_convert(monkeypatch)
    restored = jaxspec.load(converted)

    assert_identical_params(restored, original)
    assert restored.config == original.config and restored.hf_config == original.hf_config
    assert restored.generation_config == original.generation_config and restored.eos_token_ids() == (2, 9)
    assert restored.tokenizer("w3 w7 w9")["input_ids"] == original.tokenizer("w3 w7 w9")["input_ids"]
    np.testing.assert_array_equal(
        jaxspec.generate(restored, PROMPT, max_new_tokens=8).sequences,
        jaxspec.generate(original, PROMPT, max_new_tokens=8).sequences,
    )
    with open(os.path.join(converted, checkpoint.MARKER)) as f:
        marker = json.load(f)
    assert marker["format_version"] == checkpoint.FORMAT_VERSION and marker["dtype"] == "float32"
    assert marker["source"] == hf_dir and "jaxspec_version" in marker


def test_restore_builds_the_saved_tokenizer_class_without_auto_tokenizer(hf_dir, converted, monkeypatch, tmp_path):
    """The marker names the tokenizer's class and `restore` builds it directly: `AutoTokenizer` would import torch
    through transformers' model registry wherever torch is installed. A class this transformers lacks leaves the
    choice to `AutoTokenizer` again."""
    import transformers

    expected = transformers.AutoTokenizer.from_pretrained(converted)
    with open(os.path.join(converted, checkpoint.MARKER)) as f:
        assert json.load(f)["tokenizer_class"] == f"{type(expected).__module__}:{type(expected).__qualname__}"
    text = "w3 w7 w9 w120 unknown"
    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", _refuse_auto_tokenizer)
        restored = checkpoint.restore(converted).tokenizer
    assert type(restored) is type(expected) and restored(text)["input_ids"] == expected(text)["input_ids"]
    assert restored.all_special_tokens == expected.all_special_tokens

    moved = shutil.copytree(converted, tmp_path / "moved")
    marker_path = os.path.join(moved, checkpoint.MARKER)
    with open(marker_path) as f:
        marker = json.load(f)
    with open(marker_path, "w") as f:
        json.dump(marker | {"tokenizer_class": "transformers.tokenization_utils_tokenizers:NoSuchTokenizer"}, f)
    assert type(checkpoint.restore(moved).tokenizer) is type(expected)


def _refuse_auto_tokenizer(*args, **kwargs):
    raise AssertionError("AutoTokenizer was asked to choose the tokenizer class")


def test_restoring_imports_no_torch(converted, tmp_path):
    """torch is installed here (the tests' oracle), as in a Colab: restoring a conversion still never imports it.
    A fresh interpreter, since this one has torch loaded."""
    script = "\n".join([
        "import sys",
        "import jaxspec",
        f"model = jaxspec.load({os.fspath(converted)!r})",
        "assert model.tokenizer('w3 w7')['input_ids']",
        "assert 'torch' not in sys.modules, 'torch was imported'",
        "print('ok')",
    ])
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAXSPEC_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_a_converted_model_and_its_restored_copy_compile_to_one_loop(tmp_path, monkeypatch):
    """A model converted in this process holds uncommitted arrays, and the same model restored from its conversion
    folder committed ones; JAX's persistent compilation cache keys the loop on the difference (here through the CPU
    verify head transposed from the tied embedding). Both must lower to the same loop, so that the executables a CLI's
    first run (which converts) leaves in that cache serve the runs after it (which restore): before, SmolLM2's
    prompt lookup compiled for 21 s again on a new prompt instead of loading in 6 s."""
    hf = hf_models.save_tiny("llama", tmp_path / "hf", num_hidden_layers=2, tie_word_embeddings=True)
    converted = jaxspec.load(hf, dtype=jnp.float32)
    restored = jaxspec.load(checkpoint.save(converted, tmp_path / "conv"))
    compile_lowered = jax.stages.Lowered.compile
    lowered = []

    def recording_compile(self, *args, **kwargs):
        lowered.append(self.as_text())
        return compile_lowered(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording_compile)
    modules = []
    for model in (converted, restored):
        loop._compiled.clear()  # lower again: the in-process cache does not tell the two apart
        lowered.clear()
        jaxspec.generate(model, PROMPT, max_new_tokens=4, prompt_lookup_num_tokens=3)
        modules.append(list(lowered))
    assert len(modules[0]) == 2  # the prefill and the rounds
    assert modules[0] == modules[1]


def test_dtype_is_kept_or_cast_on_restore(hf_dir, converted, tmp_path):
    bf16 = checkpoint.save(jaxspec.load(hf_dir, dtype=jnp.bfloat16), tmp_path / "bf16")
    assert jaxspec.load(bf16).dtype == jnp.bfloat16
    assert jaxspec.load(converted).dtype == jnp.float32  # the folder's dtype, not the platform default
    assert_identical_params(jaxspec.load(converted, dtype=jnp.bfloat16), jaxspec.load(bf16))


def test_cli_writes_a_folder_and_needs_force_to_replace(hf_dir, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("convert_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"

    assert script.main([hf_dir, str(out), "--quiet"]) == 0
    assert {"config.json", "jaxspec.json", "params", "tokenizer.json", "generation_config.json"} <= set(
        os.listdir(out))
    first_params = os.stat(out / "params").st_ino
    assert script.main([hf_dir, str(out), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert script.main([hf_dir, str(out), "--quiet", "--force"]) == 0
    assert os.stat(out / "params").st_ino != first_params
    assert leftovers(tmp_path) == []
    assert_identical_params(jaxspec.load(out), jaxspec.load(hf_dir, dtype=jnp.float32))


def test_force_replaces_only_a_conversion(converted, tmp_path):
    model = jaxspec.load(converted)
    out = checkpoint.save(model, tmp_path / "out")
    with pytest.raises(FileExistsError, match="force"):
        checkpoint.save(model, out, source="second")
    checkpoint.save(model, out, source="second", force=True)
    assert checkpoint.read_marker(out)["source"] == "second"
    assert leftovers(tmp_path) == []

    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a jaxspec conversion"):
        checkpoint.save(model, unrelated, force=True)
    assert (unrelated / "notes.txt").read_text() == "keep me"


def _fail_in_orbax_save(monkeypatch):
    def fail(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)


def _fail_after_params(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "marker_for", fail)


def _fail_in_publish(monkeypatch):
    rename = os.rename

    def fail_for_new_folder(src, dst):
        if ".tmp-" in os.fspath(src):
            raise RuntimeError("disk full")
        rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", fail_for_new_folder)


@pytest.mark.parametrize("inject", [_fail_in_orbax_save, _fail_after_params, _fail_in_publish],
                         ids=["orbax-save", "after-params", "publish"])
@pytest.mark.parametrize("replacing", [False, True], ids=["new", "replacing"])
def test_failed_write_leaves_nothing(converted, tmp_path, monkeypatch, inject, replacing):
    model = jaxspec.load(converted)
    out = tmp_path / "out"
    if replacing:
        checkpoint.save(model, out, source="old")
    inject(monkeypatch)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(model, out, force=replacing)
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    if replacing:
        assert checkpoint.read_marker(out)["source"] == "old"
    else:
        assert not out.exists()
        with pytest.raises(FileNotFoundError):
            jaxspec.load(out)


def test_errors_name_the_problem(converted, tmp_path):
    wrong_version = shutil.copytree(converted, tmp_path / "v0")
    with open(wrong_version / checkpoint.MARKER, "w") as f:
        json.dump({"format_version": 0, "dtype": "float32"}, f)
    with pytest.raises(ValueError, match="format version 0"):
        jaxspec.load(wrong_version)

    no_params = shutil.copytree(converted, tmp_path / "no-params")
    shutil.rmtree(no_params / checkpoint.PARAMS_DIR)
    with pytest.raises(FileNotFoundError, match="params"):
        jaxspec.load(no_params)


@pytest.fixture
def fake_catalogue(tmp_path, monkeypatch):
    """A catalogue entry whose GGUF is a tiny llama written by the GGUF tests' writer, and a private cache root."""
    from tests.fixtures.gguf import tiny_model, write_gguf

    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_model("llama", tied=False), gguf_path)
    entry = catalog.CatalogEntry(name="tiny-test", description="", packages=(), part_paths=(),
                                 sha256=catalog.sha256_of(gguf_path), gguf_filename="tiny.gguf", licence="")
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    monkeypatch.setattr(catalog, "resolve", lambda name, cache_dir=None: gguf_path)
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    return entry


def test_catalogue_conversion_is_cached_then_restored(fake_catalogue, tmp_path, monkeypatch):
    folder = tmp_path / "cache" / "converted" / "tiny-test-float32"
    assert checkpoint.cached_folder("tiny-test", jnp.float32) == str(folder)

    first = jaxspec.load("tiny-test", dtype=jnp.float32)
    assert checkpoint.is_converted(folder) and leftovers(folder.parent) == []
    with monkeypatch.context() as patch:
        refuse_to_convert(patch)
        second = jaxspec.load("tiny-test", dtype=jnp.float32)
    assert_identical_params(second, first)
    assert second.tokenizer.encode("ab cd") == first.tokenizer.encode("ab cd")

    # A changed catalogue entry (new pinned file) invalidates the cached conversion.
    monkeypatch.setitem(catalog.CATALOG, "tiny-test", dataclasses.replace(fake_catalogue, sha256="0" * 64))
    jaxspec.load("tiny-test", dtype=jnp.float32)
    assert checkpoint.read_marker(folder)["source"] == "catalog:tiny-test@sha256:" + "0" * 64


def test_an_older_cached_conversion_gets_its_tokenizer_class(fake_catalogue, tmp_path, monkeypatch):
    """A cached conversion stays current until jaxspec's version changes: one whose marker predates the tokenizer's
    class gets it on its next load, and the loads after that build the tokenizer without AutoTokenizer."""
    import transformers

    folder = tmp_path / "cache" / "converted" / "tiny-test-float32"
    jaxspec.load("tiny-test", dtype=jnp.float32)
    marker = checkpoint.read_marker(folder)
    saved_class = marker.pop("tokenizer_class")
    with open(folder / checkpoint.MARKER, "w") as f:
        json.dump(marker, f)
    refuse_to_convert(monkeypatch)
    jaxspec.load("tiny-test", dtype=jnp.float32)
    assert checkpoint.read_marker(folder) == marker | {"tokenizer_class": saved_class}
    assert not os.path.exists(folder / f"{checkpoint.MARKER}.tmp")  # written aside, then moved over the marker
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _refuse_auto_tokenizer)
    assert jaxspec.load("tiny-test", dtype=jnp.float32).tokenizer.encode("ab cd")


def test_unwritable_cache_still_loads(fake_catalogue, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("JAXSPEC_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="could not cache"):
        model = jaxspec.load("tiny-test", dtype=jnp.float32)
    assert model.config.num_layers == 2

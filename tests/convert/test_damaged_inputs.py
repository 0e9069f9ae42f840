"""Damaged checkpoints (issue 35): every loader refuses a cut, empty, garbled or incomplete input with ONE error that
names the file and what is wrong in it, raised by `jaxspec.load` (before anything compiles), of a type the command
lines report as one `error: ...` line with exit status 2 instead of a traceback.

Each row of `CASES` damages a copy of a good input of one kind (a GGUF file, an HF folder with one safetensors file,
a sharded HF folder, a conversion folder, an FP8 checkpoint, a Gemma 4 drafter, a catalogue model's MTP asset); the
good inputs themselves load (`test_undamaged_inputs_load`), so every failure below comes from the damage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec import catalog, checkpoint
from jaxspec.cli import convert as convert_cli
from jaxspec.cli import generate as generate_cli
from jaxspec.convert.errors import CheckpointError
from jaxspec.convert.rules import CheckpointMismatch
from tests.fixtures import hf_models
from tests.fixtures.fp8 import write_fp8_pair
from tests.fixtures.gguf import tiny_model, write_gguf
from tests.fixtures.text import tiny_tokenizer

CATALOGUE_NAME = "tiny-damage-test"  # a catalogue entry (monkeypatched in) whose GGUF carries an MTP asset
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------------------------
# Good inputs, one per kind, built once


def _write_sharded(hf_folder: str, folder: str) -> str:
    """`hf_folder` with its weights split over two shards and an index, as `save_pretrained` shards big models."""
    shutil.copytree(hf_folder, folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    halves = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2:]}
    for shard, shard_names in halves.items():
        save_file({name: tensors[name] for name in shard_names}, os.path.join(folder, shard), metadata={"format": "pt"})
    weight_map = {name: shard for shard, shard_names in halves.items() for name in shard_names}
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f)
    return folder


def _write_mtp_asset(gguf_path: str, folder: str) -> str:
    """An MTP asset for the GGUF's model (jaxspec/assets' layout): one random MTP layer and a 16-token draft vocab."""
    from jaxspec.convert.gguf import read_gguf
    from jaxspec.convert.llama import mtp_hf_tensors
    from jaxspec.models.llama import LlamaConfig, mtp_layer_shapes

    added = {"num_nextn_predict_layers": 1, "draft_vocab_size": 16}
    cfg = LlamaConfig.from_hf_config(read_gguf(gguf_path).hf_config | added)
    rng = np.random.default_rng(0)
    layer = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in mtp_layer_shapes(cfg).items()}
    tensors = mtp_hf_tensors(cfg, {0: layer}, draft_vocab=np.arange(16) * 3)
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"base": CATALOGUE_NAME} | added, f)
    return folder


def build_good_inputs(root) -> dict[str, str]:
    """kind -> an undamaged input of that kind (a file or a folder), written under `root`."""
    hf = hf_models.save_tiny("llama", root / "hf", seed=0, num_hidden_layers=2)
    tiny_tokenizer().save_pretrained(hf)
    with open(os.path.join(hf, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2}, f)
    gguf_path = str(root / "tiny.gguf")
    write_gguf(tiny_model("llama", tied=False), gguf_path)
    fp8, _ = write_fp8_pair(str(root / "fp8"), n_layers=2, n_mtp=0)
    drafter = str(root / "drafter")
    hf_models.build_tiny_gemma4_assistant(seed=0).save_pretrained(drafter)
    return {
        "gguf": gguf_path,
        "hf": hf,
        "sharded": _write_sharded(hf, str(root / "sharded")),
        "converted": checkpoint.save(jaxspec.load(hf, dtype=jnp.float32), root / "converted"),
        "fp8": fp8,
        "drafter": drafter,
        "asset": _write_mtp_asset(gguf_path, str(root / "asset")),
    }


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, str]:
    return build_good_inputs(tmp_path_factory.mktemp("good"))


@pytest.fixture(scope="module")
def catalogue_cache(tmp_path_factory) -> str:
    """One conversion cache for the module: the catalogue GGUF is converted once, then restored."""
    return str(tmp_path_factory.mktemp("cache"))


def _copy(src: str, dst: str) -> str:
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


def prepare(kind: str, good: dict[str, str], tmp_path, monkeypatch, catalogue_cache: str) -> tuple[str, str]:
    """(copy of the good input of `kind` to damage, what `jaxspec.load` is given). An MTP asset is loaded through
    a catalogue entry that names it, as shipped assets are."""
    copy = _copy(good[kind], str(tmp_path / os.path.basename(good[kind])))
    if kind != "asset":
        return copy, copy
    entry = catalog.CatalogEntry(name=CATALOGUE_NAME, description="", packages=(), part_paths=(),
                                 sha256=catalog.sha256_of(good["gguf"]), gguf_filename="tiny.gguf", licence="",
                                 mtp_asset=copy)  # an absolute path: asset_folder() joins it unchanged
    monkeypatch.setitem(catalog.CATALOG, CATALOGUE_NAME, entry)
    monkeypatch.setattr(catalog, "resolve", lambda name, cache_dir=None: good["gguf"])
    monkeypatch.setenv("JAXSPEC_CACHE", catalogue_cache)
    return copy, CATALOGUE_NAME


# ----------------------------------------------------------------------------------------------------------------
# Damage: each returns a function of the copy's root (the file itself for a GGUF, else the folder)


def _at(root: str, rel: str) -> str:
    return os.path.join(root, rel) if rel else root


def replace_with(rel: str, data: bytes):
    def damage(root):
        with open(_at(root, rel), "wb") as f:
            f.write(data)
    return damage


def overwrite(rel: str, offset: int, data: bytes):
    def damage(root):
        with open(_at(root, rel), "r+b") as f:
            f.seek(offset)
            f.write(data)
    return damage


def cut(rel: str, keep: float | int):
    """Keep the first `keep` bytes (an int) or that fraction of the file (a float)."""
    def damage(root):
        path = _at(root, rel)
        size = os.path.getsize(path)
        os.truncate(path, keep if isinstance(keep, int) else int(size * keep))
    return damage


def remove(rel: str):
    def damage(root):
        path = _at(root, rel)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return damage


def edit_json(rel: str, edit):
    """Rewrite a JSON file with `edit(data)` applied (in place) to its content."""
    def damage(root):
        path = _at(root, rel)
        with open(path) as f:
            data = json.load(f)
        edit(data)
        with open(path, "w") as f:
            json.dump(data, f)
    return damage


def without(*keys):
    """An `edit_json` edit deleting a (nested) key."""
    def edit(data):
        for key in keys[:-1]:
            data = data[key]
        del data[keys[-1]]
    return edit


def setting(key, value):
    def edit(data):
        data[key] = value
    return edit


def edit_header(rel: str, edit):
    """Rewrite a safetensors file's JSON header with `edit(header)` applied; the tensor bytes stay as they were."""
    def damage(root):
        path = _at(root, rel)
        with open(path, "rb") as f:
            raw = f.read()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        edit(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return damage


def set_field(tensor: str, field: str, value):
    def edit(header):
        header[tensor][field] = value
    return edit


def drop_tensor(tensor: str):
    def edit(header):
        del header[tensor]
    return edit


def shift_offsets(tensor: str, by: int):
    """The tensor's byte range moved `by` bytes on: the right length, but past the end of the file."""
    def edit(header):
        header[tensor]["data_offsets"] = [offset + by for offset in header[tensor]["data_offsets"]]
    return edit


def flatten_shape(tensor: str):
    """[a, b] -> [a * b, 1]: the same bytes under a wrong shape."""
    def edit(header):
        a, b = header[tensor]["shape"]
        header[tensor]["shape"] = [a * b, 1]
    return edit


def move_to_other_shard(tensor: str):
    def edit(index):
        index["weight_map"][tensor] = SHARDS[0] if index["weight_map"][tensor] == SHARDS[1] else SHARDS[1]
    return edit


def cut_params_data(root):
    """Cut in half the largest data file of the conversion's orbax checkpoint."""
    files = [os.path.join(d, name) for d, _, names in os.walk(os.path.join(root, "params")) for name in names]
    largest = max(files, key=os.path.getsize)
    os.truncate(largest, os.path.getsize(largest) // 2)


ST = "model.safetensors"
SCALE = "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"  # an FP8 block scale of the tiny DeepSeek-V3

# (kind, id, damage, expected exception, regex its message must match: the damaged file and the problem)
CASES = [
    # GGUF file
    ("gguf", "empty", replace_with("", b""), CheckpointError, r"tiny\.gguf: empty file"),
    ("gguf", "bad-magic", overwrite("", 0, b"GGML"), CheckpointError, r"tiny\.gguf: not a GGUF file: it starts with"),
    ("gguf", "cut-in-half", cut("", 0.5), CheckpointError, r"tiny\.gguf: GGUF file is truncated or damaged"),
    ("gguf", "cut-in-metadata", cut("", 200), CheckpointError, r"tiny\.gguf: GGUF file is truncated or damaged"),
    ("gguf", "unknown-version", overwrite("", 4, struct.pack("<I", 99)), CheckpointError,
     r"tiny\.gguf: damaged GGUF header: .*version 99"),
    # HF folder, one safetensors file
    ("hf", "weights-empty", replace_with(ST, b""), CheckpointError, r"hf/model\.safetensors: empty file"),
    ("hf", "weights-random-bytes", replace_with(ST, np.random.default_rng(0).bytes(4096)), CheckpointError,
     r"hf/model\.safetensors: header length \d+ does not fit in the file \(4096 bytes\)"),
    ("hf", "weights-header-not-an-object", replace_with(ST, struct.pack("<Q", 8) + b"[1, 2]  "), CheckpointError,
     r"hf/model\.safetensors: safetensors header is a JSON list, not an object"),
    ("hf", "weights-header-not-json", overwrite(ST, 8, b"\xff\xfe{{"), CheckpointError,
     r"hf/model\.safetensors: safetensors header is not valid JSON"),
    ("hf", "weights-cut-in-half", cut(ST, 0.5), CheckpointError,
     r"hf/model\.safetensors: file is truncated: it has \d+ bytes"),
    ("hf", "weights-unknown-dtype", edit_header(ST, set_field("model.norm.weight", "dtype", "F7")), CheckpointError,
     r"hf/model\.safetensors: tensor 'model\.norm\.weight' has dtype 'F7', which is not a safetensors dtype"),
    ("hf", "weights-wrong-dtype", edit_header(ST, set_field("model.norm.weight", "dtype", "F16")), CheckpointError,
     r"hf/model\.safetensors: tensor 'model\.norm\.weight' spans 128 bytes, but a F16 tensor of shape \[32\] "
     r"takes 64"),
    ("hf", "weights-offsets-past-end", edit_header(ST, shift_offsets("model.norm.weight", 1 << 20)),
     CheckpointError, r"hf/model\.safetensors: file is truncated: .*1 tensor\(s\) lie past the end: "
     r"\['model\.norm\.weight'\]"),
    ("hf", "weights-shape-garbled", edit_header(ST, set_field("model.norm.weight", "shape", None)),
     CheckpointError, r"hf/model\.safetensors: tensor 'model\.norm\.weight' has shape None"),
    ("hf", "weights-entry-incomplete", edit_header(ST, lambda h: h["model.norm.weight"].pop("data_offsets")),
     CheckpointError, r"hf/model\.safetensors: header entry of tensor 'model\.norm\.weight' needs dtype, shape "
     r"and data_offsets"),
    ("hf", "missing-tensor", edit_header(ST, drop_tensor("model.layers.1.mlp.up_proj.weight")), CheckpointMismatch,
     r"/hf: Checkpoint does not match its config: missing tensors for \['model\.layers\.1\.mlp\.up_proj\.weight'\]"),
    ("hf", "weights-missing", remove(ST), FileNotFoundError, r"hf has neither model\.safetensors nor"),
    ("hf", "config-not-json", replace_with("config.json", b'{"model_type": "llama",'), CheckpointError,
     r"hf/config\.json: not valid JSON"),
    ("hf", "config-not-an-object", replace_with("config.json", b"[1, 2]"), CheckpointError,
     r"hf/config\.json: expected a JSON object, found a JSON list"),
    ("hf", "config-missing-key", edit_json("config.json", without("num_attention_heads")), CheckpointError,
     r"hf/config\.json: required key 'num_attention_heads' is missing \(model_type 'llama' needs it\)"),
    ("hf", "config-missing-model-type", edit_json("config.json", without("model_type")), ValueError,
     r"hf/config\.json: config has no `model_type`"),
    ("hf", "tokenizer-not-json", cut("tokenizer.json", 0.5), CheckpointError, r"hf/tokenizer\.json: not valid JSON"),
    ("hf", "generation-config-not-json", replace_with("generation_config.json", b"{"), CheckpointError,
     r"hf/generation_config\.json: not valid JSON"),
    # HF folder sharded by an index
    ("sharded", "index-not-json", cut(INDEX, 0.5), CheckpointError, r"sharded/model\.safetensors\.index\.json: not "
     r"valid JSON"),
    ("sharded", "index-without-weight-map", edit_json(INDEX, without("weight_map")), CheckpointError,
     r"sharded/model\.safetensors\.index\.json: no \"weight_map\""),
    ("sharded", "index-weight-map-not-a-map", edit_json(INDEX, setting("weight_map", [SHARDS[0]])), CheckpointError,
     r"sharded/model\.safetensors\.index\.json: \"weight_map\" must map tensor names to shard file names"),
    ("sharded", "shard-missing", remove(SHARDS[1]), FileNotFoundError,
     r"sharded/model\.safetensors\.index\.json names shard files that are not in .*model-00002-of-00002"),
    ("sharded", "index-names-wrong-shard", edit_json(INDEX, move_to_other_shard("model.norm.weight")),
     CheckpointError, r"sharded/model\.safetensors\.index\.json places tensors in shards that do not hold them: "
     r"\['model\.norm\.weight \(in model-0000\d-of-00002\.safetensors\)'\]"),
    ("sharded", "shard-cut", cut(SHARDS[1], 0.5), CheckpointError,
     r"sharded/model-00002-of-00002\.safetensors: file is truncated"),
    # Conversion folder (orbax checkpoint of converted params)
    ("converted", "marker-not-json", cut("jaxspec.json", 0.5), CheckpointError,
     r"converted/jaxspec\.json: not valid JSON .*not a readable conversion marker"),
    ("converted", "marker-without-dtype", edit_json("jaxspec.json", without("dtype")), CheckpointError,
     r"converted/jaxspec\.json: \"dtype\" is None, not a dtype name"),
    ("converted", "params-missing", remove("params"), FileNotFoundError,
     r"converted has a jaxspec\.json marker but no params/ folder"),
    ("converted", "params-data-cut", cut_params_data, CheckpointError,
     r"converted/params: the saved params are damaged \(\S+ has \d+ bytes, \d+ when written\)"),
    ("converted", "params-metadata-missing", remove("params/_METADATA"), CheckpointError,
     r"converted/params: the saved params are damaged \(_METADATA is missing\)"),
    ("converted", "config-edited", edit_json("config.json", setting("intermediate_size", 128)), CheckpointError,
     r"converted/params does not hold the params that config\.json describes: mis-shaped "
     r"\['layers/0/w_down: stored \(64, 32\), expected \(128, 32\)'"),
    ("converted", "config-missing-key", edit_json("config.json", without("hidden_size")), CheckpointError,
     r"converted/config\.json: required key 'hidden_size' is missing"),
    ("converted", "config-not-json", replace_with("config.json", b"\x00\x01"), CheckpointError,
     r"converted/config\.json: not valid JSON"),
    # FP8 block-scaled checkpoint
    ("fp8", "scale-missing", edit_header(ST, drop_tensor(SCALE)), CheckpointMismatch,
     r"/fp8: FP8 checkpoint does not match its quantization_config: fp8 weights without a _scale_inv tensor: "
     r"\['model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight'\]"),
    ("fp8", "scale-wrong-shape", edit_header(ST, flatten_shape(SCALE)), CheckpointMismatch,
     r"/fp8: FP8 checkpoint does not match its quantization_config: .*scales of the wrong shape: "
     r"\['model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight_scale_inv: \(6, 1\)"),
    ("fp8", "block-size-missing", edit_json("config.json", without("quantization_config", "weight_block_size")),
     NotImplementedError, r"fp8/config\.json: fp8 checkpoints without weight_block_size"),
    ("fp8", "block-size-garbled", edit_json("config.json", lambda c: c["quantization_config"].update(
        weight_block_size=[0, "24"])), CheckpointError,
     r"fp8/config\.json: quantization_config\.weight_block_size must be two positive integers"),
    ("fp8", "weights-cut", cut(ST, 0.7), CheckpointError, r"fp8/model\.safetensors: file is truncated"),
    # Gemma 4 drafter (assistant) checkpoint
    ("drafter", "missing-tensor", edit_header(ST, drop_tensor("pre_projection.weight")), CheckpointMismatch,
     r"/drafter: Checkpoint does not match its config: missing tensors for \['pre_projection\.weight'\]"),
    ("drafter", "config-missing-key", edit_json("config.json", without("text_config", "num_hidden_layers")),
     CheckpointError,
     r"drafter/config\.json: required key 'num_hidden_layers' is missing \(model_type 'gemma4_assistant'"),
    ("drafter", "weights-cut", cut(ST, 0.5), CheckpointError, r"drafter/model\.safetensors: file is truncated"),
    # MTP asset of a catalogue model (jaxspec/assets layout)
    ("asset", "config-not-json", replace_with("config.json", b"num_nextn_predict_layers: 1"), CheckpointError,
     r"asset/config\.json: not valid JSON"),
    ("asset", "config-missing-key", edit_json("config.json", without("num_nextn_predict_layers")), CheckpointError,
     r"asset/config\.json: \"num_nextn_predict_layers\" must be a positive integer .*got None"),
    ("asset", "weights-missing", remove(ST), FileNotFoundError, r"MTP asset .*asset of catalogue model "
     r"'tiny-damage-test' has no model\.safetensors"),
    ("asset", "weights-cut", cut(ST, 0.5), CheckpointError, r"asset/model\.safetensors: file is truncated"),
    ("asset", "missing-tensor", edit_header(ST, drop_tensor("model.layers.2.enorm.weight")), CheckpointMismatch,
     r"asset/model\.safetensors: MTP layers: config\.json sets num_nextn_predict_layers=1 .*missing tensors for "
     r"\['model\.layers\.2\.enorm\.weight'\]"),
]


@pytest.fixture
def no_compiling(monkeypatch):
    """A damaged input must be refused by `jaxspec.load`: generating (compiling) is a failure of the test."""
    def fail(*args, **kwargs):
        raise AssertionError("generate() was reached: the damage was not reported at load")

    monkeypatch.setattr(jaxspec, "generate", fail)


def assert_one_error_line(err: str, match: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(match, lines[0]), (match, lines[0])


@pytest.mark.parametrize(("kind", "damage", "error", "match"), [case[:1] + case[2:] for case in CASES],
                         ids=[f"{case[0]}-{case[1]}" for case in CASES])
def test_damaged_input_gives_one_clear_error(kind, damage, error, match, good, catalogue_cache, tmp_path,
                                             monkeypatch, capsys, no_compiling):
    root, name = prepare(kind, good, tmp_path, monkeypatch, catalogue_cache)
    damage(root)
    with pytest.raises(error, match=match) as info:
        jaxspec.load(name, dtype=jnp.float32)
    assert isinstance(info.value, (ValueError, FileNotFoundError, NotImplementedError))  # what the CLIs report
    assert "\n" not in str(info.value)
    capsys.readouterr()

    assert generate_cli.main(["--model", name, "--max-new-tokens", "2", "--dtype", "float32"]) == 2
    assert_one_error_line(capsys.readouterr().err, match)


@pytest.mark.parametrize("kind", ["gguf", "hf", "sharded", "converted", "fp8", "drafter", "asset"])
def test_undamaged_inputs_load(kind, good, catalogue_cache, tmp_path, monkeypatch):
    """The same inputs, undamaged (copied the same way), load: the errors above come from the damage alone."""
    _, name = prepare(kind, good, tmp_path, monkeypatch, catalogue_cache)
    model = jaxspec.load(name, dtype=jnp.float32)
    expected_vocab = {"gguf": 64, "asset": 64}.get(kind, 128)
    assert model.config.vocab_size == expected_vocab
    if kind == "asset":
        assert model.config.num_mtp_layers == 1 and model.config.draft_vocab_size == 16
    if kind in ("hf", "sharded", "converted"):
        assert model.tokenizer is not None and model.generation_config["eos_token_id"] in (2, [2])


def test_sharded_and_single_file_folders_hold_the_same_params(good):
    single, sharded = jaxspec.load(good["hf"], dtype=jnp.float32), jaxspec.load(good["sharded"], dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(nnx.state(single.module)), jax.tree.leaves(nnx.state(sharded.module)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(("kind", "damage", "match"), [
    ("gguf", cut("", 0.5), r"tiny\.gguf: GGUF file is truncated or damaged"),
    ("hf", edit_json("config.json", without("num_attention_heads")), r"hf/config\.json: required key "
     r"'num_attention_heads' is missing"),
    ("hf", replace_with(ST, np.random.default_rng(1).bytes(64)), r"hf/model\.safetensors: header length"),
], ids=["gguf-cut", "config-missing-key", "weights-random-bytes"])
def test_convert_cli_reports_one_error_line(kind, damage, match, good, catalogue_cache, tmp_path, monkeypatch,
                                            capsys):
    root, name = prepare(kind, good, tmp_path, monkeypatch, catalogue_cache)
    damage(root)
    out = tmp_path / "out"
    assert convert_cli.main([name, str(out), "--quiet"]) == 2
    assert_one_error_line(capsys.readouterr().err, match)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("out.")]


def test_convert_cli_reports_an_existing_out_in_one_line(good, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert convert_cli.main([good["gguf"], str(out), "--quiet"]) == 2
    assert_one_error_line(capsys.readouterr().err, r"out already exists; pass --force")


def test_a_conversion_marker_lists_its_params_files(good):
    """What `check_params_files` compares against: every file under params/ with its size, as written."""
    marker = checkpoint.read_marker(good["converted"])
    params = os.path.join(good["converted"], checkpoint.PARAMS_DIR)
    assert marker["params_files"] == checkpoint.params_files(params) and "_METADATA" in marker["params_files"]


def test_a_marker_written_before_params_files_still_restores(good, tmp_path):
    folder = _copy(good["converted"], str(tmp_path / "old"))
    edit_json(checkpoint.MARKER, without("params_files"))(folder)
    assert jaxspec.load(folder).config == jaxspec.load(good["converted"]).config


def test_catalogue_model_with_a_damaged_asset_fails_before_converting(good, tmp_path, monkeypatch):
    from jaxspec import loading

    root, name = prepare("asset", good, tmp_path, monkeypatch, str(tmp_path / "fresh-cache"))
    edit_json("config.json", without("num_nextn_predict_layers"))(root)

    def fail(*args, **kwargs):
        raise AssertionError("converted the target before checking its asset")

    monkeypatch.setattr(loading, "convert", fail)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        jaxspec.load(name, dtype=jnp.float32)


def test_a_damaged_tokenizer_is_named_only_when_loading_fails(good, tmp_path, monkeypatch):
    """A tokenizer that loads is not parsed again; one that fails to load is reported by the file that is damaged
    (`hf-tokenizer-not-json` above), and an error from files that parse is left as transformers raised it."""
    from jaxspec import tokenizer

    folder = _copy(good["hf"], str(tmp_path / "hf"))
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "read_json_object", lambda path: pytest.fail(f"parsed {path} again"))
        assert tokenizer.load_tokenizer(folder)("w3 w7")["input_ids"] == [7, 11]
    edit_json("tokenizer.json", setting("model", {"type": "NoSuchModel"}))(folder)
    with pytest.raises(Exception, match="did not match any variant") as info:  # the tokenizers library's own
        tokenizer.load_tokenizer(folder)
    assert not isinstance(info.value, CheckpointError)

"""FP8 block-scaled checkpoints (DeepSeek-V3/R1 layout): a tiny random DeepSeek-V3 with an MTP layer is quantized
to float8_e4m3fn with float32 `weight_scale_inv` blocks (a block size that leaves partial edge blocks), next to its
dequantized float32 twin, an ordinary HF checkpoint that transformers loads. jaxspec must read the FP8 folder into
exactly the twin's params, generate what transformers generates from the twin, and read any box of it (a device's
shard) exactly."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh
from safetensors.torch import save_file

import jaxspec
from jaxspec.convert.deepseek_v3 import deinterleave_order
from jaxspec.convert.fp8 import SCALE_SUFFIX, DequantizedSource, Fp8BlockQuantization, quantize
from jaxspec.convert.rules import CheckpointMismatch, Layout, merge_heads_out, split_head_bias, split_heads, transposed
from tests.fixtures.fp8 import BLOCK, N_LAYERS, N_MTP, write_fp8_pair
from tests.fixtures.moe import HF_CLASSES, read_tensors
from tests.fixtures.prompts import PROMPTS, left_padded

N = 20


def params_of(model) -> dict[str, np.ndarray]:
    return {name: np.asarray(v) for name, v in nnx.to_pure_dict(nnx.state(model.module)).items()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_fp8_pair(str(tmp_path_factory.mktemp("fp8")))


@pytest.fixture(scope="module")
def fp8_model(pair):
    return jaxspec.load(pair[0], dtype=jnp.float32)


def test_fp8_checkpoint_reads_as_its_dequantized_twin(pair, fp8_model):
    fp8_folder, twin_folder = pair
    with open(os.path.join(fp8_folder, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {e["dtype"] for n, e in header.items() if n != "__metadata__"} == {"F8_E4M3", "F32", "BF16"}
    assert any(n.startswith(f"model.layers.{N_LAYERS}.") and n.endswith(SCALE_SUFFIX) for n in header)  # MTP too
    got, expected = params_of(fp8_model), params_of(jaxspec.load(twin_folder, dtype=jnp.float32))
    assert got.keys() == expected.keys() and any(name.startswith("mtp_") for name in got)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_fp8_greedy_equals_transformers_on_the_twin_and_mtp_equals_greedy(pair, fp8_model):
    hf_class = HF_CLASSES["deepseek_v3"][1]
    saved = hf_class._keys_to_ignore_on_load_unexpected
    hf_class._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{N_LAYERS + k}\..*" for k in range(N_MTP)]
    try:
        hf = hf_class.from_pretrained(pair[1], dtype=torch.float32).eval()
    finally:
        hf_class._keys_to_ignore_on_load_unexpected = saved
    ids, mask = left_padded(PROMPTS)
    plain = jaxspec.generate(fp8_model, ids, mask, max_new_tokens=N)
    for row, prompt in enumerate(PROMPTS):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False).numpy()[0, len(prompt):]
        got = plain.sequences[row, ids.shape[1]: ids.shape[1] + len(expected)]
        np.testing.assert_array_equal(got, expected)
    # A constant schedule: every round verifies drafts (the adaptive one would probe random layers in the shadow)
    mtp = jaxspec.generate(fp8_model, ids, mask, max_new_tokens=N, use_mtp=True,
                           num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(mtp.sequences, plain.sequences)
    assert mtp.drafted.sum() > 0


def test_sharded_fp8_load_reads_every_box_exactly(pair, fp8_model):
    """On a mesh, each device's box of each param is read on its own (straight from the fp8 bytes and the scale
    blocks it touches); boxes start inside scale blocks (expert width 32 split in two: 16 is inside block 0)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4), ("data", "model", "expert"))
    sharded = jaxspec.load(pair[0], dtype=jnp.float32, mesh=mesh)
    state = nnx.state(sharded.module)
    assert state["mtp_we_gate"][...].sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, "model")
    expected = params_of(fp8_model)
    for name, value in params_of(sharded).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_fp8_errors_name_the_tensors(pair, tmp_path):
    fp8_folder, _ = pair
    tensors = read_tensors(os.path.join(fp8_folder, "model.safetensors"))
    dropped = f"model.layers.1.mlp.experts.3.down_proj.weight{SCALE_SUFFIX}"
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(tmp_path / "model.safetensors"))
    with open(os.path.join(fp8_folder, "config.json")) as f:
        hf_config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config, f)
    with pytest.raises(CheckpointMismatch, match=r"fp8 weights without a _scale_inv tensor: \['model\.layers\.1\.mlp"
                                                 r"\.experts\.3\.down_proj\.weight'\]"):
        jaxspec.load(str(tmp_path), dtype=jnp.float32)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config | {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2",
                                                       "weight_block_size": [BLOCK, BLOCK]}}, f)
    with pytest.raises(NotImplementedError, match="fmt='e5m2'"):
        jaxspec.load(str(tmp_path), dtype=jnp.float32)


def test_layout_boxes_equal_slices_of_the_whole_transform():
    """Every box of a Layout's output, read alone from the HF tensor, equals that box of the whole transform: split
    heads, rope rows reordered inside each head, transposes, merged output heads, and FP8 blocks cut mid-block."""
    rng = np.random.default_rng(0)
    h, dn, dr, width = 3, 4, 6, 10
    cases = [
        (Layout(split=((h, dn + dr), None), perm=(2, 0, 1), orders=((1, deinterleave_order(dn + dr, dn, dr)),)),
         (h * (dn + dr), width)),
        (Layout(split=(None, None), perm=(1, 0), orders=((0, deinterleave_order(8 + dr, 8, dr)),)), (8 + dr, width)),
        (split_heads(width, h, 5), (h * 5, width)),
        (split_head_bias(h, 5), (h * 5,)),
        (merge_heads_out(h, 5), (width, h * 5)),
        (transposed(), (7, width)),
    ]
    for layout, shape in cases:
        w = rng.normal(size=shape).astype(np.float32)
        whole = layout(w)
        for _ in range(20):
            box = []
            for n in whole.shape:
                start = int(rng.integers(0, n))
                box.append(slice(start, int(rng.integers(start + 1, n + 1))))
            box = tuple(box)
            np.testing.assert_array_equal(layout.read(lambda b: w[b], shape, box), whole[box])

    class Source:  # an fp8 weight and its scale blocks, in memory
        def __init__(self, tensors):
            self.tensors, self.shapes = tensors, {k: v.shape for k, v in tensors.items()}

        def dtype(self, name):
            return self.tensors[name].dtype

        def read(self, name):
            return self.tensors[name]

    weight, scale = quantize(rng.normal(size=(50, 37)).astype(np.float32), (BLOCK, BLOCK))
    source = DequantizedSource(Source({"w.weight": weight, "w.weight" + SCALE_SUFFIX: scale}),
                               Fp8BlockQuantization((BLOCK, BLOCK)))
    whole = source.read("w.weight")
    assert source.shapes == {"w.weight": (50, 37)}
    for box in [(slice(3, 49), slice(25, 37)), (slice(24, 25), slice(0, 1)), (slice(47, 50), slice(10, 30))]:
        np.testing.assert_array_equal(source.read_box("w.weight", box), whole[box])

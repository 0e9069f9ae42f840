"""Expert parallelism on fake CPU devices: the routed experts split over an `expert` mesh axis (and their hidden width
over `model`) inside shard_map, each shard running its own experts on its tokens and one psum adding the parts,
equal the single-device grouped matmul; whole models loaded onto a mesh give the single-device logits and MTP logits;
the planner counts exactly the bytes a loaded model holds per device."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspec
from jaxspec.models import moe
from jaxspec.sharding import ShardingRules
from tests.fixtures import hf_models
from tests.fixtures.moe import CASES, COMMON, save_checkpoint

ATOL = 1e-4  # float32 sums in another order; logits are of magnitude 1-10


def mesh_of(data: int, model: int, expert: int) -> Mesh:
    devices = np.array(jax.devices()[: data * model * expert]).reshape(data, model, expert)
    return Mesh(devices, ("data", "model", "expert"))


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 8), (1, 4, 2)])
def test_expert_parallel_equals_routed_experts(shape):
    b, t, d, f, e, k = 4, 3, 16, 12, 8, 3
    rng = np.random.default_rng(0)
    x = rng.normal(size=(b, t, d)).astype(np.float32)
    w_gate, w_up = (rng.normal(size=(e, d, f)).astype(np.float32) for _ in range(2))
    w_down = rng.normal(size=(e, f, d)).astype(np.float32)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(b * t)]).reshape(b, t, k).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (b, t, k)).astype(np.float32)
    mesh, rules = mesh_of(*shape), ShardingRules()

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    args = (put(x, P("data")), put(weights, P("data")), put(experts, P("data")),
            put(w_gate, P("expert", None, "model")), put(w_up, P("expert", None, "model")),
            put(w_down, P("expert", "model", None)))
    parallel = jax.jit(lambda *a: moe.expert_parallel(*a, mesh, rules))
    out = parallel(*args)
    hlo = parallel.lower(*args).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo  # experts stay where they are; outputs are summed
    flat = (x.reshape(b * t, d), weights.reshape(b * t, k), experts.reshape(b * t, k), w_gate, w_up, w_down)
    expected = jax.jit(moe.routed_experts)(*flat).reshape(b, t, d)
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    _, n_layers, n_mtp, overrides = CASES["deepseek_mtp"]  # 1 dense + 2 MoE layers, 2 MTP layers, q LoRA, YaRN
    return save_checkpoint("deepseek_v3", str(tmp_path_factory.mktemp("ep") / "ckpt"), n_layers, n_mtp, overrides)


def forward_and_mtp(module, tokens):
    """Main logits [B, T, V] and depth-0 MTP logits [B, T-1, V], jitted once per module."""
    graphdef, state = nnx.split(module)

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        logits, hidden, _ = model(tokens, positions, model.init_cache(b, t))
        _, mtp_logits, _ = model.mtp_step(0, tokens[:, 1:], hidden[:, :-1], positions[:, 1:],
                                          model.init_mtp_cache(b, t))
        return logits, mtp_logits

    return [np.asarray(a) for a in run(state, tokens)]


def test_model_on_an_expert_mesh_equals_single_device(deepseek_folder):
    single = jaxspec.load(deepseek_folder, dtype=jnp.float32)
    mesh = mesh_of(2, 2, 2)
    sharded = jaxspec.load(deepseek_folder, dtype=jnp.float32, mesh=mesh)
    assert sharded.module.mesh is mesh
    we_gate = nnx.state(sharded.module)["we_gate"].get_value()
    assert we_gate.sharding.spec == P(None, "expert", None, "model")
    assert we_gate.addressable_shards[0].data.shape == (2, 4, COMMON["hidden_size"], 16)
    tokens = np.random.default_rng(0).integers(3, COMMON["vocab_size"], (2, 12)).astype(np.int32)
    expected = forward_and_mtp(single.module, tokens)
    got = forward_and_mtp(sharded.module, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    assert np.abs(expected[0]).max() > 1.0
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=ATOL, rtol=0)
    # Generation on a mesh (greedy, sampling, use_mtp; one and two processes) runs in tests/e2e/test_distributed.py.


def test_qwen3_moe_on_an_expert_mesh_equals_single_device(tmp_path):
    """Qwen3-MoE's softmax router and its dense first layer, with the experts split over the mesh."""
    folder = hf_models.save_tiny("qwen3_moe", tmp_path, seed=5, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=16, head_dim=16, mlp_only_layers=[0])
    single = jaxspec.load(folder, dtype=jnp.float32)
    mesh = mesh_of(2, 2, 2)
    sharded = jaxspec.load(folder, dtype=jnp.float32, mesh=mesh)
    assert nnx.state(sharded.module)["we_gate"].get_value().sharding.spec == P(None, "expert", None, "model")
    tokens = np.random.default_rng(1).integers(3, 128, (2, 12)).astype(np.int32)

    def logits(module, tokens):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        return np.asarray(module(tokens, positions, module.init_cache(b, t))[0])

    expected = logits(single.module, tokens)
    got = logits(sharded.module, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def plan_script():
    from jaxspec.cli import plan

    return plan


@pytest.mark.parametrize("name, published", [
    ("deepseek-v3", 671e9),
    ("glm-4.5-air", 106e9),
    ("glm-4.5", 355e9),
    ("qwen3-30b-a3b", 30.5e9),
])
def test_planned_configs_have_their_published_sizes(name, published):
    """The real configs jaxspec-plan ships, read by their families: the main model's parameter count (without MTP
    layers) is the model card's, within its rounding."""
    plan = plan_script()
    label, hf = plan.read_config(name)
    p = plan.plan(hf, label, {"data": 1, "model": 1, "expert": 1}, "bfloat16", 1, 128, mtp=True)
    assert abs(p.params - published) / published < 0.01, (name, p.params)


def test_planner_counts_what_a_loaded_model_holds_per_device(deepseek_folder):
    """jaxspec-plan (jaxspec/cli/plan.py) sizes params and caches from the config alone; a model really loaded onto the same mesh
    holds exactly those bytes on each device."""
    plan = plan_script()
    with open(os.path.join(deepseek_folder, "config.json")) as f:
        hf = json.load(f)
    mesh = mesh_of(2, 2, 2)
    batch, max_len = 4, 100
    p = plan.plan(hf, "tiny", dict(mesh.shape), "float32", batch, max_len, mtp=True)
    module = jaxspec.load(deepseek_folder, dtype=jnp.float32, mesh=mesh).module
    device = mesh.devices.flat[0]

    def bytes_on(device, tree):
        return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
                   if s.device == device)

    assert bytes_on(device, nnx.state(module)) == sum(p.weights.values())
    cache = jax.jit(lambda: module.init_cache(batch, p.positions))()
    assert bytes_on(device, cache) == p.cache > 0


def test_glm_sharded_load_reads_the_same_params(tmp_path):
    """GLM-4.5's split q/k/v heads, their biases, qk norms and merged output heads, read box by box on a mesh."""
    _, n_layers, n_mtp, overrides = CASES["glm_mtp"]
    folder = save_checkpoint("glm4_moe", str(tmp_path / "glm"), n_layers, n_mtp, overrides)
    mesh = mesh_of(1, 2, 4)
    sharded = nnx.state(jaxspec.load(folder, dtype=jnp.float32, mesh=mesh).module)
    single = nnx.state(jaxspec.load(folder, dtype=jnp.float32).module)
    assert sharded["wk"].get_value().sharding.spec == P(None, None, "model", None)
    for name, value in nnx.to_pure_dict(single).items():
        np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(sharded)[name]), np.asarray(value), err_msg=name)


def test_llama_sharded_load_keeps_each_devices_slices(tiny_llama_dir):
    """Families without a conversion plan convert on the host, then each device keeps its slices."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharded = nnx.to_pure_dict(nnx.state(jaxspec.load(tiny_llama_dir, dtype=jnp.float32, mesh=mesh).module))
    single_layout = nnx.state(jaxspec.load(tiny_llama_dir, dtype=jnp.float32).module)  # projections [out, in]
    single = nnx.to_pure_dict(jaxspec.layout.standard_layout(single_layout))
    assert sharded["layers"][0]["w_gate"].sharding.spec == P(None, "model")
    for got, expected in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

"""Several processes, one program (`jaxspec.distributed`): local CPU processes joined by `jax.distributed` on
127.0.0.1 with gloo collectives, each with its own fake CPU devices, started from pytest with subprocess.

Slow only, every test here (each starts JAX and compiles in several processes, 20-50 s and more): the default suite
runs no second process. What it checks of sharding runs in one process (a mesh of fake CPU devices: e.g.
tests/strategies/test_every_strategy.py, tests/models/test_expert_parallel.py).

- Two processes x 2 devices load an FP8 DeepSeek-V3 checkpoint (with an MTP layer) sharded on a (data, model,
  expert) = (1, 2, 2) mesh and generate with plain greedy, sampling and use_mtp; both get back exactly what one
  process with 4 devices gets on the same mesh shape, whose greedy tokens equal those of one unsharded device. The
  two processes also save the sharded model as a conversion folder together and restore it into the same shardings.
- Prompt lookup, early exit and an assistant model give the same tokens across processes too.
- Four processes x 1 device each load their quarter of a ~300 MB checkpoint: each one's peak resident memory
  grows by well under the checkpoint's size (the bound is stated in the test).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures.fp8 import write_fp8_pair

WORKER = os.path.join(os.path.dirname(__file__), "_distributed_worker.py")
TIMEOUT = 600
# Both topologies compile with the same flags, so outputs stay comparable; they halve XLA:CPU's LLVM time, which is
# most of what these runs cost.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(checkpoint: str, out_prefix: str, processes: int, devices: int, mesh: str, *extra: str):
    """Start `processes` workers with `devices` CPU devices each; returns (Popen, output file) pairs."""
    env = os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
                        "JAX_PLATFORMS": "cpu"}
    port = free_port()
    started = []
    for pid in range(processes):
        out = f"{out_prefix}-{pid}.npz"
        command = [sys.executable, WORKER, checkpoint, out, "--mesh", mesh, *extra]
        if processes > 1:
            command += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                        "--process-id", str(pid)]
        started.append((subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True), out))
    return started


def collect(started) -> list[tuple[dict, dict]]:
    """Wait for every worker; a failure shows each worker's output."""
    logs = []
    for proc, _ in started:
        try:
            logs.append(proc.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for p, _ in started:
                p.kill()
            raise
    if any(proc.returncode for proc, _ in started):
        pytest.fail("a worker failed:\n" + "\n-----\n".join(log[-4000:] for log in logs))
    results = []
    for _, out in started:
        with np.load(out) as data:
            results.append((json.loads(str(data["results"])), {k: data[k] for k in data.files if k != "results"}))
    return results


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return write_fp8_pair(str(tmp_path_factory.mktemp("dist")))[0]


@pytest.mark.slow  # ~50 s: three processes start JAX and compile the loop each
def test_two_processes_generate_what_one_process_generates(fp8_checkpoint, tmp_path):
    pair = launch(fp8_checkpoint, str(tmp_path / "pair"), 2, 2, "1,2,2", "--save-restore", str(tmp_path / "conv"))
    single = launch(fp8_checkpoint, str(tmp_path / "single"), 1, 4, "1,2,2", "--one-device")
    (_, reference), = collect(single)
    one_device = reference.pop("greedy_one_device")
    for info, arrays in collect(pair):  # every process gets the full outputs
        assert info["restored_equal"] and info["restored_sharding_equal"]
        assert arrays.keys() == reference.keys() == {"greedy", "sample", "mtp"}
        for name in reference:
            np.testing.assert_array_equal(arrays[name], reference[name], err_msg=name)
    np.testing.assert_array_equal(reference["greedy"], one_device)  # expert parallel == one device, end to end
    np.testing.assert_array_equal(reference["mtp"], reference["greedy"])
    assert not np.array_equal(reference["sample"], reference["greedy"])
    assert os.path.isfile(tmp_path / "conv" / "jaxspec.json")


@pytest.mark.slow  # four more loops compiled in three processes
def test_every_other_strategy_across_processes(fp8_checkpoint, tmp_path):
    calls = ("--calls", "greedy,lookup,early_exit,assistant")
    pair = launch(fp8_checkpoint, str(tmp_path / "pair"), 2, 2, "1,2,2", *calls)
    (_, reference), = collect(launch(fp8_checkpoint, str(tmp_path / "single"), 1, 4, "1,2,2", *calls))
    for _, arrays in collect(pair):
        for name in reference:
            np.testing.assert_array_equal(arrays[name], reference[name], err_msg=name)
            np.testing.assert_array_equal(arrays[name], reference["greedy"], err_msg=name)


BIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
           v_head_dim=32, qk_nope_head_dim=32, n_routed_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4,
           first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256, num_nextn_predict_layers=0,
           model_type="deepseek_v3")


def deepseek_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF DeepSeek-V3 tensor names and shapes for config `c` (as save_pretrained writes them: one per expert)."""
    d, h, r, rq = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["q_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    e, f, fd = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,),
              "lm_head.weight": (c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_a_proj.weight": (rq, d), p + "self_attn.q_a_layernorm.weight": (rq,),
                   p + "self_attn.q_b_proj.weight": (h * (dn + dr), rq),
                   p + "self_attn.kv_a_proj_with_mqa.weight": (r + dr, d), p + "self_attn.kv_a_layernorm.weight": (r,),
                   p + "self_attn.kv_b_proj.weight": (h * (dn + dv), r), p + "self_attn.o_proj.weight": (d, h * dv)}
        if i < c["first_k_dense_replace"]:
            shapes |= {p + "mlp.gate_proj.weight": (fd, d), p + "mlp.up_proj.weight": (fd, d),
                       p + "mlp.down_proj.weight": (d, fd)}
            continue
        fs = f * c["n_shared_experts"]
        shapes |= {p + "mlp.gate.weight": (e, d), p + "mlp.gate.e_score_correction_bias": (e,),
                   p + "mlp.shared_experts.gate_proj.weight": (fs, d), p + "mlp.shared_experts.up_proj.weight": (fs, d),
                   p + "mlp.shared_experts.down_proj.weight": (d, fs)}
        for j in range(e):
            q = f"{p}mlp.experts.{j}."
            shapes |= {q + "gate_proj.weight": (f, d), q + "up_proj.weight": (f, d), q + "down_proj.weight": (d, f)}
    return shapes


def write_big_deepseek(folder: str) -> int:
    """A random DeepSeek-V3 checkpoint of ~300 MB (float32, experts ~97% of it) in two files, experts apart, as
    real checkpoints are sharded. Returns its tensor bytes."""
    from safetensors.numpy import save_file

    shapes = deepseek_tensor_shapes(BIG)
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, shape in shapes.items():
        files[list(files)[".experts." in name]][name] = shape
    weight_map = {}
    for file, names in files.items():
        save_file({n: rng.standard_normal(s, np.float32) * 0.02 for n, s in names.items()}, os.path.join(folder, file))
        weight_map |= {n: file for n in names}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(BIG, f)
    return sum(4 * int(np.prod(s)) for s in shapes.values())


@pytest.mark.slow  # ~20 s: four processes start JAX and write and read a 300 MB checkpoint
def test_each_process_holds_only_its_shards_while_loading(tmp_path):
    """Four processes x 1 device, experts split 4 ways: each holds ~27% of the params. Bound: each process's peak
    resident memory grows during the load by less than half the checkpoint's bytes, and by less than its own shards
    plus two of its largest per-device boxes (the box being read, and its copy on the device, which on CPU is host
    memory too) plus 32 MiB. A process that passed the whole checkpoint through its memory would exceed both."""
    size = write_big_deepseek(str(tmp_path / "big"))
    results = collect(launch(str(tmp_path / "big"), str(tmp_path / "rss"), 4, 1, "1,1,4", "--rss"))
    for index, (info, _) in enumerate(results):
        growth = info["peak_rss"] - info["rss_before_load"]
        print(f"process {index}: resident memory grew by {growth / 2**20:.0f} MiB while loading, "
              f"{growth / size:.2f}x the {size / 2**20:.0f} MiB checkpoint (its params: "
              f"{info['local_param_bytes'] / size:.2f}x)")  # shown with pytest -s
        assert info["local_param_bytes"] < 0.3 * size
        assert growth < 0.5 * size, (growth, size, info)
        assert growth < info["local_param_bytes"] + 2 * info["largest_box_bytes"] + (32 << 20), (growth, info)

"""What DeepSeek-V3, GLM-4.5 (glm4_moe) and Qwen3-MoE share: the routed MoE feed-forward, the decoder stack with
dense first layers and MoE later ones, rope settings, and the MTP (multi-token prediction) layers. The families
differ in attention, which each family module supplies to `MoeCausalLM`, and in how the router scores experts.

MoE routing, `scoring="sigmoid"` (HF `DeepseekV3TopkRouter`, GLM-4.5's too): sigmoid scores; the choice adds
`e_score_correction_bias`; experts are split into `n_group` groups, each group scored by the sum of its two best
choices, and only the best `topk_group` groups compete; the `num_experts_per_tok` best experts are weighted by their
*uncorrected* scores, optionally normalised, times `routed_scaling_factor`. Shared experts are a plain gated MLP added
to every token. `scoring="softmax"` (HF `Qwen3MoeTopKRouter`): a softmax over all experts, the best
`num_experts_per_tok` weighted by their probabilities, optionally renormalised; no groups, no score bias, no shared
experts.

Routed compute (`routed_experts`): the N*k token-expert assignments are sorted by expert and each expert's rows go
through one grouped matmul (`jax.lax.ragged_dot` with per-expert group sizes), so the work is N*k expert rows, never
N*E; there is no capacity and no token is dropped. How ragged_dot lowers is the backend's business: TPU has a
native grouped matmul and XLA:GPU uses cuDNN's grouped GEMM where it supports the shapes, while XLA:CPU (the test
platform) expands it densely, which is correct but only fit for tiny models. `dense_experts_reference` computes
every expert for every token; it exists only so tests can check the routed path.

MTP layers (HF `MtpLayer`): depth k maps `eh_proj(concat(enorm(embed(t_i)), hnorm(h_{i-1})))` through one MoE
decoder block, then `shared_head.norm`; that normed state feeds the LM head and is depth k+1's `h`. Depth 0's `h` is
the main model's final-normed hidden state. Each depth has its own position-indexed cache; depth k's first entry is
position k+1 (position i needs h_{i-1} of the previous depth), so its attention window starts there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspec.sharding import ShardingRules, constrain, partition_spec

from . import layers as L

SUPPORTED_ROPE_TYPES = ("default", "yarn")

# ----------------------------------------------------------------------------------------------------------------
# Config pieces


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # n_routed_experts
    experts_per_token: int  # num_experts_per_tok
    num_groups: int  # n_group
    topk_groups: int  # topk_group
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_shared_experts: int  # n_shared_experts
    expert_size: int  # moe_intermediate_size
    first_dense_layers: int  # first_k_dense_replace, clipped to the layer count
    scoring: str = "sigmoid"  # "sigmoid" (DeepSeek-V3, GLM-4.5) or "softmax" (Qwen3-MoE): see the module docstring

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], defaults: dict[str, Any]) -> "MoeConfig":
        """`defaults` are the family's HF class defaults, which apply where config.json lacks a key."""

        def get(key):
            value = hf.get(key, defaults[key])
            return defaults[key] if value is None else value

        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise NotImplementedError(f"scoring_func={hf['scoring_func']!r} is not supported; only 'sigmoid' is.")
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise NotImplementedError(f"topk_method={hf['topk_method']!r} is not supported; only 'noaux_tc' is.")
        if hf.get("moe_layer_freq", 1) != 1:
            raise NotImplementedError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported; only 1 is.")
        num_experts, num_groups = get("n_routed_experts"), get("n_group")
        if num_experts % num_groups or num_experts // num_groups < 2:
            raise ValueError(
                f"n_routed_experts={num_experts} must split into n_group={num_groups} groups of at least 2 experts "
                "(a group is scored by its two best experts)."
            )
        if not 1 <= get("topk_group") <= num_groups:
            raise ValueError(f"topk_group={get('topk_group')} must be between 1 and n_group={num_groups}.")
        if get("num_experts_per_tok") > num_experts // num_groups * get("topk_group"):
            raise ValueError(
                f"num_experts_per_tok={get('num_experts_per_tok')} exceeds the {num_experts // num_groups} experts in "
                f"each of the topk_group={get('topk_group')} groups a token may use."
            )
        return cls(
            num_experts=num_experts,
            experts_per_token=get("num_experts_per_tok"),
            num_groups=num_groups,
            topk_groups=get("topk_group"),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            num_shared_experts=get("n_shared_experts"),
            expert_size=get("moe_intermediate_size"),
            first_dense_layers=min(get("first_k_dense_replace"), hf["num_hidden_layers"]),
        )


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary settings as HF resolves them (`rope_parameters`, or legacy `rope_scaling` + `rope_theta`)."""

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    # yarn: (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate)
    yarn: tuple[float, int, float, float, bool] | None = None
    attention_factor: float = 1.0  # multiplies cos and sin (YaRN's magnitude correction)
    mscale_all_dim: float = 0.0  # DeepSeek also scales the softmax by yarn_get_mscale(factor, this) ** 2

    def inv_freq(self) -> jax.Array:
        if self.yarn is not None:
            return L.yarn_inv_freq(self.rotary_dim, self.theta, *self.yarn)
        return L.default_inv_freq(self.rotary_dim, self.theta)

    def softmax_mscale(self) -> float:
        """DeepSeek's `yarn_apply_mscale` factor on the softmax scale (1 without YaRN)."""
        if self.yarn is None or not self.mscale_all_dim:
            return 1.0
        return L.yarn_get_mscale(self.yarn[0], self.mscale_all_dim) ** 2


def rope_from_hf(hf: dict[str, Any], rope: dict[str, Any], head_dim: int) -> RopeConfig:
    """`rope` is `rope_parameters(hf)` with the family's defaults filled in; `head_dim` is the dim rope applies to
    before `partial_rotary_factor`."""
    rope_type = rope["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported yet; supported: {SUPPORTED_ROPE_TYPES}.")
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    theta = float(rope["rope_theta"])
    if rope_type == "default":
        return RopeConfig(theta=theta, rotary_dim=rotary_dim)
    # HF prefers a top-level original_max_position_embeddings, then the rope dict's, then max_position_embeddings.
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    original = original or hf["max_position_embeddings"]
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = L.yarn_get_mscale(factor, mscale) / L.yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = L.yarn_get_mscale(factor)
    yarn = (
        float(factor),
        int(original),
        float(rope.get("beta_fast") or 32),
        float(rope.get("beta_slow") or 1),
        bool(rope.get("truncate", True)),
    )
    return RopeConfig(
        theta=theta,
        rotary_dim=rotary_dim,
        rope_type="yarn",
        yarn=yarn,
        attention_factor=float(attention_factor),
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )


def common_fields(hf: dict[str, Any], defaults: dict[str, Any], moe: MoeConfig | None = None) -> dict[str, Any]:
    """Config fields the families read the same way; raise on what none implements. `moe`: the family's own MoE
    settings, where they are not DeepSeek-V3's keys (`MoeConfig.from_hf_config`)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported yet; only 'silu' is.")
    if hf.get("quantization_config"):
        # FP8 block-scaled weights are dequantized while reading (convert/fp8.py checks the details); the model
        # itself never sees them.
        method = hf["quantization_config"].get("quant_method")
        if method != "fp8":
            raise NotImplementedError(f"quantized checkpoints (quant_method={method!r}) are not supported; only "
                                      "'fp8' with block scales (DeepSeek-V3's layout) is.")
    if hf.get("mtp_hidden_states_first"):
        raise NotImplementedError("mtp_hidden_states_first=True is not supported yet.")
    eos = hf.get("eos_token_id", defaults.get("eos_token_id"))
    return dict(
        vocab_size=hf.get("vocab_size", defaults["vocab_size"]),
        hidden_size=hf.get("hidden_size", defaults["hidden_size"]),
        intermediate_size=hf.get("intermediate_size", defaults["intermediate_size"]),
        num_layers=hf["num_hidden_layers"],
        num_heads=hf.get("num_attention_heads", defaults["num_attention_heads"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        max_position_embeddings=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe or MoeConfig.from_hf_config(hf, defaults),
        num_mtp_layers=L.num_mtp_layers(hf),
        bos_token_id=hf.get("bos_token_id", defaults.get("bos_token_id")),
        eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        pad_token_id=hf.get("pad_token_id"),
    )


# ----------------------------------------------------------------------------------------------------------------
# The MoE feed-forward


def route(x: jax.Array, w_router: jax.Array, score_bias: jax.Array | None, cfg: MoeConfig
          ) -> tuple[jax.Array, jax.Array]:
    """The experts of each token and their weights, by `cfg.scoring`. x: [N, D], w_router: [D, E], score_bias: [E]
    (sigmoid scoring only). Returns (weights [N, k] float32, experts [N, k] int32)."""
    logits = jnp.dot(x.astype(jnp.float32), w_router.astype(jnp.float32))  # [N, E]
    if cfg.scoring == "softmax":
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.experts_per_token)  # [N, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return weights, experts
    return _group_limited_sigmoid_route(logits, score_bias, cfg)


def _group_limited_sigmoid_route(logits: jax.Array, score_bias: jax.Array, cfg: MoeConfig
                                 ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's routing from the router's logits [N, E]; see the module docstring."""
    n = logits.shape[0]
    e, g = cfg.num_experts, cfg.num_groups
    scores = jax.nn.sigmoid(logits)  # [N, E]
    choice = scores + score_bias.astype(jnp.float32)
    group_scores = jax.lax.top_k(choice.reshape(n, g, e // g), 2)[0].sum(-1)  # [N, G]
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_groups)  # [N, topk_group]
    in_top_group = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
    in_top_group = jnp.repeat(in_top_group, e // g, axis=1)  # [N, E]
    _, experts = jax.lax.top_k(jnp.where(in_top_group, choice, -jnp.inf), cfg.experts_per_token)  # [N, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)  # [N, k]: uncorrected scores weigh the outputs
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def routed_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """Sum over each token's k experts of weight * expert(x), computing only the chosen experts.

    x: [N, D]; weights, experts: [N, k]; w_gate, w_up: [E, D, F]; w_down: [E, F, D]. Returns [N, D].
    """
    n, k = experts.shape
    flat = experts.reshape(-1)  # [N*k]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k  # [N*k] the token of each sorted assignment
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)  # [E]
    rows = x[token]  # [N*k, D]
    gate = jax.lax.ragged_dot(rows, w_gate, group_sizes)  # [N*k, F]
    up = jax.lax.ragged_dot(rows, w_up, group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [N*k, D]
    out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(out).astype(x.dtype)


def dense_experts_reference(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """`routed_experts` by running every expert on every token (N*E work); for tests only."""
    n = x.shape[0]
    combine = jnp.zeros((n, w_gate.shape[0]), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)  # [N, E]
    hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", x, w_gate)) * jnp.einsum("nd,edf->nef", x, w_up)  # [N, E, F]
    out = jnp.einsum("nef,efd->ned", hidden, w_down)  # [N, E, D]
    return jnp.einsum("ne,ned->nd", combine, out.astype(jnp.float32)).astype(x.dtype)


def local_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
    first_expert: jax.Array | int,
) -> jax.Array:
    """`routed_experts` restricted to the experts [first_expert, first_expert + E_local) that this shard holds:
    assignments to other experts contribute nothing (another shard adds them). Returns float32 [N, D].

    x: [N, D]; weights, experts: [N, k]; w_gate, w_up: [E_local, D, F]; w_down: [E_local, F, D]. Local assignments
    are sorted first, by expert, so one grouped matmul covers them; the others sort last, past the groups, and are
    zeroed (ragged_dot leaves rows past the last group unspecified on some backends).
    """
    n, k = experts.shape
    count = w_gate.shape[0]
    local = experts.reshape(-1) - first_expert  # [N*k]
    mine = (local >= 0) & (local < count)
    slot = jnp.where(mine, local, count)  # the others go to a bucket past the last local expert
    order = jnp.argsort(slot, stable=True)
    token = order // k  # [N*k] the token of each sorted assignment
    group_sizes = jnp.bincount(slot, length=count + 1)[:count].astype(jnp.int32)  # [E_local]
    rows = x[token]  # [N*k, D]
    gate = jax.lax.ragged_dot(rows, w_gate, group_sizes)  # [N*k, F]
    up = jax.lax.ragged_dot(rows, w_up, group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [N*k, D]
    out = jnp.where(mine[order][:, None], out.astype(jnp.float32) * weights.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(out)


def expert_parallel(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
    mesh: Mesh, rules: ShardingRules,
) -> jax.Array:
    """`routed_experts` with the experts split over the mesh: inside `shard_map`, each shard runs the experts it
    holds (the `experts` axis's mesh axis) on its own tokens (the `batch` axis's), on its slice of each expert's
    hidden width (the `mlp` axis's), and one psum over the expert and mlp mesh axes adds the partial outputs.

    x: [B, T, D]; weights, experts: [B, T, k]; w_gate, w_up: [E, D, F]; w_down: [E, F, D]. Returns [B, T, D].
    Every shard sees every assignment of its tokens and keeps its own, so no token is dropped and no all-to-all is
    needed (which keeps the path the same on CPU, where `ragged_all_to_all` does not exist, and on TPU/GPU). At
    decode sizes (a few tokens per row) the psum of a [B, T, D] block is the whole communication.
    """
    # The params' own layout (by logical axes); the width D stays whole inside, so each shard's matmuls are complete.
    expert_axis, _, mlp_axis = partition_spec(("experts", "embed", "mlp"), w_gate.shape, mesh, rules)
    reduce_axes = tuple(a for a in (expert_axis, mlp_axis) if a is not None)
    batch_axis = partition_spec(("batch",), x.shape[:1], mesh, rules)[0]
    if batch_axis in reduce_axes:  # tokens split over a reduced axis would be summed with other tokens
        batch_axis = None
    token_spec = P(batch_axis, None, None)
    gate_spec, down_spec = P(expert_axis, None, mlp_axis), P(expert_axis, mlp_axis, None)
    local_count = w_gate.shape[0] // (mesh.shape[expert_axis] if expert_axis else 1)

    def shard(x, weights, experts, w_gate, w_up, w_down):
        first = jax.lax.axis_index(expert_axis) * local_count if expert_axis else 0
        b, t, d = x.shape
        out = local_experts(x.reshape(b * t, d), weights.reshape(b * t, -1), experts.reshape(b * t, -1),
                            w_gate, w_up, w_down, first)
        if reduce_axes:
            out = jax.lax.psum(out, reduce_axes)
        return out.astype(x.dtype).reshape(b, t, d)

    return jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(token_spec, token_spec, token_spec, gate_spec, gate_spec, down_spec),
        out_specs=token_spec,
    )(x, weights, experts, w_gate, w_up, w_down)


def moe_ffn(cfg: MoeConfig, p: dict[str, jax.Array], x: jax.Array, mesh: Mesh | None = None,
            rules: ShardingRules | None = None) -> jax.Array:
    """Routed experts plus shared experts on x: [B, T, D]. With a mesh, the routed experts run expert-parallel."""
    flat = x.reshape(-1, x.shape[-1])  # [N, D]
    weights, experts = route(flat, p["router"], p.get("router_bias"), cfg)
    if mesh is None:
        out = routed_experts(flat, weights, experts, p["we_gate"], p["we_up"], p["we_down"]).reshape(x.shape)
    else:
        k = cfg.experts_per_token
        weights, experts = weights.reshape(*x.shape[:2], k), experts.reshape(*x.shape[:2], k)
        out = expert_parallel(x, weights, experts, p["we_gate"], p["we_up"], p["we_down"], mesh, rules)
    if cfg.num_shared_experts:
        out = out + L.gated_mlp(x, p["ws_gate"], p["ws_up"], p["ws_down"])
    return out


# ----------------------------------------------------------------------------------------------------------------
# Parameters: per-layer shapes and logical axes (the stacks add a leading `layers` axis)

# The router's score bias stays float32 whatever the model dtype: it decides expert choice by small margins (HF
# keeps it in float32 too).
FLOAT32_PARAMS = ("router_bias", "mtp_router_bias")

LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    # dense feed-forward of the first layers
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    # MoE feed-forward
    "router": ("embed", "experts"),
    "router_bias": ("experts",),
    "we_gate": ("experts", "embed", "mlp"),
    "we_up": ("experts", "embed", "mlp"),
    "we_down": ("experts", "mlp", "embed"),
    "ws_gate": ("embed", "mlp"),
    "ws_up": ("embed", "mlp"),
    "ws_down": ("mlp", "embed"),
    # MTP-only
    "enorm": ("embed",),
    "hnorm": ("embed",),
    "eh_proj": ("mlp", "embed"),  # [2D, D], sharded on its input like a down projection
    "out_norm": ("embed",),
}
TOP_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}
DENSE_FFN = ("w_gate", "w_up", "w_down")
MOE_FFN = ("router", "router_bias", "we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down")
MTP_PREFIX = "mtp_"


def stack_shapes(cfg, attention: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every param of a MoE-family model. `attention` holds one layer's attention param shapes.

    Layers [0, first_dense_layers) have the dense FFN, the rest the MoE FFN: two stacks, since their params differ.
    MTP params carry the `mtp_` prefix and stack over depths.
    """
    d, v, moe = cfg.hidden_size, cfg.vocab_size, cfg.moe
    n, n_dense, m = cfg.num_layers, moe.first_dense_layers, cfg.num_mtp_layers
    e, f, fs = moe.num_experts, moe.expert_size, moe.expert_size * moe.num_shared_experts
    block = attention | {"attn_norm": (d,), "mlp_norm": (d,)}
    fd = cfg.intermediate_size
    dense = {"w_gate": (d, fd), "w_up": (d, fd), "w_down": (fd, d)}
    routed = {
        "router": (d, e),
        "we_gate": (e, d, f),
        "we_up": (e, d, f),
        "we_down": (e, f, d),
    }
    if moe.scoring == "sigmoid":
        routed["router_bias"] = (e,)
    if moe.num_shared_experts:
        routed |= {"ws_gate": (d, fs), "ws_up": (d, fs), "ws_down": (fs, d)}
    mtp = {"enorm": (d,), "hnorm": (d,), "eh_proj": (2 * d, d), "out_norm": (d,)}
    shapes = {"embed": (v, d), "final_norm": (d,)}
    shapes |= {name: (n, *s) for name, s in block.items()}
    if n_dense:
        shapes |= {name: (n_dense, *s) for name, s in dense.items()}
    if n > n_dense:
        shapes |= {name: (n - n_dense, *s) for name, s in routed.items()}
    if m:
        shapes |= {MTP_PREFIX + name: (m, *s) for name, s in (block | routed | mtp).items()}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def param_axes(name: str, attention_axes: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    if name in TOP_AXES:
        return TOP_AXES[name]
    base = name.removeprefix(MTP_PREFIX)
    return ("layers", *(attention_axes | LAYER_AXES)[base])


# ----------------------------------------------------------------------------------------------------------------
# The model


class MoeCausalLM(nnx.Module):
    """`model(tokens[B,T], positions[B,T], cache) -> (logits[B,T,V], hidden[B,T,D], cache)`, plus MTP drafting.

    A family subclass sets `ATTENTION_AXES` (one layer's attention params -> logical axes) and implements
    `attention_shapes()`, `attention(p, h, positions, cache, index, first, tree) -> (out, cache)` (a pure function of
    its arguments, writing its cache entries at `positions` in layer `index`, or for a tree-shaped block at its slots
    with its mask: jaxspec/tree.py `TreeBlock`) and `new_cache(layers, batch, size)`.
    """

    ATTENTION_AXES: dict[str, tuple[str, ...]] = {}
    tree_attention = True  # verifies tree-shaped blocks (`tree=`; jaxspec/tree.py)

    def __init__(self, cfg, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        # The mesh the params live on (`place_on`): the routed experts then run expert-parallel in shard_map and
        # new caches are laid out by their logical axes. None: one device, or GSPMD decides everything.
        self.mesh: Mesh | None = None
        self.rules: ShardingRules | None = None
        rngs = rngs or nnx.Rngs(0)
        for name, shape in stack_shapes(cfg, self.attention_shapes()).items():
            base = name.removeprefix(MTP_PREFIX)
            param_dtype = jnp.float32 if name in FLOAT32_PARAMS else dtype
            if (abstract := L.shapes_only(shape, param_dtype)) is not None:
                value = abstract
            elif "norm" in base:
                value = jnp.ones(shape, dtype)
            elif base in ("router_bias", "bq", "bk", "bv"):
                value = jnp.zeros(shape, param_dtype)
            else:
                value = (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)
            setattr(self, name, nnx.Param(value, logical_axes=param_axes(name, self.ATTENTION_AXES)))

    def place_on(self, mesh: Mesh | None, rules: ShardingRules | None = None) -> None:
        """Declare the mesh the params are (or will be) sharded on; see `__init__`. The params are not moved."""
        self.mesh, self.rules = mesh, (rules or ShardingRules()) if mesh is not None else None

    def _constrain_cache(self, cache):
        if self.mesh is None:
            return cache
        axes = type(cache).logical_axes()
        return jax.tree.map(lambda x, names: constrain(x, names, self.mesh, self.rules), cache, axes)

    # -- family hooks ----------------------------------------------------------------------------------------------

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def attention(self, p, h, positions, cache, index, first, tree=None):
        raise NotImplementedError

    def new_cache(self, layers: int, batch: int, size: int):
        raise NotImplementedError

    # -- pieces, so drafters can run part of the network -----------------------------------------------------------

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.embed[...][tokens]  # [B, T, D]

    def run_layers(self, x: jax.Array, positions: jax.Array, cache, start: int = 0, stop: int | None = None,
                   tree=None):
        """Run decoder layers [start, stop) on x: [B, T, D], writing their cache entries at `positions` (a tree-shaped
        block, `tree`: at its slots, `positions` being its entries' rope positions)."""
        stop = self.cfg.num_layers if stop is None else stop
        n_dense = self.cfg.moe.first_dense_layers
        if start < min(stop, n_dense):
            x, cache = self._scan(x, positions, cache, start, min(stop, n_dense), moe=False, tree=tree)
        if max(start, n_dense) < stop:
            x, cache = self._scan(x, positions, cache, max(start, n_dense), stop, moe=True, tree=tree)
        return x, cache

    def final_hidden(self, x: jax.Array) -> jax.Array:
        return L.rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)

    def logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """LM head over final-normed hidden states: [..., D] -> [..., V], always float32. `head`: the [D, V] head
        where the caller holds it in another layout (`jaxspec.head.verify_head`), else this model's own."""
        head = self.head_matrix() if head is None else head
        return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)

    def head_matrix(self) -> jax.Array:
        """[D, V]: the tied embedding, transposed (a view XLA folds into the product), or the untied head."""
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache, head: jax.Array | None = None, tree=None):
        x, cache = self.run_layers(self.embed_tokens(tokens), positions, cache, tree=tree)
        hidden = self.final_hidden(x)
        return self.logits(hidden, head), hidden, cache

    def init_cache(self, batch: int, size: int):
        return self._constrain_cache(self.new_cache(self.cfg.num_layers, batch, size))

    # -- MTP -------------------------------------------------------------------------------------------------------

    @property
    def num_mtp_layers(self) -> int:
        return self.cfg.num_mtp_layers

    def init_mtp_cache(self, batch: int, size: int, depths: int | None = None):
        """One position-indexed cache per MTP depth, stacked on the leading (layers) axis. `depths` may exceed the
        number of MTP layers when the last layer is reused for extra drafts; each depth keeps its own cache."""
        self._check_mtp_depth(0)
        return self._constrain_cache(self.new_cache(depths or self.cfg.num_mtp_layers, batch, size))

    def mtp_step(
        self, depth: int, tokens: jax.Array, prev_hidden: jax.Array, positions: jax.Array, mtp_cache,
        layer: int | None = None,
    ):
        """One MTP depth over T entries: `(normed_out[B,T,D], logits[B,T,V], mtp_cache)`.

        Entry j is token `tokens[:, j]` at `positions[:, j]` = i, combined with `prev_hidden[:, j]`: the state at
        position i-1 (depth 0: the main model's final-normed hidden; depth k > 0: depth k-1's `normed_out`). Its
        logits predict the token at position i+1 (at depth k they descend from the main model's state at i-1-k).
        In a round over a sequence of length L, depth k's newest entry is at position L-1+k and holds draft k-1
        (depth 0: the newest token); its logits give draft k. Entries are written to the depth's cache at their
        positions; attention sees this depth's entries in [depth+1, i]. `layer` (default: `depth`) picks the MTP
        weights, so depths past the last layer can reuse it (vLLM's way of drafting more tokens than layers).
        """
        layer = depth if layer is None else layer
        self._check_mtp_depth(layer)
        names = [n for n in vars(self) if n.startswith(MTP_PREFIX)]
        p = {n.removeprefix(MTP_PREFIX): getattr(self, n)[...][layer] for n in names}
        eps = self.cfg.rms_norm_eps
        e = L.rms_norm(self.embed_tokens(tokens), p["enorm"], eps)
        h = L.rms_norm(prev_hidden.astype(e.dtype), p["hnorm"], eps)
        x = jnp.concatenate([e, h], axis=-1) @ p["eh_proj"]  # [B, T, D]
        x, mtp_cache = self._block(p, x, positions, mtp_cache, depth, depth + 1, moe=True)
        out = L.rms_norm(x, p["out_norm"], eps)
        return out, self.logits(out), mtp_cache

    def _check_mtp_depth(self, depth: int):
        if not 0 <= depth < self.cfg.num_mtp_layers:
            raise ValueError(
                f"MTP depth {depth} does not exist: config.json sets num_nextn_predict_layers="
                f"{self.cfg.num_mtp_layers} (an absent key reads as 0)."
            )

    # -- the decoder stack -----------------------------------------------------------------------------------------

    def _scan(self, x, positions, cache, start: int, stop: int, moe: bool, tree=None):
        """Layers [start, stop) of one FFN kind, scanned; `index` into the cache is the absolute layer number."""
        offset = self.cfg.moe.first_dense_layers if moe else 0
        attn_names = [*self.attention_shapes(), "attn_norm", "mlp_norm"]
        ffn_names = [n for n in (MOE_FFN if moe else DENSE_FFN) if hasattr(self, n)]
        # Index the full stacks inside the scan instead of slicing [start:stop] first: a slice would copy those
        # layers' weights on every call (see LlamaForCausalLM).
        attn = {n: getattr(self, n)[...] for n in attn_names}
        ffn = {n: getattr(self, n)[...] for n in ffn_names}

        def layer(carry, index):
            x, cache = carry
            p = {n: jax.lax.dynamic_index_in_dim(w, index, keepdims=False) for n, w in attn.items()}
            p |= {n: jax.lax.dynamic_index_in_dim(w, index - offset, keepdims=False) for n, w in ffn.items()}
            return self._block(p, x, positions, cache, index, 0, moe, tree), None

        (x, cache), _ = jax.lax.scan(layer, (x, cache), jnp.arange(start, stop))
        return x, cache

    def _block(self, p, x, positions, cache, index, first, moe: bool, tree=None):
        """One pre-norm decoder block; `first` is the lowest cache position its attention may see."""
        eps = self.cfg.rms_norm_eps
        out, cache = self.attention(p, L.rms_norm(x, p["attn_norm"], eps), positions, cache, index, first, tree)
        x = x + out
        h = L.rms_norm(x, p["mlp_norm"], eps)
        if moe:
            ffn = moe_ffn(self.cfg.moe, p, h, self.mesh, self.rules)
        else:
            ffn = L.gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])
        return x + ffn, cache


def mtp_chain_from_scratch(model: MoeCausalLM, tokens: jax.Array) -> jax.Array:
    """The draft logits of one MTP round by definition (HF `MTPCandidateGenerator`, verified semantics), with no
    state carried between calls: every depth runs over its whole window with fresh caches.

    tokens: [B, T], the sequence so far (last = newest token, at position T-1). Depth 0 reads tokens 1..T-1 and the
    main model's hidden states at 0..T-2; depth k reads the window shifted by one, with depth k-1's argmax draft
    appended, and depth k-1's outputs. Returns the last position's logits of every depth: [B, K, V].
    """
    b, t = tokens.shape
    k = model.num_mtp_layers
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, hidden, _ = model(tokens[:, :-1], positions[:, :-1], model.init_cache(b, t))  # [B, T-1, D]
    window, pos, prev = tokens[:, 1:], positions[:, 1:], hidden
    drafts = []
    for depth in range(k):
        out, logits, _ = model.mtp_step(depth, window, prev, pos, model.init_mtp_cache(b, t + k))
        drafts.append(logits[:, -1])
        next_token = jnp.argmax(logits[:, -1], axis=-1)[:, None]  # [B, 1]
        window, pos, prev = jnp.concatenate([window[:, 1:], next_token], axis=1), pos + 1, out
    return jnp.stack(drafts, axis=1)  # [B, K, V]

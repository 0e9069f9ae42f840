"""Every family module implements the Protocols of jaxspec/model_interface.py, with the same parameter names.

`runtime_checkable` isinstance only sees that the members exist; the signature check catches a renamed or
reordered parameter, which drafters pass by keyword or position. Modules are tiny and built from config dicts (no
checkpoint); shapes are checked abstractly with jax.eval_shape, so nothing here runs a forward.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest
import transformers
from flax import nnx

from jaxspec import registry
from jaxspec.models.layers import abstract_module
from jaxspec.model_interface import (BlockDrafterModel, CausalLM, DrafterModel, DraftVocabModel, Eagle3HeadModel, MtpModel,
                                     SharedKvModel)

B, T, S = 2, 3, 8

DENSE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
GEMMA = {  # Gemma defaults are real-model sizes (head_dim 256, PLE 256); these keep them tiny
    "gemma2": (transformers.Gemma2Config, dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "gemma4_text": (transformers.Gemma4TextConfig,
                    dict(head_dim=8, global_head_dim=16, sliding_window=4, num_kv_shared_layers=2,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                         layer_types=["sliding_attention", "full_attention"] * 2)),
}
MOE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
           n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, max_position_embeddings=64,
           num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=1)
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16)
GEMMA4_DRAFTER = {"model_type": "gemma4_assistant", "backbone_hidden_size": 32,
                  "text_config": {"vocab_size": 128, "hidden_size": 24, "intermediate_size": 48,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 8, "global_head_dim": 16, "sliding_window": 4,
                                  "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                  "layer_types": ["sliding_attention", "full_attention"]}}
DFLASH_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, sliding_window=4, block_size=4)
DFLASH_DRAFTERS = {  # both layouts of the DFlash block drafter: transformers' own, and z-lab's (a Qwen3 config)
    "muse_glimmer_assistant": dict(DFLASH_SIZES, model_type="muse_glimmer_assistant", target_layer_ids=[0, 2],
                                   mask_token_id=100),
    "DFlashDraftModel": dict(DFLASH_SIZES, model_type="qwen3", architectures=["DFlashDraftModel"], vocab_size=128,
                             dflash_config={"mask_token_id": 100, "target_layer_ids": [0, 2]}),
}


EAGLE3_HEAD = dict(DENSE, architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                   draft_vocab_size=48, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})


def _hf(config_cls, **kwargs) -> dict:
    """config.json as transformers writes it for these settings."""
    return config_cls(**kwargs).to_dict()


# case: (model_type, config.json dict, the Protocols the module implements)
LLAMA_LIKE = (CausalLM, MtpModel, DraftVocabModel)  # with a draft vocabulary
CASES = {
    "llama": ("llama", _hf(transformers.LlamaConfig, **DENSE), (CausalLM, MtpModel)),
    "llama_mtp_draft_vocab": ("llama", _hf(transformers.LlamaConfig, **DENSE) | {"num_nextn_predict_layers": 2,
                                                                                 "draft_vocab_size": 16},
                              LLAMA_LIKE),
    "qwen2": ("qwen2", _hf(transformers.Qwen2Config, **DENSE), (CausalLM, MtpModel)),
    "qwen3": ("qwen3", _hf(transformers.Qwen3Config, **DENSE, head_dim=16), (CausalLM, MtpModel)),
    "deepseek_v3": ("deepseek_v3", _hf(transformers.DeepseekV3Config, **MOE, **DEEPSEEK), (CausalLM, MtpModel)),
    "glm4_moe": ("glm4_moe", _hf(transformers.Glm4MoeConfig, **MOE, num_key_value_heads=2), (CausalLM, MtpModel)),
    "qwen3_moe": ("qwen3_moe", _hf(transformers.Qwen3MoeConfig, **DENSE, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, head_dim=16), (CausalLM, MtpModel)),
    **{family: (family, _hf(config_cls, **DENSE, **overrides), (CausalLM, SharedKvModel))
       for family, (config_cls, overrides) in GEMMA.items()},
    "gemma4_assistant": ("gemma4_assistant", GEMMA4_DRAFTER, (DrafterModel,)),
    **{key: (key, hf_config, (BlockDrafterModel,)) for key, hf_config in DFLASH_DRAFTERS.items()},
    "LlamaForCausalLMEagle3": ("LlamaForCausalLMEagle3", EAGLE3_HEAD, (Eagle3HeadModel,)),
}
PROTOCOLS = (CausalLM, MtpModel, DraftVocabModel, SharedKvModel, DrafterModel, BlockDrafterModel, Eagle3HeadModel)


def _module(case: str):
    model_type, hf_config, _ = CASES[case]
    family = registry.FAMILIES[model_type]
    return family.model_cls()(family.config_from_hf(hf_config), rngs=nnx.Rngs(0))


def _members(protocol) -> dict[str, object]:
    """The methods and properties a Protocol declares, its bases' included (data members are in annotations)."""
    members = {}
    for klass in reversed(protocol.__mro__):
        if klass in PROTOCOLS:
            members |= {name: value for name, value in vars(klass).items()
                        if (callable(value) or isinstance(value, property))
                        and (not name.startswith("_") or name == "__call__")}
    return members


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def signature_mismatches(protocol, cls) -> list[str]:
    """Members of `protocol` that `cls` lacks, or declares with other parameter names or defaults."""
    wrong = []
    for name, declared in _members(protocol).items():
        actual = inspect.getattr_static(cls, name, None)
        if isinstance(declared, property):
            if not isinstance(actual, property):
                wrong.append(f"{name}: expected a property, got {actual!r}")
        elif actual is None or not callable(actual):
            wrong.append(f"{name}: missing")
        elif _parameters(actual) != _parameters(declared):
            wrong.append(f"{name}: {_parameters(actual)} != {_parameters(declared)}")
    return wrong


def test_every_registered_family_has_a_case():
    """A new family in the registry must be added here, so it is checked against the Protocols."""
    assert set(registry.FAMILIES) <= {model_type for model_type, _, _ in CASES.values()}


@pytest.mark.parametrize("case", CASES)
def test_family_implements_its_protocols(case):
    module = _module(case)
    implements = CASES[case][2]
    for protocol in implements:
        assert isinstance(module, protocol), (case, protocol.__name__)
        assert signature_mismatches(protocol, type(module)) == [], (case, protocol.__name__)
    for protocol in set(PROTOCOLS) - set(implements):
        # isinstance sees names only (a CausalLM has every name a DrafterModel has): the signatures tell them apart
        assert not isinstance(module, protocol) or signature_mismatches(protocol, type(module)), (case, protocol)
    if getattr(module, "num_mtp_layers", 0):
        assert isinstance(module, MtpModel)


@pytest.mark.parametrize("case", [c for c, (_, _, implements) in CASES.items() if CausalLM in implements])
def test_causal_lm_shapes(case):
    """The shapes the Protocol docstrings state, abstractly (no forward runs)."""
    module = _module(case)
    cfg = module.cfg
    d, v = cfg.hidden_size, cfg.vocab_size
    tokens = jnp.zeros((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, hidden, _ = jax.eval_shape(lambda: module(tokens, positions, module.init_cache(B, S)))
    assert (logits.shape, logits.dtype, hidden.shape) == ((B, T, v), jnp.float32, (B, T, d))
    pieces = jax.eval_shape(lambda: module.logits(module.final_hidden(
        module.run_layers(module.embed_tokens(tokens), positions, module.init_cache(B, S))[0])))
    assert pieces.shape == (B, T, v)
    if isinstance(module, MtpModel) and module.num_mtp_layers:
        out, mtp_logits, _ = jax.eval_shape(
            lambda: module.mtp_step(0, tokens, jnp.zeros(hidden.shape, hidden.dtype), positions,
                                    module.init_mtp_cache(B, S)))
        assert (out.shape, mtp_logits.shape) == ((B, T, d), (B, T, v))
    if isinstance(module, DraftVocabModel) and cfg.draft_vocab_size:
        drafts = jax.eval_shape(lambda: module.draft_logits(jnp.zeros((B, T, d))))
        restricted = jax.eval_shape(lambda: module.draft_vocab_logits(jnp.zeros((B, T, d))))
        assert (drafts.shape, restricted.shape) == ((B, T, v), (B, T, cfg.draft_vocab_size))
    if isinstance(module, SharedKvModel):
        assert jax.eval_shape(lambda: module.input_embeddings(tokens)).shape == (B, T, d)


def test_drafter_model_shapes():
    drafter = _module("gemma4_assistant")
    target = _module("gemma4_text")
    d_t, v = target.cfg.hidden_size, target.cfg.vocab_size
    cache = target.init_cache(B, S)
    shared = {t: target.shared_kv(cache, t) for t in set(drafter.cfg.layer_types)}
    positions = jnp.full((B, 1), 2)
    logits, hidden = jax.eval_shape(lambda: drafter(jnp.zeros((B, 1, 2 * d_t)), positions, shared))
    assert (logits.shape, logits.dtype, hidden.shape) == ((B, 1, v), jnp.float32, (B, 1, d_t))


def test_a_renamed_parameter_fails_the_check():
    """The negative control of `signature_mismatches`: a module whose `run_layers` renames `stop` is caught."""

    class Renamed(type(_module("llama"))):
        def run_layers(self, x, positions, cache, start=0, end=None, tree=None):
            return super().run_layers(x, positions, cache, start, end, tree)

    assert signature_mismatches(CausalLM, Renamed) == [
        "run_layers: [('self', <class 'inspect._empty'>), ('x', <class 'inspect._empty'>), "
        "('positions', <class 'inspect._empty'>), ('cache', <class 'inspect._empty'>), ('start', 0), ('end', None), "
        "('tree', None)] != [('self', <class 'inspect._empty'>), ('x', <class 'inspect._empty'>), "
        "('positions', <class 'inspect._empty'>), ('cache', <class 'inspect._empty'>), ('start', 0), ('stop', None), "
        "('tree', None)]"
    ]


@pytest.mark.parametrize("case", CASES)
def test_abstract_module_is_what_eval_shape_builds(case):
    """Loading builds modules with `abstract_module` (no initialiser traced); it must give what `nnx.eval_shape`
    gives: the same graph, every param a ShapeDtypeStruct of the same shape and dtype."""
    model_type, hf_config, _ = CASES[case]
    family = registry.FAMILIES[model_type]
    cfg = family.config_from_hf(hf_config)

    def build():
        return family.model_cls()(cfg, dtype=jnp.bfloat16)

    expected_graph, expected = nnx.split(nnx.eval_shape(build))
    graph, state = nnx.split(abstract_module(build))
    assert graph == expected_graph
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(lambda x: (x.shape, x.dtype), expected)
    assert not isinstance(jax.tree.leaves(nnx.state(build()))[0], jax.ShapeDtypeStruct)  # outside it: real values

"""The models and strategies of benchmarks/bench.py, and jaxspec's side of the race.

A `ModelSource` says where one benchmark model's weights live (the same path goes to both libraries), a `Plan` what
one strategy passes to each library's generate(); `jaxspec_call` times jaxspec's generate() on one prompt.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from _bench_hf import save_prefix_pair, save_random_llama
from _bench_prompts import PROMPTS, RANDOM_PROMPT_LENGTHS
from _bench_timing import Call, CallFn

STRATEGIES = ("greedy", "speculative", "speculative-self", "prompt_lookup", "early_exit", "universal",
              "speculative-int8", "universal-int8", "mtp", "dflash", "eagle3")
# `speculative-int8` and `universal-int8`: the same assistant with int8 weights and activations (jaxspec.quantize).
# jaxspec only: transformers' assisted generate has no int8 CPU assistant to compare with.
INT8 = "-int8"
# `mtp`: the target's own MTP layers draft (`use_mtp=True`; for a catalogue model, the trained layers jaxspec ships
# and attaches when it loads the model by name). jaxspec only: transformers runs MTP for DeepSeek-V3-style
# checkpoints alone, not for the Llama/Qwen2 targets that jaxspec attaches trained layers to.
MTP = "mtp"
# `dflash`: the DFlash drafter jaxspec ships for a catalogue model (`CatalogEntry.drafter_assets`). jaxspec only: it is
# saved in z-lab's `DFlashDraftModel` layout, which transformers' `speculation_type="dflash"` does not load (it runs
# its own muse_glimmer_assistant layout; tests/strategies/test_dflash.py compares the two on that layout).
DFLASH = "dflash"
# `eagle3`: the EAGLE-3 head jaxspec ships for a catalogue model, K=4. jaxspec only: transformers 5.23 has no EAGLE-3.
EAGLE3 = "eagle3"
EAGLE3_DRAFTS = 4
JAXSPEC_ONLY = (MTP, DFLASH, EAGLE3)  # besides the -int8 strategies

# Random Llama configs. 49152 is the SmolLM2 vocabulary, so its tokenizer's ids are valid prompts for them too.
RANDOM_COMMON = dict(
    vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
)
RANDOM_MODELS = {
    # 24 x 15.7M layer params + 2 x 50.3M untied embedding/head = 478M parameters.
    "random-500m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                        num_key_value_heads=8),
    "random-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2),
}
TARGET_SEED, ASSISTANT_SEED = 0, 1
# `random-500m-prefix`: random-500m whose layers past the first PREFIX_LAYERS add nothing (zero output and down
# projections), with those first layers (and the shared embedding, norm and head) as its assistant. The assistant
# then predicts exactly what the target predicts at a fraction of its cost: every draft is accepted and the
# target still reads all its weights per forward. This isolates the loop's own overhead at full acceptance.
PREFIX_LAYERS = 2

# Catalogue targets with an installed same-tokenizer assistant (speculative decoding needs the same vocabulary).
CATALOG_ASSISTANTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}

# The default assistant of `universal` (an assistant with another tokenizer than the target's).
UNIVERSAL_ASSISTANT = "smollm2-135m"

# Source of prompt token ids for random models: the SmolLM2 tokenizer, when its package is installed.
PROMPT_TOKENIZER_MODEL = "smollm2-135m"


def jaxspec_only(strategy: str) -> bool:
    """Strategies that transformers has no counterpart of: their rows have jaxspec's figures alone."""
    return strategy.endswith(INT8) or strategy in JAXSPEC_ONLY


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """What the drafting strategies get; both libraries receive exactly these values."""

    num_assistant_tokens: int
    schedule: str
    confidence_threshold: float
    prompt_lookup_num_tokens: int
    early_exit: int


@dataclasses.dataclass
class ModelSource:
    """Where one benchmark model's weights live; the same path goes to both libraries."""

    name: str
    kind: str  # "catalog" or "random"
    path: str  # a .gguf file or an HF folder
    assistant_path: str | None  # same-vocabulary drafter for `speculative`, if there is one
    num_layers: int
    universal_path: str | None = None  # drafter with another tokenizer for `universal` (--universal-assistant)
    # `mtp`: what jaxspec.load takes to give the target with MTP layers (a catalogue name whose entry ships a trained
    # set), and that set's name; None where the model has none.
    mtp_path: str | None = None
    mtp_asset: str | None = None
    dflash_path: str | None = None  # `dflash`: the shipped drafter's name (jaxspec.load takes it), if any
    eagle3_path: str | None = None  # `eagle3`: the shipped head's name, if any


@dataclasses.dataclass
class Plan:
    """One strategy on one model: the generate() arguments of each library and the draft-length settings."""

    strategy: str
    settings: str  # human-readable, for the table
    # Whose generation_config HF reads: "assistant", "universal", "target" (self / early exit) or None; "mtp": jaxspec
    # runs this plan on the target loaded with its MTP layers.
    drafter: str | None
    jaxspec_kwargs: dict[str, Any]
    hf_kwargs: dict[str, Any]
    draft_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # jaxspec's generate() arguments
    hf_draft_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # set on HF's drafting model


def unfused(model):
    """`model` with each member of a fused projection group (`jaxspec.layout.FUSED_GROUPS`) in its own array and
    product, as before the groups were fused: the other side of that change's A/B (bench_weight_layout.py,
    bench_verify_width.py)."""
    import jax
    from flax import nnx

    from jaxspec.models import int8 as I

    def alone(w):
        return I.TransposedWeight(w.stored, w.perm) if isinstance(w, I.TransposedWeight) else w

    graphdef, state = nnx.split(model.module)
    state = jax.tree.map(alone, state, is_leaf=lambda leaf: isinstance(leaf, I.TransposedWeight))
    return dataclasses.replace(model, module=nnx.merge(graphdef, state))


def weight_bytes_per_token(module) -> tuple[int, int]:
    """(parameters, bytes read per decoded token) of a jaxspec module.

    A tied embedding is read once per token, as the LM head; an untied input embedding contributes one row, which
    is left out. KV-cache reads are left out too: at these context lengths they are small next to the weights.
    """
    import jax
    from flax import nnx

    # Each array once: the members of a fused group (jaxspec/layout.py) hold one buffer.
    leaves = list({id(x): x for x in jax.tree.leaves(nnx.state(module, nnx.Param))}.values())
    parameters = sum(int(x.size) for x in leaves)
    nbytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    if not module.cfg.tie_word_embeddings:
        embed = module.embed[...]
        nbytes -= int(embed.size) * embed.dtype.itemsize
    return parameters, nbytes


# ------------------------------------------------------------------------------------------------------------------
# Models and prompts


def resolve_source(name: str, workdir: str, universal_assistant: str | None = None) -> ModelSource:
    """Catalogue name -> its GGUF (and assistant's); random name -> target and assistant saved into `workdir`."""
    if name.endswith("-prefix") and name.removesuffix("-prefix") in RANDOM_MODELS:
        overrides = RANDOM_MODELS[name.removesuffix("-prefix")]
        target, assistant = save_prefix_pair(os.path.join(workdir, name), TARGET_SEED, RANDOM_COMMON | overrides,
                                             PREFIX_LAYERS)
        return ModelSource(name, "random", target, assistant, overrides["num_hidden_layers"])
    if name in RANDOM_MODELS:
        overrides = RANDOM_MODELS[name]
        target = save_random_llama(os.path.join(workdir, name), TARGET_SEED, RANDOM_COMMON | overrides)
        half = dict(overrides, num_hidden_layers=max(1, overrides["num_hidden_layers"] // 2))
        assistant = save_random_llama(os.path.join(workdir, name + "-assistant"), ASSISTANT_SEED,
                                      RANDOM_COMMON | half)
        return ModelSource(name, "random", target, assistant, overrides["num_hidden_layers"])
    from jaxspec import catalog
    from jaxspec.convert.gguf import read_gguf

    if not catalog.is_catalog_name(name):
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join([*RANDOM_MODELS, *catalog.CATALOG])}")
    path = catalog.resolve(name)
    assistant = catalog.resolve(CATALOG_ASSISTANTS[name]) if name in CATALOG_ASSISTANTS else None
    universal = None
    if universal_assistant and universal_assistant != name:
        try:
            universal = catalog.resolve(universal_assistant)
        except FileNotFoundError:  # not installed: `universal` is skipped with a note
            pass
    asset = catalog.get_entry(name).mtp_asset
    return ModelSource(name, "catalog", path, assistant, read_gguf(path).hf_config["num_hidden_layers"], universal,
                       mtp_path=name if asset else None, mtp_asset=asset,
                       dflash_path=catalog.shipped_drafter(name, "dflash"),
                       eagle3_path=catalog.shipped_drafter(name, "eagle3"))


def prompt_tokenizer(source: ModelSource, jaxspec_model):
    """The model's own tokenizer; for random models SmolLM2's (when installed), whose ids fit their vocabulary."""
    if source.kind == "catalog":
        return jaxspec_model.tokenizer
    try:
        from jaxspec import catalog
        from jaxspec.convert.gguf import read_gguf

        return read_gguf(catalog.resolve(PROMPT_TOKENIZER_MODEL)).load_tokenizer()
    except (FileNotFoundError, ValueError):
        return None


def encode_prompts(tokenizer, vocab_size: int, names: list[str]) -> dict[str, np.ndarray]:
    """Prompt ids: through the chat template when the tokenizer has one; fixed random ids without a tokenizer."""
    if tokenizer is None:
        rng = np.random.default_rng(1234)
        return {n: rng.integers(3, vocab_size, RANDOM_PROMPT_LENGTHS[n]).astype(np.int32) for n in names}
    prompts = {}
    for name in names:
        text = PROMPTS[name]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts[name] = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    return prompts


def draft_settings(args, source: ModelSource) -> DraftSettings:
    """Flags win; otherwise per-kind defaults.

    Random models get no confidence stop: their draft distributions are nearly flat, so a 0.4 threshold would end
    every draft after one token and the self-drafting ceiling row would show K = 1 instead of K.
    """
    threshold = args.confidence_threshold
    if threshold is None:
        threshold = 0.0 if source.kind == "random" else 0.4
    return DraftSettings(
        num_assistant_tokens=args.num_assistant_tokens,
        schedule=args.schedule,
        confidence_threshold=threshold,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        early_exit=args.early_exit or max(1, source.num_layers // 2),
    )


def plan_for(strategy: str, source: ModelSource, s: DraftSettings) -> Plan | str:
    """The plan for `strategy`, or the reason it does not apply to this model."""
    if strategy.endswith(INT8):
        plan = plan_for(strategy[: -len(INT8)], source, s)
        if isinstance(plan, str):
            return plan
        return dataclasses.replace(plan, strategy=strategy, settings=f"{plan.settings} int8",
                                   drafter=plan.drafter + INT8)
    draft = dict(num_assistant_tokens=s.num_assistant_tokens, num_assistant_tokens_schedule=s.schedule,
                 assistant_confidence_threshold=s.confidence_threshold)
    hf_draft = draft | {"num_assistant_tokens_schedule": "constant" if s.schedule == "adaptive" else s.schedule}
    draft_text = f"K={s.num_assistant_tokens} {s.schedule} conf={s.confidence_threshold:g}"
    if strategy == "greedy":
        return Plan(strategy, "", None, {}, {})
    if strategy == "speculative":
        if source.assistant_path is None:
            return "no smaller checkpoint with the same tokenizer is installed"
        return Plan(strategy, f"{os.path.basename(source.assistant_path)} {draft_text}", "assistant", {}, {}, draft,
                    hf_draft)
    if strategy == "universal":
        if source.universal_path is None:
            return "no assistant with another tokenizer (--universal-assistant) is installed"
        return Plan(strategy, f"{os.path.basename(source.universal_path)} {draft_text}", "universal", {}, {}, draft,
                    hf_draft)
    if strategy == "speculative-self":
        return Plan(strategy, f"target drafts {draft_text}", "target", {}, {}, draft, hf_draft)
    if strategy == "prompt_lookup":
        n = s.prompt_lookup_num_tokens
        schedule = {"num_assistant_tokens_schedule": "adaptive" if s.schedule == "adaptive" else "constant"}
        return Plan(strategy, f"num_tokens={n} ngram=2 {schedule['num_assistant_tokens_schedule']}", None,
                    {"prompt_lookup_num_tokens": n} | schedule, {"prompt_lookup_num_tokens": n})
    if strategy == MTP:
        if source.mtp_path is None:
            return "no trained MTP layers for this model (the catalogue ships none)"
        # K: the asset's recommended draft length (use_mtp's default); the schedule as the other strategies run it.
        return Plan(strategy, f"{source.mtp_asset} K=its default {s.schedule}", MTP,
                    {"use_mtp": True, "num_assistant_tokens_schedule": s.schedule}, {})
    if strategy == DFLASH:
        if source.dflash_path is None:
            return "no DFlash drafter for this model (the catalogue ships none)"
        # K: the block's drafts (block_size - 1); the schedule as the other strategies run it.
        return Plan(strategy, f"{source.dflash_path} K=its block {s.schedule}", DFLASH, {}, {},
                    {"num_assistant_tokens_schedule": s.schedule})
    if strategy == EAGLE3:
        if source.eagle3_path is None:
            return "no EAGLE-3 head for this model (the catalogue ships none)"
        return Plan(strategy, f"{source.eagle3_path} K={EAGLE3_DRAFTS} {s.schedule}", EAGLE3, {}, {},
                    {"num_assistant_tokens": EAGLE3_DRAFTS, "num_assistant_tokens_schedule": s.schedule})
    if strategy == "early_exit":
        if not 1 <= s.early_exit < source.num_layers:
            return f"early exit {s.early_exit} is not inside 1..{source.num_layers - 1}"
        early_exit = {"assistant_early_exit": s.early_exit}
        return Plan(strategy, f"E={s.early_exit}/{source.num_layers} {draft_text}", "target", early_exit, early_exit,
                    draft, hf_draft)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def jaxspec_call(plan: Plan, target, assistants: dict, eos: list[int], pad: int, max_new_tokens: int) -> CallFn:
    """`assistants`: {"assistant": same-tokenizer drafter, "universal": drafter with another tokenizer, and their
    int8 copies as "assistant-int8", "universal-int8"; "mtp": the target loaded with its MTP layers, which then
    decodes in place of `target`}; a universal assistant brings its own tokenizer, which jaxspec maps onto the
    target's."""
    import jaxspec

    kwargs = plan.jaxspec_kwargs | plan.draft_config
    if plan.drafter == MTP:
        target = assistants[MTP]
    elif plan.drafter in assistants:
        kwargs["assistant_model"] = assistants[plan.drafter]
    elif plan.strategy == "speculative-self":
        kwargs["assistant_model"] = target

    def call(name: str, ids: np.ndarray) -> Call:
        start = time.perf_counter()
        out = jaxspec.generate(target, ids[None], max_new_tokens=max_new_tokens, eos_token_id=eos,
                               pad_token_id=pad, **kwargs)
        seconds = time.perf_counter() - start - out.compile_seconds  # the whole call; compile only on the first
        n = int(out.num_new_tokens[0])
        return Call(name, out.sequences[0, len(ids): len(ids) + n].tolist(), seconds,
                    out.compile_seconds, out.target_forwards, out.rounds,
                    n - 1,  # the prefill commits the first token, the rounds the rest
                    int(out.drafted.sum()), int(out.accepted.sum()))

    return call

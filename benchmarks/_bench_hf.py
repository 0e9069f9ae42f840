"""The transformers baseline of benchmarks/bench.py: everything that imports torch or transformers' models.

Random Llama checkpoints are built here (transformers' default init, fixed seed, saved with `save_pretrained`) and
both libraries load them; the catalogue's GGUF files load into transformers dequantized to float32. `hf_call` times
transformers' `generate` the way `jaxspec_call` times jaxspec's (the whole call), and `HFTally` counts what
transformers does not report. torch and transformers are imported inside functions, after the threads are set.
"""

from __future__ import annotations

import gc
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from _bench_timing import Call, CallFn

if TYPE_CHECKING:
    from _bench_plans import Plan


def set_torch_threads(threads: int) -> None:
    """Give torch the same cores as XLA (called after the process is pinned)."""
    import torch

    torch.set_num_threads(threads)


def versions() -> dict[str, Any]:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


def save_random_llama(folder: str, seed: int, config: dict[str, Any]) -> str:
    """A random transformers Llama (default init, fixed seed) saved with save_pretrained: both libraries load it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**config)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    del model
    gc.collect()
    return folder


def save_prefix_pair(folder: str, seed: int, config: dict[str, Any], prefix_layers: int) -> tuple[str, str]:
    """A target whose layers past `prefix_layers` are inert, and its first `prefix_layers` as an exact assistant."""
    import torch
    import transformers

    torch.manual_seed(seed)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():
        for layer in target.model.layers[prefix_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target.save_pretrained(folder)
    assistant = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**(config | {"num_hidden_layers": prefix_layers}))).eval()
    missing = assistant.load_state_dict(target.state_dict(), strict=False).missing_keys
    assert not missing, missing  # every assistant tensor is the target's
    assistant.save_pretrained(folder + "-assistant")
    del target, assistant
    gc.collect()
    return folder, folder + "-assistant"


class HFTally:
    """Counts what transformers' generate does not report: target forwards, and per verification round the drafted
    and accepted tokens (from the candidate generator's `update_candidate_strategy`, called once per round)."""

    def __init__(self, model):
        self.reset()
        model.register_forward_pre_hook(self._forward)
        original = model._get_candidate_generator

        def instrumented(*args, **kwargs):
            generator = original(*args, **kwargs)
            update = generator.update_candidate_strategy

            def counted(input_ids, scores, num_matches):
                self.rounds += 1
                self.drafted += scores.shape[1] - 1
                self.accepted += int(num_matches)
                self.round_tokens += int(num_matches) + 1
                return update(input_ids, scores, num_matches)

            generator.update_candidate_strategy = counted
            return generator

        model._get_candidate_generator = instrumented

    def reset(self) -> None:
        self.forwards = self.rounds = self.round_tokens = self.drafted = self.accepted = 0

    def _forward(self, module, args) -> None:
        self.forwards += 1


def hf_call(plan: Plan, target, assistants: dict, tally: HFTally, eos: list[int], pad: int,
            max_new_tokens: int, tokenizers: tuple | None = None) -> CallFn:
    """`tokenizers`: (target's, universal assistant's), for transformers' universal assisted decoding."""
    import torch

    kwargs = dict(plan.hf_kwargs)
    drafting_model = target if plan.drafter == "target" else assistants.get(plan.drafter)
    if plan.strategy in ("speculative", "speculative-self", "universal"):
        kwargs["assistant_model"] = drafting_model
    if plan.strategy == "universal":
        kwargs["tokenizer"], kwargs["assistant_tokenizer"] = tokenizers

    def call(name: str, ids: np.ndarray) -> Call:
        if drafting_model is not None:
            # HF reads draft length, schedule and threshold from the drafting model's generation_config (generate's
            # kwargs do not reach it), and a heuristic schedule writes back into it: set them before every call.
            for key, value in plan.hf_draft_config.items():
                setattr(drafting_model.generation_config, key, value)
        input_ids = torch.as_tensor(ids[None].astype(np.int64))
        tally.reset()
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=eos, pad_token_id=pad, **kwargs)
            seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        if plan.strategy == "greedy":
            # Plain decoding: one forward per token, which the hook counts.
            return Call(name, tokens, seconds, 0.0, tally.forwards, tally.forwards, len(tokens), 0, 0)
        # Assisted: one target forward per round, the first also holding the prompt. When the target drafts for
        # itself the hook cannot tell its drafting forwards apart, so the rounds are the count.
        return Call(name, tokens, seconds, 0.0, tally.rounds, tally.rounds, tally.round_tokens, tally.drafted,
                    tally.accepted)

    return call


def quiet_transformers() -> None:
    """No per-load progress bars, and no warning that HF's own assistant generate() triggers on every round."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_hf(path: str):
    """transformers' float32 model from an HF folder or (dequantized) from the GGUF file jaxspec reads."""
    import torch
    import transformers

    if path.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True),
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


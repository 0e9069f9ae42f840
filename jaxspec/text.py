"""Text in, text out: `generate_text` encodes prompts (or chat messages) with the model's tokenizer, runs `generate`
with any strategy's arguments, and decodes each row's new tokens."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .generate import generate
from .output import GenerateOutput

Messages = Sequence[dict[str, Any]]


def generate_text(
    model,
    prompts: str | Messages | Sequence[str] | Sequence[Messages],
    *,
    chat: bool | None = None,
    tokenizer: Any = None,
    skip_special_tokens: bool = True,
    return_output: bool = False,
    **kwargs,
) -> str | list[str] | tuple[str | list[str], GenerateOutput]:
    """Generate text for one prompt or a batch; every keyword of `jaxspec.generate` applies (strategies, sampling,
    processors, stop_strings, streamer, max_new_tokens, ...).

    `prompts`: a string, chat messages (a list of {"role": ..., "content": ...} dicts), or a list of either. Chat
    messages go through the tokenizer's chat template with the generation prompt; so do plain strings when
    `chat=True`. A single prompt returns a string, a list returns a list (`return_output=True` adds the
    `GenerateOutput`, with its counters).
    """
    given_tokenizer, tokenizer = tokenizer, tokenizer if tokenizer is not None else model.tokenizer
    if tokenizer is None:
        raise ValueError("generate_text needs a tokenizer: this model has none; pass tokenizer=.")
    single = isinstance(prompts, str) or _is_messages(prompts)
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise ValueError("prompts is empty.")
    rows = [_encode(tokenizer, prompt, chat) for prompt in batch]
    output = generate(model, rows, tokenizer=given_tokenizer, **kwargs)
    texts = [tokenizer.decode(output.new_tokens(row).tolist(), skip_special_tokens=skip_special_tokens)
             for row in range(len(rows))]
    result = texts[0] if single else texts
    return (result, output) if return_output else result


def _is_messages(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)


def _encode(tokenizer, prompt, chat: bool | None) -> list[int]:
    if _is_messages(prompt) or chat:
        messages = prompt if _is_messages(prompt) else [{"role": "user", "content": prompt}]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template: pass plain text with chat=False.")
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return [int(i) for i in np.asarray(ids).reshape(-1)]
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt must be a string or chat messages, got {type(prompt).__name__}.")
    return list(tokenizer(prompt)["input_ids"])

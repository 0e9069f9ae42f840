"""Tokenizers without torch: from a folder's tokenizer files, or from a GGUF file's metadata.

transformers builds a GGUF tokenizer with `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, but its GGUF reader
imports torch, which jaxspec never needs at run time. The part that turns the vocabulary into a fast tokenizer
(`transformers.integrations.gguf.convert_gguf_tokenizer`) needs no torch, so here gguf-py reads the metadata into
the same dictionaries transformers' reader would produce, and that converter builds the tokenizer. The result
encodes exactly as transformers' own GGUF tokenizer does (tests/test_tokenizer.py compares them).

A conversion folder stores the tokenizer it was built with (tokenizer.json, tokenizer_config.json with the chat
template), so restoring a conversion parses no GGUF.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from jaxspec.convert.errors import CheckpointError, read_json_object

# GGUF metadata key (after "tokenizer.") -> the name transformers' GGUF tokenizer converter reads.
_TOKENIZER_FIELDS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
# GGUF metadata key (after "tokenizer.") -> a tokenizer_config.json entry.
_CONFIG_FIELDS = {
    "chat_template": "chat_template",
    "ggml.add_bos_token": "add_bos_token",
    "ggml.add_eos_token": "add_eos_token",
}
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def gguf_tokenizer_fields(reader, where: str = "this GGUF file") -> tuple[str, dict[str, Any], dict[str, Any]]:
    """`(architecture, tokenizer fields, tokenizer_config)` from a `gguf.GGUFReader`, as transformers reads them.
    `where` names the file in errors."""
    metadata = {key: _contents(field, key, where) for key, field in reader.fields.items()
                if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{where} has no tokenizer (no tokenizer.ggml.tokens metadata).")
    architecture = _contents(reader.fields["general.architecture"], "general.architecture", where)
    fields = {name: metadata[f"tokenizer.{key}"] for key, name in _TOKENIZER_FIELDS.items()
              if f"tokenizer.{key}" in metadata}
    config = {name: metadata[f"tokenizer.{key}"] for key, name in _CONFIG_FIELDS.items()
              if f"tokenizer.{key}" in metadata}
    if fields.get("tokenizer_type") == "llama":
        # As transformers: llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        config.setdefault("add_bos_token", True)
    elif fields.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False  # Gemma 4's chat template writes <bos> itself (transformers does the same)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(fields["tokens"]):
            raise CheckpointError(f"{where}: tokenizer.ggml.{key} is {token_id}, but the vocabulary has "
                                  f"{len(fields['tokens'])} tokens; the metadata is damaged.")
        config[name] = fields["tokens"][token_id] if token_id is not None else None
    return architecture, fields, config


def _contents(field, key: str, where: str) -> Any:
    """A GGUF metadata value; gguf-py decodes strings lazily, and bytes that are not UTF-8 mean a damaged file."""
    try:
        return field.contents()
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{where}: GGUF metadata {key!r} is not valid UTF-8 text ({error}); the file is "
                              "damaged.") from None


def tokenizer_from_gguf(reader, where: str = "this GGUF file") -> Any:
    """A fast tokenizer built from a GGUF file's metadata (`reader`: a `gguf.GGUFReader`); torch is not imported."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    architecture, fields, config = gguf_tokenizer_fields(reader, where)
    backend, extra = convert_gguf_tokenizer(architecture, fields)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **(config | extra))


def class_name(tokenizer: Any) -> str:
    """`tokenizer`'s class as "module:name", which a conversion's marker records for `load_tokenizer`."""
    return f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"


def _tokenizer_class(name: str) -> Any | None:
    """The transformers tokenizer class `class_name` named, or None where this transformers has no such class."""
    module, _, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not module.startswith("transformers."):
        return None
    try:
        return getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        return None


def load_tokenizer(folder: str, saved_class: str | None = None) -> Any | None:
    """The tokenizer saved in `folder` (tokenizer.json and friends), or None when the folder has none.

    `saved_class` ("module:name", `class_name`): the class the tokenizer was saved from, which a conversion folder's
    marker records; it is built directly, so a restored model has the tokenizer its conversion had. `AutoTokenizer`
    would first read the model's config through transformers' model registry, which imports torch wherever torch is
    installed (a Colab, a test environment): most of a load there (docs/design.md, 'The tokenizer without
    AutoTokenizer'). For a GGUF conversion it would also pick the model type's class over the `TokenizersBackend` built
    from the file, which encodes alike. Without `saved_class`, or where this transformers has no such class,
    `AutoTokenizer` chooses.

    transformers reports a damaged tokenizer file with an error that does not name it (the `tokenizers` library
    raises a bare Exception); when loading fails, a JSON file of the folder that does not parse is named instead."""
    if not any(os.path.exists(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        return None
    tokenizer_cls = _tokenizer_class(saved_class) if saved_class else None
    if tokenizer_cls is None:
        from transformers import AutoTokenizer as tokenizer_cls

    try:
        return tokenizer_cls.from_pretrained(folder)
    except Exception:
        for name in JSON_FILES:
            if os.path.exists(os.path.join(folder, name)):
                read_json_object(os.path.join(folder, name))  # raises CheckpointError for the damaged file
        raise  # no damaged file found: the original error, untouched

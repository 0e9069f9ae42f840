"""Torch-free GGUF tokenizers: the same encodings as transformers' own GGUF tokenizer, without importing torch.

GGUF files are written here with gguf-py: a byte-level BPE vocabulary trained with the tokenizers library (the
SmolLM2 and Qwen kind) and a sentencepiece-style vocabulary with scores (the Llama 2 and Gemma kind). The oracle is
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, which needs torch; jaxspec's must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxspec.tokenizer import tokenizer_from_gguf
from tests.fixtures.paths import REPO_ROOT
from tests.fixtures.text import CORPUS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "Hello world",
    "  leading spaces\n\tand tabs",
    "def evens(n):\n    for i in range(n):\n        print(i)",
    "Ünïcödé ✓ 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def _write_arch(writer: gguf.GGUFWriter, vocab: int) -> None:
    """Just enough model metadata for transformers to build a config from the file."""
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_byte_level_gguf(path: str, arch: str = "qwen2") -> None:
    """A byte-level BPE vocabulary trained on CORPUS, with control tokens and a chat template."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    writer = gguf.GGUFWriter(path, arch)
    _write_arch(writer, len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_bos_token_id(model["vocab"]["<|endoftext|>"])
    writer.add_eos_token_id(model["vocab"]["<|im_end|>"])
    writer.add_pad_token_id(model["vocab"]["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    _finish(writer)


def write_sentencepiece_gguf(path: str, arch: str = "llama") -> None:
    """A sentencepiece-style vocabulary (tokenizer model `llama`): pieces with scores and byte fallback tokens."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = sorted({w for text in CORPUS for w in text.replace("\n", " ").split(" ") if w})
    letters = sorted({c for text in CORPUS for c in text if not c.isspace()})
    pieces += ["▁"] + letters + ["▁" + w for w in words] + [w for w in words if len(w) > 1]
    pieces = list(dict.fromkeys(pieces))
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    writer = gguf.GGUFWriter(path, arch)
    _write_arch(writer, len(pieces))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    _finish(writer)


def transformers_tokenizer(path: str):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_encodes_like_transformers(tmp_path, kind):
    path = str(tmp_path / f"{kind}.gguf")
    (write_byte_level_gguf if kind == "byte_level" else write_sentencepiece_gguf)(path)
    ours, theirs = tokenizer_from_gguf(gguf.GGUFReader(path)), transformers_tokenizer(path)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


def test_chat_template_comes_from_the_file(tmp_path):
    path = str(tmp_path / "chat.gguf")
    write_byte_level_gguf(path)
    ours, theirs = tokenizer_from_gguf(gguf.GGUFReader(path)), transformers_tokenizer(path)
    messages = [{"role": "user", "content": "Write a haiku"}]
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = ours.apply_chat_template(messages, **kwargs)
    assert ids == theirs.apply_chat_template(messages, **kwargs)
    assert ours.decode(ids).endswith("<|im_start|>assistant\n")


def test_a_file_without_a_tokenizer_is_named(tmp_path):
    path = str(tmp_path / "bare.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    _write_arch(writer, 8)
    _finish(writer)
    with pytest.raises(ValueError, match="no tokenizer"):
        tokenizer_from_gguf(gguf.GGUFReader(path))


def test_loading_and_generating_never_import_torch(tmp_path):
    """The runtime path a user without torch takes: GGUF -> model + tokenizer -> generate -> decode.

    Runs in a fresh interpreter: this test process has torch loaded already (it is the oracle elsewhere).
    """
    from tests.fixtures.gguf import tiny_model, write_gguf

    path = str(tmp_path / "model.gguf")
    write_gguf(tiny_model("qwen2", True), path)
    script = textwrap.dedent(f"""
        import sys
        import jaxspec
        model = jaxspec.load({path!r})
        ids = model.tokenizer("ab cd")["input_ids"]
        out = jaxspec.generate(model, [ids], max_new_tokens=4, prompt_lookup_num_tokens=2)
        model.tokenizer.decode(out.sequences[0].tolist())
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
    """)
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAXSPEC_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=REPO_ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_catalogue_tokenizers_equal_transformers(name):
    from jaxspec import catalog

    try:
        path = catalog.resolve(name)
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    ours, theirs = tokenizer_from_gguf(gguf.GGUFReader(path)), transformers_tokenizer(path)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    if theirs.chat_template:
        messages = [{"role": "user", "content": "Write a haiku"}]
        kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(messages, **kwargs)
    assert np.array_equal(sorted(ours.get_vocab().values()), sorted(theirs.get_vocab().values()))

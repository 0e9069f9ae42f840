"""notebooks/quickstart.ipynb runs top to bottom (nbclient, CPU, 8 fake devices) on a tiny random Llama, so that it
cannot rot: every cell but the Colab install cell executes without an error, and the outputs say what the notebook
promises (the greedy output of each strategy it runs identical to plain greedy, sharded output equal to unsharded,
a plot).

Slow only (~55 s): the default suite runs only the character tokenizer check below, not the notebook."""

from __future__ import annotations

import os

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from nbclient import NotebookClient

from tests.fixtures import hf_models
from tests.fixtures.paths import NOTEBOOKS

NOTEBOOK = os.path.join(NOTEBOOKS, "quickstart.ipynb")
TIMEOUT_S = 600  # per cell; a cell that hangs fails the test instead of the suite

# The notebook's text, in a tiny model's vocabulary: one token per ASCII character, so prompts keep their shape
# (prompt lookup finds real n-grams) and decoded outputs are text; ids 0-3 are the special tokens.
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def character_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)} | {chr(i): i for i in range(len(SPECIALS), 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A 4-layer random Llama over the character vocabulary, long enough for the notebook's chat prompts."""
    folder = hf_models.save_tiny("llama", tmp_path_factory.mktemp("notebook_model"), seed=0,
                                 max_position_embeddings=1024)
    character_tokenizer().save_pretrained(folder)
    return folder


def test_character_tokenizer_round_trips_the_notebook_prompts():
    tokenizer = character_tokenizer()
    text = "def evens(n):\n    for i in range(n):\n        print(i)"
    ids = tokenizer(text)["input_ids"]
    assert ids == [ord(c) for c in text]
    assert tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert tokenizer.decode(chat) == "<s>user\nhi</s>\n<s>assistant\n"


@pytest.mark.slow  # ~55 s: a kernel compiles about eight loops
def test_quickstart_notebook_runs_top_to_bottom(tiny_chat_model, monkeypatch, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    skipped = [cell for cell in notebook.cells if "install" in cell.metadata.get("tags", [])]
    assert len(skipped) == 1 and "%pip install" in skipped[0].source
    compile(TransformerManager().transform_cell(skipped[0].source), "install cell", "exec")  # valid IPython
    notebook.cells = [cell for cell in notebook.cells if cell not in skipped]

    # The kernel inherits this environment. The notebook compiles about eight loops and decodes a few hundred tokens
    # of a tiny model: XLA's backend at -O0 roughly halves the compile time, which is nearly all of this test's.
    monkeypatch.setenv("JAXSPEC_NOTEBOOK_MODEL", tiny_chat_model)
    monkeypatch.setenv("JAXSPEC_NOTEBOOK_MAX_NEW_TOKENS", "12")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    client = NotebookClient(notebook, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.outputs if output.output_type == "stream")
    assert "8 cpu devices" in printed
    for strategy in ("plain greedy", "prompt lookup", "early exit", "self-speculative"):
        assert f"code edit  {strategy}" in printed, strategy
    assert "Every strategy's greedy output is identical to plain greedy: True" in printed
    assert "This model has no MTP layers: MTP is skipped." in printed
    assert "--- repetition_penalty=1.3: compile 0.0s" in printed  # a new penalty reuses the sampling executable
    assert "code edit, sampled: plain" in printed
    assert "Sharded output equals unsharded: True" in printed
    assert "mesh {'data': 2, 'model': 4}" in printed
    images = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert len(images) == 1  # the acceptance histograms

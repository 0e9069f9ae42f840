"""Universal assisted decoding: an assistant with another tokenizer.

Two real tokenizers built here with the tokenizers library: a byte-level BPE (GPT-2 / Qwen / SmolLM2 kind: `Ġ`,
`Ċ`, ChatML special tokens) and a Llama-2-style sentencepiece BPE (`▁`, a space added in front of a text, `<0xNN>`
byte fallback, `<s>`). The tables are checked on their own (round trips, special tokens, byte pieces, the leading
space), then the loop: greedy output equals transformers' plain greedy and its universal run, batches with ragged
rows; each round's accepted count equals a replay with transformers' models; sampled output follows the target's
exact law (chi-square); user mistakes are errors that name the fix.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

import jaxspec
from jaxspec import vocab_map as vm
from jaxspec.strategies.universal import tokenizer_pair
from tests.fixtures import hf_models, oracles

from jaxspec import loop

CORPUS = [
    "def evens(n):\n    return [i for i in range(n) if i % 2 == 0]\n",
    "def merge(a, b):\n    result = []\n    for x in a:\n        result.append(x)\n    return result\n",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Hello there, how are you today? I am fine, thank you.",
    "naïve café, 日本語 and 🙂 emoji",
] * 10
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello world! The quick brown fox",
    "def evens(n):\n    return [i for i in range(n)]",
    "  two leading spaces\n\n\tand a tab",
    "naïve café 日本語 🙂 ✓",
    "zebra quartz xylophone",  # words neither vocabulary has merges for
]
PROMPTS = ["def merge(a, b):\n    result", "Hello there, how", "The quick brown fox jumps over the"]
N = 24


def byte_level_tokenizer(vocab_size: int = 300, drop_merges: int = 0, seed: int | None = None):
    """A byte-level BPE trained on CORPUS. `drop_merges`: remove the last merges and their tokens (a vocabulary that
    spells some of the full one's tokens in pieces); `seed`: shuffle the ids of the ordinary tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if drop_merges or seed is not None:
        spec = json.loads(bpe.to_str())
        merges = spec["model"]["merges"]
        gone = {"".join(m if isinstance(m, list) else m.split(" ")) for m in merges[len(merges) - drop_merges:]}
        spec["model"]["merges"] = merges[: len(merges) - drop_merges]
        kept = [t for t in sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get) if t not in gone]
        ordinary = kept[len(CHATML):]
        if seed is not None:
            ordinary = [ordinary[i] for i in np.random.default_rng(seed).permutation(len(ordinary))]
        spec["model"]["vocab"] = {t: i for i, t in enumerate(kept[: len(CHATML)] + ordinary)}
        bpe = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def sentencepiece_tokenizer():
    """Llama-2-style sentencepiece BPE: a `▁` put in front of the text, `▁` for spaces, byte fallback, `<s>` first.
    Its pieces are the prefixes of the corpus's words (so every word is reachable by merges) and its characters."""
    words = sorted({w for text in CORPUS for w in re.findall(r"\w+|[^\w\s]+", text)})
    chars = sorted({c for text in CORPUS for c in text if not c.isspace()})
    pieces = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [vm.SPACE] + chars
    # Merge ranks: word-initial pieces (with `▁`) first, then by length, then by text. A total order keeps the
    # tokenization the same in every process (set order follows the string hash seed), and building each word from
    # its start makes `▁Hello` one token.
    grown = sorted({p[:i] for w in words for p in (vm.SPACE + w, w) for i in range(2, len(p) + 1)},
                   key=lambda p: (not p.startswith(vm.SPACE), len(p), p))
    pieces = list(dict.fromkeys(pieces + grown))
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [(p[:-1], p[-1]) for p in grown]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend(vm.SPACE), normalizers.Replace(" ", vm.SPACE)])
    sp.decoder = decoders.Sequence([decoders.Replace(vm.SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    sp.add_special_tokens(pieces[:5])
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece():
    return sentencepiece_tokenizer()


def save_model(folder, tokenizer, seed: int, layers: int) -> str:
    hf_models.save_tiny("llama", folder, seed=seed, vocab_size=len(tokenizer), num_hidden_layers=layers)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, byte_level, sentencepiece):
    """Byte-level target + sentencepiece assistant, and the other way round (different vocabulary sizes)."""
    return {
        "byte_level": save_model(tmp_path_factory.mktemp("bl"), byte_level, seed=0, layers=2),
        "sentencepiece": save_model(tmp_path_factory.mktemp("sp"), sentencepiece, seed=1, layers=1),
    }


@pytest.fixture(scope="module")
def loaded(folders):
    return {kind: jaxspec.load(folder) for kind, folder in folders.items()}


def encode(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


# -- the tables ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["byte_level->sentencepiece", "sentencepiece->byte_level"])
def test_tables_hold_round_trips(byte_level, sentencepiece, direction):
    """text -> target ids -> assistant ids -> text, token by token (the loop's context) and for a prompt."""
    tokenizers = {"byte_level": byte_level, "sentencepiece": sentencepiece}
    target, assistant = (tokenizers[k] for k in direction.split("->"))
    tables = vm.build(target, assistant, len(target), len(assistant))
    assert tables.inexpressible == 0  # both can write any byte
    for text in TEXTS:
        ids = target(text, add_special_tokens=False)["input_ids"]
        expanded = [a for t in ids for a in tables.expansion(t)]
        # Token by token, every target token keeps its exact bytes (its text in the middle of a text).
        assert tables.assistant.text_of(expanded) == tables.target.text_of(ids), text
        # A prompt reads as the same text, with the assistant's own start-of-text convention.
        prompt = tables.assistant_prompt(target(text)["input_ids"])
        assert assistant.decode(prompt, skip_special_tokens=True) == text
        assert prompt[: len(tables.assistant_prefix)] == list(tables.assistant_prefix)
    # A drafted token expands to its own draft source: what the assistant read while drafting stays valid.
    shared = np.flatnonzero(tables.draft_source >= 0)
    assert len(shared) > 100 and all(tables.expansion(t) == [tables.draft_source[t]] for t in shared)
    assert all(tables.assistant.texts[tables.draft_source[t]] == tables.target.texts[t] for t in shared)


@pytest.mark.parametrize("direction", ["byte_level->sentencepiece", "sentencepiece->byte_level"])
def test_drafts_are_spelled_and_merged_as_the_target_writes_them(byte_level, sentencepiece, direction):
    """Every draftable assistant token is spelled by target tokens with its exact bytes (a shared one by its own
    target token, alone); the merge table holds exactly the pairs whose joined bytes are one target token, and the
    loop's probe of it (jax) reads what the host reads."""
    from jaxspec.strategies.universal import merge, merge_inputs

    tokenizers = {"byte_level": byte_level, "sentencepiece": sentencepiece}
    target, assistant = (tokenizers[k] for k in direction.split("->"))
    tables = vm.build(target, assistant, len(target), len(assistant))
    draftable = np.flatnonzero(tables.spelling[:, 0] >= 0)
    assert tables.draftable > tables.shared  # tokens the target spells in pieces can be drafted too
    for a in draftable:
        pieces = [t for t in tables.spelling[a].tolist() if t >= 0]
        text = tables.assistant.texts[a]
        if text is None:  # a special token: the target's special token with the same text
            assert len(pieces) == 1 and tables.expansion(pieces[0]) == [a]
            continue
        assert tables.target.text_of(pieces) == text, a
        assert tables.spelled_alone[a] == (len(pieces) == 1 and tables.expansion(pieces[0]) == [a])
    assert tables.spelled_alone[tables.draft_source[tables.draft_source >= 0]].all()
    # Merges: every pair of canonical target tokens whose joined bytes are a target token, and no other pair.
    ids = tables.target.canonical_ids()
    rng = np.random.default_rng(0)
    tokens = sorted(ids.values())
    pairs = [(ids[t[:c]], ids[t[c:]], i) for t, i in ids.items() for c in range(1, len(t))
             if t[:c] in ids and t[c:] in ids]
    assert len(pairs) > 20 and all(tables.merges.lookup(a, b) == m for a, b, m in pairs)
    others = [(int(a), int(b)) for a, b in rng.choice(tokens, (300, 2))]
    expected = [ids.get(tables.target.texts[a] + tables.target.texts[b], -1) for a, b in others]
    assert [tables.merges.lookup(a, b) for a, b in others] == expected
    probe = [*pairs[:200], *[(a, b, m) for (a, b), m in zip(others, expected)]]
    first, second, merged = (np.array(column, np.int32) for column in zip(*probe))
    loop_reading = merge(merge_inputs("t", tables.merges), "t", tables.merges.probes, first, second)
    assert (np.asarray(loop_reading) == merged).all()
    # The assistant's table is built the same way, over its own vocabulary.
    assistant_ids = tables.assistant.canonical_ids()
    assert all(tables.assistant_merges.lookup(assistant_ids[t[:c]], assistant_ids[t[c:]]) == i
               for t, i in assistant_ids.items() for c in range(1, len(t))
               if t[:c] in assistant_ids and t[c:] in assistant_ids)


def test_extensible_tokens_are_the_ones_the_assistant_continues_into_a_merge(byte_level):
    """`VocabMap.extensible` marks t1 exactly when some target token t12 = t1 t2 is written by the assistant as
    t1's assistant tokens and more: only then can a draft ending in t1 be cut inside a target token. A t1 whose
    longer tokens the assistant has whole is not marked, though the target's merge table pairs it."""
    assistant_tokenizer = byte_level_tokenizer(drop_merges=24, seed=5)
    tables = vm.build(byte_level, assistant_tokenizer, len(byte_level), len(assistant_tokenizer))
    ids = tables.target.canonical_ids()
    pairs = [(ids[t[:c]], i) for t, i in ids.items() for c in range(1, len(t)) if t[:c] in ids and t[c:] in ids]
    expected = np.zeros(len(byte_level), bool)
    for t1, t12 in pairs:
        head, whole = tables.expansion(t1), tables.expansion(t12)
        expected[t1] |= bool(head) and len(whole) > len(head) and whole[: len(head)] == head
    assert (tables.extensible == expected).all()
    paired = np.zeros(len(byte_level), bool)
    paired[[t1 for t1, _ in pairs]] = True
    assert 0 < tables.extensible.sum() < paired.sum()


def test_a_draft_at_its_limit_looks_one_step_ahead_where_it_could_merge(byte_level):
    """A row at its limit on a target token that merges with a next one runs one more assistant step: the draft
    then ends where the target would cut it (t1 + t2 -> t12, one draft), or, if the next token does not merge, that
    token is one more draft. A last draft that merges with nothing ends the row at once. The assistant here is a
    script, so the drafts are known; the target is the full byte-level vocabulary and the assistant lacks 24 of its
    merges, so it writes t12 as two tokens."""
    import types

    import jax
    import jax.numpy as jnp

    from jaxspec.schedule import Schedule
    from jaxspec.strategies.universal import UniversalDrafter

    assistant_tokenizer = byte_level_tokenizer(drop_merges=24, seed=5)
    tables = vm.build(byte_level, assistant_tokenizer, len(byte_level), len(assistant_tokenizer))
    alone = {int(tables.spelling[a, 0]): a for a in np.flatnonzero(tables.spelled_alone)}  # t -> its assistant twin
    # t12 is written as a1 a2 by the assistant, and a1, a2 spell t1, t2, which merge into t12.
    t12, (a1, a2) = next((t, tables.expansion(t)) for t in range(len(byte_level)) if len(tables.expansion(t)) == 2
                         and all(tables.spelled_alone[a] for a in tables.expansion(t)) and not tables.extensible[t])
    t1, t2 = (int(tables.spelling[a, 0]) for a in (a1, a2))
    assert tables.merges.lookup(t1, t2) == t12 and tables.extensible[t1]
    texts = [t for t in alone if tables.target.texts[t]]  # not special tokens
    final = next(t for t in texts if not tables.extensible[t] and tables.merges.lookup(t1, t) < 0)
    apart = next(t for t in texts if tables.merges.lookup(t1, t) < 0 and t != final)

    drafter = UniversalDrafter(max_draft=4, vocab_map=tables, max_expansion=tables.max_expansion,
                               merge_probes=tables.merges.probes,
                               assistant_merge_probes=tables.assistant_merges.probes, schedule=Schedule("constant"))
    inputs = {name: jnp.asarray(value) for name, value in drafter.runtime_inputs().items()}
    vocab = len(assistant_tokenizer)

    def run(script, limit):
        """The drafts of one row whose assistant writes `script` (assistant ids), with `limit` drafts asked for."""
        script = jnp.asarray(script + [alone[final]] * 8)

        def assistant(token, positions, cache):  # fed the draft at position p, it predicts script[p + 1]
            return jax.nn.one_hot(script[positions + 1], vocab) * 50.0, None, cache

        ctx = types.SimpleNamespace(draft_inputs=inputs, assistant=assistant,
                                    is_eos=lambda tokens: jnp.zeros(tokens.shape, bool))
        limit = jnp.array([limit])
        draft, _, _, feeds = drafter._draft_text(ctx, jnp.array([0]), limit, jnp.minimum(limit + 1, 4),
                                                 jax.nn.one_hot(script[:1], vocab) * 50.0, jnp.zeros(()),
                                                 jnp.array([-1]))
        return draft.tokens[0, : int(draft.count[0])].tolist(), int(feeds)

    assert run([a1, a2], limit=1) == ([t12], 1)  # merged: the target's own cut
    assert run([a1, alone[apart]], limit=1) == ([t1, apart], 1)  # no merge: the look-ahead token is one more draft
    assert run([alone[final]], limit=1) == ([final], 0)  # nothing could merge: no step further
    assert run([alone[final], a1, a2], limit=2) == ([final, t12], 2)


def merged_sequence(pieces_per_token, table: vm.MergeTable, start=()) -> tuple[list[int], int, int]:
    """The oracle's merging: each token's first piece merges into the token before it (at most twice) while their
    joined bytes are one token. -> (tokens, merges, the lowest position a merge rewrote)."""
    out, merges, lowest = list(start), 0, len(start)
    for pieces in pieces_per_token:
        pieces = list(pieces)
        for _ in range(2):
            merged = table.lookup(out[-1], pieces[0]) if out and pieces else -1
            if merged < 0:
                break
            pieces[0] = merged
            out.pop()
            merges, lowest = merges + 1, min(lowest, len(out))
        out += pieces
    return out, merges, lowest


@pytest.mark.parametrize("direction", ["byte_level->sentencepiece", "sentencepiece->byte_level"])
def test_the_loop_merges_context_and_drafts_as_the_oracle(byte_level, sentencepiece, direction):
    """The loop's two merge steps against the oracle on real text: committed target tokens expanded into the
    assistant's buffer (`_expand`, which also lowers `synced` below a rewritten position), and the assistant's
    tokens of a text spelled and pushed as target drafts (`push_draft`)."""
    import types

    import jax.numpy as jnp

    from jaxspec.strategies.universal import UniversalDrafter, UniversalState, push_draft

    tokenizers = {"byte_level": byte_level, "sentencepiece": sentencepiece}
    target, assistant = (tokenizers[k] for k in direction.split("->"))
    tables = vm.build(target, assistant, len(target), len(assistant))
    # The loop's own run-time tables, as it holds them.
    inputs = {name: jnp.asarray(table) for name, table in UniversalDrafter(vocab_map=tables).runtime_inputs().items()}
    context_merges = draft_merges = 0
    for text in TEXTS[:3]:
        prefix = assistant("x", add_special_tokens=False)["input_ids"]
        committed = target(text, add_special_tokens=False)["input_ids"][:12]
        expected, merges, lowest = merged_sequence([tables.expansion(t) for t in committed], tables.assistant_merges,
                                                   prefix)
        context_merges += merges
        k = len(committed) - 1  # one _expand appends K+1 committed tokens
        drafter = UniversalDrafter(max_draft=k, max_expansion=tables.max_expansion,
                                   assistant_merge_probes=tables.assistant_merges.probes)
        buffer = np.zeros((1, 64), np.int32)
        buffer[0, : len(prefix)] = prefix
        state = UniversalState(cache=None, tokens=jnp.asarray(buffer), length=jnp.array([len(prefix)]),
                               expanded=jnp.array([0]), synced=jnp.array([len(prefix)]), schedule=None)
        loop = types.SimpleNamespace(tokens=jnp.asarray([committed]), lengths=jnp.array([len(committed)]))
        state = drafter._expand(types.SimpleNamespace(draft_inputs=inputs), loop, state)
        assert int(state.length[0]) == len(expected) and np.asarray(state.tokens)[0, : len(expected)].tolist() == \
            expected, text
        assert int(state.synced[0]) == lowest  # a merge into the prefix rewrote a position the cache held

        own = assistant(text, add_special_tokens=False)["input_ids"]
        spelled = [[int(t) for t in tables.spelling[a] if t >= 0] for a in own]
        if [] in spelled:  # a token the target spells in more than MAX_SPELLING pieces: drafting stops before it
            own, spelled = own[: spelled.index([])], spelled[: spelled.index([])]
        expected_drafts, merges, _ = merged_sequence([[t] for pieces in spelled for t in pieces], tables.merges)
        draft_merges += merges
        width = len(expected_drafts) + 1
        drafts, alone, count = jnp.zeros((1, width), jnp.int32), jnp.zeros((1, width), bool), jnp.zeros(1, jnp.int32)
        for a, pieces in zip(own, spelled):
            for t in pieces:
                drafts, alone, count = push_draft(inputs, tables.merges.probes, drafts, alone, count, jnp.array([t]),
                                                  jnp.array([True]), jnp.array([bool(tables.spelled_alone[a])]))
        assert np.asarray(drafts)[0, : int(count[0])].tolist() == expected_drafts, text
        assert tables.target.text_of(expected_drafts) == tables.assistant.text_of(own)
    assert context_merges > 0 and draft_merges > 0


def test_special_tokens_are_never_drafted_and_map_by_text(byte_level, sentencepiece):
    tables = vm.build(byte_level, sentencepiece, len(byte_level), len(sentencepiece))
    target_specials = [byte_level.convert_tokens_to_ids(t) for t in CHATML]
    assert (tables.draft_source[target_specials] == -1).all()
    assistant_specials = set(sentencepiece.all_special_ids) | {sentencepiece.convert_tokens_to_ids("<|im_start|>")}
    assert not assistant_specials & set(tables.draft_source.tolist())
    # ChatML markers exist in both vocabularies: the context keeps them; <|endoftext|> has no counterpart.
    im_start = byte_level.convert_tokens_to_ids("<|im_start|>")
    assert tables.expansion(im_start) == [sentencepiece.convert_tokens_to_ids("<|im_start|>")]
    assert tables.expansion(byte_level.convert_tokens_to_ids("<|endoftext|>")) == []
    # A prompt: the assistant's BOS, the markers, the first text as the assistant encodes a text start, later text
    # in continuation form (no sentencepiece space in front of the "\n").
    chat = byte_level("<|im_start|>user\nHello world<|im_end|>\n")["input_ids"]
    marker = sentencepiece.convert_tokens_to_ids
    assert tables.assistant_prompt(chat) == [
        marker("<s>"), marker("<|im_start|>"), *sentencepiece("user\nHello world", add_special_tokens=False)["input_ids"],
        marker("<|im_end|>"), marker("<0x0A>")]


def test_byte_pieces_and_leading_spaces(byte_level, sentencepiece):
    """A byte-level token holding part of a UTF-8 character pairs with the sentencepiece byte piece; `▁the` and
    `Ġthe` are the same token; a sentencepiece word at the start of a text has no space, in the middle it has one."""
    forward = vm.build(byte_level, sentencepiece, len(byte_level), len(sentencepiece))
    lead_byte = byte_level.convert_tokens_to_ids(vm.BYTE_TO_CHAR[0xF0])  # 🙂 starts with byte 0xF0
    assert forward.draft_source[lead_byte] == sentencepiece.convert_tokens_to_ids("<0xF0>")
    assert forward.draft_source[byte_level.convert_tokens_to_ids("Ġthe")] == \
        sentencepiece.convert_tokens_to_ids(vm.SPACE + "the")

    backward = vm.build(sentencepiece, byte_level, len(sentencepiece), len(byte_level))
    ids = sentencepiece("Hello world")["input_ids"]  # <s> ▁Hello ▁world
    hello = sentencepiece.convert_tokens_to_ids(vm.SPACE + "Hello")
    assert ids[1] == hello
    assert byte_level.decode(backward.expansion(hello)) == " Hello"  # mid-text form
    assert byte_level.decode(backward.assistant_prompt(ids)) == "Hello world"  # the text start drops the space
    # Byte pieces map to byte-level bytes; a sentencepiece piece that duplicates a byte ("a" and <0x61>) is not
    # drafted, so each target token has one draft source and each draft one target token.
    assert backward.draft_source[sentencepiece.convert_tokens_to_ids("<0xF0>")] == lead_byte
    assert backward.draft_source[sentencepiece.convert_tokens_to_ids("<0x61>")] == -1
    sources = backward.draft_source[backward.draft_source >= 0]
    assert len(sources) == len(set(sources.tolist()))


def test_which_pairs_are_universal(byte_level, sentencepiece, loaded):
    target, assistant = loaded["byte_level"], loaded["sentencepiece"]
    assert tokenizer_pair(target, assistant) == (target.tokenizer, assistant.tokenizer)  # sizes differ
    assert tokenizer_pair(target, target) is None
    # Equal sizes, other ids: the same tokens in another order still need the tables.
    shuffled = byte_level_tokenizer(seed=3)
    assert len(shuffled) == len(byte_level) and shuffled.get_vocab() != byte_level.get_vocab()
    assert tokenizer_pair(target, target, assistant_tokenizer=shuffled) == (target.tokenizer, shuffled)
    assert tokenizer_pair(target, target, assistant_tokenizer=byte_level_tokenizer()) is None


# -- errors -------------------------------------------------------------------------------------------------------


def sentencepiece_over(letters: str):
    sp = Tokenizer(models.BPE(vocab={"<unk>": 0, **{c: i + 1 for i, c in enumerate(letters)}}, merges=[],
                              unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace(vm.SPACE, " ")])
    sp.add_special_tokens(["<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")


def test_vocabularies_without_overlap_name_the_fix(loaded):
    before = loop.trace_count()
    with pytest.raises(ValueError, match="share no token.*choose an assistant"):
        jaxspec.generate(loaded["byte_level"], [[5, 6]], max_new_tokens=4, assistant_model=loaded["sentencepiece"],
                         tokenizer=sentencepiece_over("abc"), assistant_tokenizer=sentencepiece_over("xyz"))
    assert loop.trace_count() == before


def test_the_ensemble_with_another_tokenizer_is_not_supported(loaded):
    """Text drafts have no distribution over the target's vocabulary to mix with p: an error, before any compile."""
    before = loop.trace_count()
    with pytest.raises(NotImplementedError, match="assistant_ensemble_weight with an assistant of another tokenizer"):
        jaxspec.generate(loaded["byte_level"], [[5, 6]], max_new_tokens=4, assistant_model=loaded["sentencepiece"],
                         assistant_ensemble_weight=0.5)
    assert loop.trace_count() == before


def test_a_missing_tokenizer_names_the_argument(tiny_llama_dir, tmp_path, loaded):
    bare_target = jaxspec.load(tiny_llama_dir)  # no tokenizer saved with it
    bare_assistant = jaxspec.load(hf_models.save_tiny("llama", tmp_path, seed=2, vocab_size=100))
    before = loop.trace_count()
    with pytest.raises(ValueError, match=r"the target's tokenizer \(tokenizer=\) and the assistant's tokenizer "
                                         r"\(assistant_tokenizer=\) is missing"):
        jaxspec.generate(bare_target, [[5, 6]], max_new_tokens=4, assistant_model=bare_assistant)
    with pytest.raises(ValueError, match=r"universal assisted decoding .* the target's tokenizer \(tokenizer=\)"):
        jaxspec.generate(bare_target, [[5, 6]], max_new_tokens=4, assistant_model=loaded["sentencepiece"])
    with pytest.raises(ValueError, match="assistant_tokenizer is not used by plain decoding"):
        jaxspec.generate(loaded["byte_level"], [[5, 6]], max_new_tokens=4,
                         assistant_tokenizer=loaded["sentencepiece"].tokenizer)
    assert loop.trace_count() == before


# -- the loop -----------------------------------------------------------------------------------------------------


@torch.no_grad()
def hf_greedy(hf_model, prompt, **kwargs):
    ids = torch.tensor([prompt])
    return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                             **kwargs)[0].tolist()


@pytest.mark.parametrize("direction, k, schedule, threshold", [
    ("byte_level->sentencepiece", 4, "constant", 0.0),
    ("sentencepiece->byte_level", 3, "heuristic", 0.4),
])
def test_greedy_equals_plain_greedy_and_transformers_universal_run(folders, loaded, direction, k, schedule,
                                                                   threshold):
    """A batch of ragged prompts: every row equals transformers' plain greedy and transformers' universal assisted
    run of that prompt (batch 1, tokenizer= and assistant_tokenizer=)."""
    target_kind, assistant_kind = direction.split("->")
    target, assistant = loaded[target_kind], loaded[assistant_kind]
    hf_target, hf_assistant = (hf_models.load_hf(folders[kind]) for kind in (target_kind, assistant_kind))
    hf_assistant.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule=schedule,
                                          assistant_confidence_threshold=threshold)
    prompts = encode(target.tokenizer, PROMPTS)
    assistant.generation_config["num_assistant_tokens"] = k
    out = jaxspec.generate(target, prompts, max_new_tokens=N, assistant_model=assistant,
                           num_assistant_tokens_schedule=schedule, assistant_confidence_threshold=threshold,
                           max_assistant_tokens=4 if schedule != "constant" else None)
    assert out.strategy == "universal" and out.drafted.sum() > 0
    width = out.sequences.shape[1] - N
    for row, prompt in enumerate(prompts):
        plain = hf_greedy(hf_target, prompt)
        universal = hf_greedy(hf_target, prompt, assistant_model=hf_assistant, tokenizer=target.tokenizer,
                              assistant_tokenizer=assistant.tokenizer)
        assert universal == plain
        mine = out.sequences[row, width - len(prompt):].tolist()
        assert mine[: len(plain)] == plain, row
    if schedule == "heuristic":  # the adapted length carries over to the assistant, as for one tokenizer
        assert assistant.generation_config["num_assistant_tokens"] == int(round(out.drafter_summary[
            "num_assistant_tokens"].mean()))


@pytest.fixture(scope="module")
def near_twin(tmp_path_factory, folders, byte_level):
    """A model that is the byte-level model with a smaller vocabulary: its last 4 merges are gone (those tokens are
    spelled in pieces), the ids are shuffled, and its LM head is perturbed, so it agrees with the byte-level model
    often but not always. Its embedding and head rows are the byte-level model's rows for the same token text."""
    return twin_of(tmp_path_factory, folders, byte_level, drop_merges=4)


@pytest.fixture(scope="module")
def far_twin(tmp_path_factory, folders, byte_level):
    """The same with 24 merges gone: common words are spelled in pieces."""
    return twin_of(tmp_path_factory, folders, byte_level, drop_merges=24)


def twin_of(tmp_path_factory, folders, byte_level, drop_merges: int) -> str:
    tokenizer = byte_level_tokenizer(drop_merges=drop_merges, seed=5)
    hf_target = hf_models.load_hf(folders["byte_level"])
    target_ids = byte_level.get_vocab()
    rows = torch.tensor([target_ids[t] for t in sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)])
    twin = hf_models.build_tiny("llama", seed=0, vocab_size=len(tokenizer), num_hidden_layers=2)
    state = {k: v.clone() for k, v in hf_target.state_dict().items()}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][rows]
    head = state["lm_head.weight"][rows]
    state["lm_head.weight"] = head + 0.2 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
    twin.load_state_dict(state)
    folder = tmp_path_factory.mktemp("twin")
    twin.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@torch.no_grad()
def universal_drafts(hf_assistant, tables: vm.VocabMap, prompt: list[int], k: int, seen: Counter, cap: int):
    """The oracle's drafts: the assistant reads the re-encoded prompt and the expansions of the committed tokens
    (each merged into the token before it where their joined bytes are one assistant token), drafts its own argmax
    (first redrafting a trailing whitespace token among the tokens that extend it), and each drafted token is
    spelled in target tokens and merged into the drafts before it, until K target tokens, and one assistant step
    further while the last one could merge with the next; past K, one more draft (the look-ahead's) is kept, up to
    the buffer's `cap` (at most 2 cap assistant steps; constant schedule, no confidence stop). `seen` counts the
    drafts spelled in several target tokens, the merges and the healed rounds."""

    def push(drafts, token):
        for _ in range(2):
            merged = tables.merges.lookup(drafts[-1], token) if drafts else -1
            if merged < 0:
                break
            token = merged
            drafts.pop()
            seen["draft merges"] += 1
        drafts.append(token)

    def draft(sequence, room):
        context = tables.assistant_prompt(prompt)
        for t in sequence[len(prompt):]:  # each expansion's first token merges into the token before it
            pieces = tables.expansion(t)
            for _ in range(2):
                merged = tables.assistant_merges.lookup(context[-1], pieces[0]) if pieces else -1
                if merged < 0:
                    break
                pieces = [merged, *pieces[1:]]
                context.pop()
                seen["context merges"] += 1
            context += pieces
        drafts, limit = [], min(k, room)
        heal = int(tables.healing.index[context[-1]]) if len(context) > 1 else -1
        for step in range(2 * cap):
            # At the limit, a last draft that could merge with the next token looks one assistant step further.
            if len(drafts) > limit or (len(drafts) == limit and not (drafts and tables.extensible[drafts[-1]])):
                break
            if step == 0 and heal >= 0:  # redraft the trailing whitespace token among its extensions
                logits = hf_assistant(torch.tensor([context[:-1]])).logits[0, -1]
                extensions = [int(e) for e in tables.healing.extensions[heal] if e >= 0]
                best = int(logits[extensions].argmax())
                choice, spellable = extensions[best], bool(tables.healing.spellable[heal, best])
                pieces = [int(t) for t in tables.healing.suffix_spelling[heal, best] if t >= 0]
                context[-1] = choice
                seen["healed"] += 1
            else:
                choice = int(hf_assistant(torch.tensor([context])).logits[0, -1].argmax())
                pieces = [int(t) for t in tables.spelling[choice] if t >= 0]
                spellable = bool(pieces)
                context.append(choice)
            if not spellable:
                break
            seen["spelled"] += len(pieces) > 1
            for token in pieces:
                push(drafts, token)
        return drafts[:min(limit + 1, room, cap)]

    return draft


@pytest.mark.parametrize("twin_is", ["assistant", "target"])
def test_rounds_equal_a_replay_with_transformers_models(folders, loaded, near_twin, far_twin, twin_is):
    """Each row's accepted count per round equals a replay in which transformers' assistant reads the prompt
    re-encoded and the committed tokens expanded, and transformers' target verifies: the assistant's context, its
    rollback after each rejection, and the spelling and merging of its drafts are what they should be. With the
    twin as the assistant, target tokens it lacks are expanded into pieces; with the far twin as the target, the
    assistant drafts tokens the target spells in pieces."""
    k, cap = 3, 4  # a draft buffer of 4 holds the look-ahead draft of a 3-token round
    twin_folder = near_twin if twin_is == "assistant" else far_twin
    full, twin = loaded["byte_level"], jaxspec.load(twin_folder)
    hf_full, hf_twin = hf_models.load_hf(folders["byte_level"]), hf_models.load_hf(twin_folder)
    target, hf_target, assistant, hf_assistant = (twin, hf_twin, full, hf_full) if twin_is == "target" else \
        (full, hf_full, twin, hf_twin)
    tables = vm.build(target.tokenizer, assistant.tokenizer, target.config.vocab_size, assistant.config.vocab_size)
    prompts = encode(target.tokenizer, PROMPTS)
    out = jaxspec.generate(target, prompts, max_new_tokens=N, eos_token_id=[], assistant_model=assistant,
                           num_assistant_tokens=k, max_assistant_tokens=cap, num_assistant_tokens_schedule="constant",
                           assistant_confidence_threshold=0.0)
    # A random model is thrown by a word spelled in pieces, so the twin misses often there, and agrees elsewhere.
    assert 0.05 < out.acceptance_rate < 0.9
    if twin_is == "assistant":
        spelled = np.diff(tables.expansion_offsets) > 1
        assert spelled[out.sequences[:, -N:]].any()  # the loop expanded a target token into several assistant tokens
    seen = Counter()
    for row, prompt in enumerate(prompts):
        drafts = universal_drafts(hf_assistant, tables, prompt, k, seen, cap)
        accepted = oracles.replay_rounds(hf_target, drafts, prompt, N)
        assert out.accepted_hist[row].tolist() == oracles.histogram(accepted, cap), row
    if twin_is == "target":  # drafts of tokens the target writes in pieces, and trailing whitespace redrafted
        assert seen["spelled"] > 0 and seen["healed"] > 0


def test_sampling_is_exact(folders, loaded, near_twin):
    """6000 rows, budget K+2: the first three sampled tokens (the prefill's, then a round with up to K drafts) follow
    the target's exact law over its whole vocabulary, while the assistant's text drafts are judged one-hot. The
    near twin at temperature 0.3 agrees with the target often enough that multi-draft rounds, spelled drafts
    and merged drafts all happen (a random assistant's one-hot drafts would almost never be accepted)."""
    prompt, k, rows, temperature = [40, 41, 42, 43], 3, 6000, 0.3
    hf_target = hf_models.load_hf(folders["byte_level"])
    twin = jaxspec.load(near_twin)

    exact = oracles.exact_marginals(hf_target, prompt, positions=3, temperature=temperature)
    settings = dict(max_new_tokens=k + 2, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                    eos_token_id=[], assistant_model=twin, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
    out = oracles.sample_rows(lambda ids, seed: jaxspec.generate(loaded["byte_level"], ids, seed=seed, **settings),
                              prompt, rows, 3)
    assert out.accepted_hist[:, 2:].sum() > 100 and out.drafted.sum() >= rows  # multi-draft rounds happen
    new = out.sequences[:, len(prompt):]
    tables = vm.build(loaded["byte_level"].tokenizer, twin.tokenizer, loaded["byte_level"].config.vocab_size,
                      twin.config.vocab_size)
    # Drafted positions often hold tokens the twin writes only in pieces: a draft of one there is a merged draft.
    assert (np.diff(tables.expansion_offsets) > 1)[new[:, 1:3]].sum() > 100
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


def test_transformers_cannot_sample_with_this_assistant(folders, loaded, near_twin):
    """transformers 5.23's sampling path of universal decoding fails for the assistant of `test_sampling_is_exact`,
    whose vocabulary is a subset of the target's: it always asks its translator to prune the assistant's LM head,
    the translator builds the pruned id map only where some assistant token is missing from the target's vocabulary,
    and it then reads that map anyway. Should a later transformers fix it, this fails, and docs/design.md ('Universal
    assisted decoding') needs the new behaviour."""
    prompt = torch.tensor([[40, 41, 42, 43]])
    hf_target, hf_twin = hf_models.load_hf(folders["byte_level"]), hf_models.load_hf(near_twin)
    with torch.no_grad(), pytest.raises(AttributeError, match="assistant_overlap_token_ids"):
        hf_target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=True,
                           temperature=0.3, assistant_model=hf_twin, tokenizer=loaded["byte_level"].tokenizer,
                           assistant_tokenizer=jaxspec.load(near_twin).tokenizer)


@pytest.mark.slow  # ~60 s: 4000 batch-1 calls of transformers' generate
def test_transformers_own_sampling_is_lossy(folders, loaded, near_twin):
    """transformers 5.23 samples universal decoding through its translator (`UniversalSpeculativeDecodingGenerator`).
    With the near twin as the target and the byte-level model as its assistant (the other way round transformers
    fails: `test_transformers_cannot_sample_with_this_assistant`), 2000 rows of its sampled tokens fail the chi-square
    against the target's exact law, where transformers' plain sampling of the same target and jaxspec's universal
    decoding of the same pair pass it."""
    k, rows, temperature = 3, 2000, 0.3
    twin = jaxspec.load(near_twin)
    hf_twin, hf_full = hf_models.load_hf(near_twin), hf_models.load_hf(folders["byte_level"])
    hf_full.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                     assistant_confidence_threshold=0.0)
    hf_twin.generation_config.eos_token_id = None  # the full budget, as exact_marginals counts
    prompt = encode(twin.tokenizer, PROMPTS[2:])[0]  # the full model's drafts are often the twin's choice here
    exact = oracles.exact_marginals(hf_twin, prompt, positions=3, temperature=temperature)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    ids = torch.tensor([prompt])
    torch.manual_seed(0)
    with torch.no_grad():
        assisted = np.stack([hf_twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k + 2,
                                              assistant_model=hf_full, tokenizer=twin.tokenizer,
                                              assistant_tokenizer=loaded["byte_level"].tokenizer,
                                              **sampling)[0, len(prompt):][:3].numpy() for _ in range(rows)])
        plain = np.stack([hf_twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                           **sampling)[0, len(prompt):].numpy() for _ in range(rows)])
    mine = jaxspec.generate(twin, [prompt] * rows, max_new_tokens=k + 2, eos_token_id=[], seed=3,
                            assistant_model=loaded["byte_level"], num_assistant_tokens=k,
                            num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0, **sampling)
    assert mine.strategy == "universal" and mine.accepted_hist[:, 2:].sum() > 100  # multi-draft rounds accept

    def worst(samples):  # the smallest p-value over the first three new tokens
        return min(oracles.goodness_of_fit(samples[:, i], exact[i]) for i in range(3))

    assert worst(plain) > 1e-3 and worst(mine.sequences[:, len(prompt):]) > 1e-3
    assert worst(assisted) < 1e-6


@pytest.mark.slow  # ~12 s
def test_a_quantized_assistant_with_another_tokenizer(loaded, near_twin):
    """An int8 assistant (jaxspec.quantize) drafts in its own vocabulary as its float32 self does: a batch of ragged
    prompts still decodes to plain greedy, with drafts accepted."""
    target, assistant = loaded["byte_level"], jaxspec.quantize(jaxspec.load(near_twin))
    prompts = encode(target.tokenizer, PROMPTS)
    plain = jaxspec.generate(target, prompts, max_new_tokens=N)
    out = jaxspec.generate(target, prompts, max_new_tokens=N, assistant_model=assistant, num_assistant_tokens=4,
                           num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    assert out.strategy == "universal" and out.accepted.sum() > 0
    np.testing.assert_array_equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("quantization", [pytest.param([], marks=pytest.mark.slow), ["--assistant-quantization", "int8"]])
def test_cli_assistant_with_another_tokenizer(folders, capsys, monkeypatch, quantization):
    """`--strategy universal --assistant` with another tokenizer runs universal decoding, greedy-identical, with
    the assistant in float32 or int8; `--strategy speculative` with that assistant is refused, naming universal."""
    from jaxspec.cli import generate as cli

    monkeypatch.setenv("JAXSPEC_COMPILATION_CACHE", "off")
    assert cli.main(["--model", folders["byte_level"], "--assistant", folders["sentencepiece"], "--strategy",
                     "universal", "--prompt", PROMPTS[0], "--max-new-tokens", "12", "--json",
                     "--compare-plain", *quantization]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == "universal" and report["same_tokens_as_plain"] is True
    assert cli.main(["--model", folders["byte_level"], "--assistant", folders["sentencepiece"], "--strategy",
                     "speculative", "--max-new-tokens", "4", *quantization]) == 2
    assert "the arguments select 'universal'" in capsys.readouterr().err

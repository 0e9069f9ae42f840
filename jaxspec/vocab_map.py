"""Two tokenizers' vocabularies mapped onto each other, once, on the host: the tables of universal assisted decoding.

Every token is read as the bytes it stands for in the middle of a text (its continuation form): a byte-level BPE
token through GPT-2's byte-to-character table (`Ġthe` is b" the", `Ċ` is b"\\n"), a sentencepiece piece with `▁` as a
space (`▁the` is b" the") and a byte-fallback piece `<0xNN>` as that one byte. Comparing bytes, not strings, is what
lets a sentencepiece vocabulary meet a byte-level one, and it covers tokens that hold part of a UTF-8 character.
Special tokens stand for no text.

The tables (jaxspec/strategies/universal.py runs them inside the compiled loop):

- Shared tokens, `draft_source[t]`: the assistant token with exactly target token t's bytes, or -1 (the
  intersection of the two vocabularies); where several ids of one vocabulary share their bytes, only one pairs up:
  a normal piece before a byte-fallback piece, then the lowest id. Special tokens pair up with nothing.
- Drafts, in text. The assistant drafts in its own vocabulary; each drafted token is written in target tokens by
  `spelling[a]` (the target tokenizer's encoding of its bytes, at most MAX_SPELLING tokens; a shared token spells as
  its one target token), and adjacent target tokens are merged while their joined bytes are one target token
  (`merges`, a hash table of (t1, t2) -> t12). That re-tokenizes the drafted text the way the target's BPE mostly
  would: SmolLM2 writes `):` + `\n   ` where Qwen writes `):\n` + `   `, and drafting only shared tokens could
  never propose the latter. An assistant token without a spelling (a special token the target lacks, bytes the
  target cannot write, or too many pieces) is never drafted.
- Token healing, `healing`: for each whitespace token of the assistant that longer tokens extend (`\n`, `\n   `),
  those tokens and the target tokens of the bytes they add. A context ending in one is redrafted from its position
  (see `Healing`).
- Context, `expansion(t)`: the assistant tokens that stand for target token t once the target commits it, in CSR
  form (`expansion_offsets`, `expansion_ids`). A drafted token expands to its draft source, so what the assistant
  read while drafting is what it reads when the token is committed. Any other token expands to the assistant's
  tokenization of its bytes in continuation form: the assistant tokenizer's own encoding when that gives back the
  same bytes, else the assistant model's pieces without the tokenizer's normalizer (which may add a leading space),
  with byte tokens for bytes that are not a whole character. A special token expands to the assistant's special
  token with the same text (both ChatML vocabularies have `<|im_start|>`), else to nothing, as transformers drops
  special tokens when it decodes. The bytes of the expansion always equal the bytes of the token when the
  assistant can write them (`inexpressible` counts those it cannot, e.g. a vocabulary without byte fallback).
  In the loop, each expansion's first token is merged into the token before it while their joined bytes are one
  assistant token (`assistant_merges`): Qwen's `):\n` + `   ` expands to `):` + `\n` + `   `, which SmolLM2 reads
  as `):` + `\n   `, as its own tokenizer writes it.
- The prompt, `assistant_prompt(ids)`: decoded from the target's ids and encoded by the assistant's tokenizer,
  once per call, with the assistant's own BOS. The text before the first special token is decoded as the target's
  tokenizer decodes a text start (a sentencepiece tokenizer drops the space it added in front), and encoded as the
  assistant's tokenizer encodes a text start; later runs of text are encoded in continuation form.

How this departs from transformers (whose greedy path decodes and re-encodes a window of text every round): the
context is the concatenation of per-token expansions merged at their boundaries, not a fresh encoding of the text,
so where greedy merging and the assistant's BPE disagree, the assistant reads a tokenization it would not have
produced itself. The text is the same; only the assistant's predictions can be a little worse there, which
lowers acceptance a little and never changes the output. Drafts are re-tokenized by greedy merging, not by the
target's BPE itself, so on rare words the drafted target tokens can differ from what the target writes (a miss,
never a change of output); transformers re-encodes exactly but on the host, once per round.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import weakref
from typing import Any, Sequence

import numpy as np

SPACE = "\u2581"  # sentencepiece's visible space
MAX_SPELLING = 4  # target tokens one drafted assistant token may spell into (longer ones are not drafted)
MAX_HEAL_EXTENSIONS = 128  # a whitespace token with more tokens that extend it (" ") is not healed
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from bytes to the printable characters byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {char: byte for byte, char in BYTE_TO_CHAR.items()}


@dataclasses.dataclass
class Vocabulary:
    """One tokenizer's view of its ids: the bytes each stands for in the middle of a text."""

    tokenizer: Any
    kind: str  # "byte_level" or "sentencepiece"
    texts: list[bytes | None]  # [V] continuation bytes per id; None for special tokens and ids past the tokenizer
    byte_piece: np.ndarray  # [V] bool: a byte-fallback piece <0xNN>
    specials: dict[str, int]  # special token text -> id
    space: str = SPACE  # sentencepiece's space character

    @classmethod
    def read(cls, tokenizer, vocab_size: int) -> "Vocabulary":
        backend = _backend(tokenizer)
        kind, space = _kind(backend)
        added = backend.get_added_tokens_decoder()
        special_ids = {i for i, token in added.items() if token.special}
        special_ids |= set(getattr(tokenizer, "all_special_ids", []) or [])
        byte_fallback = kind == "sentencepiece" and bool(getattr(backend.model, "byte_fallback", False))
        texts: list[bytes | None] = [None] * vocab_size
        byte_piece = np.zeros(vocab_size, bool)
        specials = {}
        for i in range(min(vocab_size, backend.get_vocab_size(with_added_tokens=True))):
            token = backend.id_to_token(i)
            if token is None:
                continue
            if i in special_ids:
                specials[token] = i
            elif i in added:
                texts[i] = added[i].content.encode()  # an added piece of text stands for itself
            elif kind == "byte_level":
                texts[i] = _byte_level_bytes(token)
            elif byte_fallback and BYTE_PIECE.fullmatch(token):
                texts[i] = bytes([int(token[3:5], 16)])
                byte_piece[i] = True
            else:
                texts[i] = token.replace(space, " ").encode()
        return cls(tokenizer, kind, texts, byte_piece, specials, space)

    @property
    def size(self) -> int:
        return len(self.texts)

    def canonical_ids(self) -> dict[bytes, int]:
        """bytes -> the one id that pairs up for them: a normal piece before a byte piece, then the lowest id."""
        best: dict[bytes, int] = {}
        for i, text in enumerate(self.texts):
            if not text:
                continue
            held = best.get(text)
            if held is None or (self.byte_piece[held] and not self.byte_piece[i]):
                best[text] = i
        return best

    def text_of(self, ids: Sequence[int]) -> bytes:
        """The continuation bytes of ids (special tokens stand for none)."""
        return b"".join(self.texts[i] or b"" for i in ids)


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"Universal assisted decoding reads a fast (tokenizers-backed) tokenizer; got "
                        f"{type(tokenizer).__name__}. Load it with transformers' AutoTokenizer or jaxspec.load.")
    return backend


def _kind(backend) -> tuple[str, str]:
    """('byte_level' | 'sentencepiece', space character) from the tokenizer's decoder."""
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    parts = decoder.get("decoders", [decoder])
    for part in parts:
        if part.get("type") == "ByteLevel":
            return "byte_level", SPACE
        if part.get("type") == "Metaspace":
            return "sentencepiece", part.get("replacement", SPACE)
        if part.get("type") == "Replace" and part.get("content") == " ":
            return "sentencepiece", part["pattern"]["String"]
    raise NotImplementedError(
        f"Universal assisted decoding maps byte-level BPE and sentencepiece vocabularies; this tokenizer's decoder "
        f"({decoder.get('type', 'none')}) is neither, so its tokens' bytes are unknown.")


def _byte_level_bytes(token: str) -> bytes:
    if all(char in CHAR_TO_BYTE for char in token):
        return bytes(CHAR_TO_BYTE[char] for char in token)
    return token.encode()  # as the ByteLevel decoder does with a piece outside its alphabet


class Encoder:
    """The assistant's tokenization of bytes in continuation form (see the module docstring)."""

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        self.backend = _backend(vocabulary.tokenizer)
        self.ids = self.backend.get_vocab(with_added_tokens=True)
        self.byte_ids = {}  # byte -> the assistant's id for that single byte, if it has one
        for i, text in enumerate(vocabulary.texts):
            if text is not None and len(text) == 1 and (vocabulary.kind == "byte_level" or vocabulary.byte_piece[i]):
                self.byte_ids.setdefault(text[0], i)

    def encode_many(self, texts: list[bytes]) -> list[list[int]]:
        """Each text's assistant ids; the tokenizer's own encoding where it gives back the same bytes."""
        out: list[list[int] | None] = [None] * len(texts)
        whole = [(i, t.decode()) for i, t in enumerate(texts) if _is_utf8(t)]
        encoded = self.backend.encode_batch([s for _, s in whole], add_special_tokens=False) if whole else []
        for (i, _), encoding in zip(whole, encoded):
            if self.vocabulary.text_of(encoding.ids) == texts[i]:
                out[i] = list(encoding.ids)
        return [ids if ids is not None else self.pieces(text) for ids, text in zip(out, texts)]

    def pieces(self, text: bytes) -> list[int]:
        """The assistant model's pieces for `text` without the tokenizer's normalizer: runs of whole characters go
        through the model (its pre-tokenizer first, for byte-level vocabularies), stray bytes become byte tokens."""
        ids: list[int] = []
        for run, is_text in _runs(text):
            if not is_text:
                ids += [self.byte_ids.get(b, -1) for b in run]
                continue
            if self.vocabulary.kind == "byte_level":
                words = [w for w, _ in self.backend.pre_tokenizer.pre_tokenize_str(run.decode())] \
                    if self.backend.pre_tokenizer is not None else ["".join(BYTE_TO_CHAR[b] for b in run)]
            else:
                words = [run.decode().replace(" ", self.vocabulary.space)]
            for word in words:
                ids += [token.id for token in self.backend.model.tokenize(word)]
        return [i for i in ids if i >= 0]


def _is_utf8(text: bytes) -> bool:
    try:
        text.decode()
    except UnicodeDecodeError:
        return False
    return True


def _runs(text: bytes) -> list[tuple[bytes, bool]]:
    """Split bytes into runs of whole UTF-8 characters (True) and stray bytes (False)."""
    runs: list[tuple[bytes, bool]] = []
    for char in text.decode(errors="surrogateescape"):
        is_text = not "\udc80" <= char <= "\udcff"
        piece = char.encode(errors="surrogateescape")
        if runs and runs[-1][1] == is_text:
            runs[-1] = (runs[-1][0] + piece, is_text)
        else:
            runs.append((piece, is_text))
    return runs


@dataclasses.dataclass(frozen=True)
class VocabMap:
    """The tables of one (target tokenizer, assistant tokenizer) pair. V: the target model's vocabulary size."""

    target: Vocabulary
    assistant: Vocabulary
    encoder: Encoder
    draft_source: np.ndarray  # [V] int32: the assistant token that drafts target token t, or -1
    expansion_offsets: np.ndarray  # [V + 1] int32: target token t expands to expansion_ids[offsets[t]:offsets[t+1]]
    expansion_ids: np.ndarray  # [N] int32 assistant ids
    assistant_prefix: tuple[int, ...]  # what the assistant's tokenizer puts in front of a text (its BOS)
    inexpressible: int  # target tokens whose bytes the assistant cannot write
    spelling: np.ndarray  # [V_a, MAX_SPELLING] int32 target ids of a drafted assistant token, -1 padded
    spelled_alone: np.ndarray  # [V_a] bool: a is spelled by one target token whose expansion is [a] again
    healing: "Healing"
    merges: "MergeTable"  # the target's: drafted target tokens merge
    assistant_merges: "MergeTable"  # the assistant's: committed tokens' expansions merge at their boundaries

    @property
    def max_expansion(self) -> int:
        return max(int(np.diff(self.expansion_offsets).max(initial=0)), 1)

    @functools.cached_property
    def extensible(self) -> np.ndarray:
        """[V] bool: target tokens t1 that the assistant may write as the start of a longer target token t12 = t1 t2
        (SmolLM2 writes `_intervals` as `_` + `intervals`, where Qwen has one token): a draft that ends with t1 may
        be cut where the target's tokenizer would not cut. A t1 whose longer tokens the assistant writes otherwise
        (` the`, where the assistant has ` there` whole) is not: its drafts never continue into a merge."""
        table, offsets, ids = self.merges, self.expansion_offsets, self.expansion_ids
        used = table.first >= 0
        t1, t12 = table.first[used], table.merged[used]
        n1, n12 = offsets[t1 + 1] - offsets[t1], offsets[t12 + 1] - offsets[t12]
        starts_alike = (n1 > 0) & (n12 > n1)  # t12's expansion is t1's, then more
        for j in range(self.max_expansion):
            inside = starts_alike & (j < n1)
            starts_alike &= ~inside | (ids[np.minimum(offsets[t12] + j, len(ids) - 1)] ==
                                       ids[np.minimum(offsets[t1] + j, len(ids) - 1)])
        extensible = np.zeros(len(self.draft_source), bool)
        extensible[t1[starts_alike]] = True
        return extensible

    @property
    def shared(self) -> int:
        """Target tokens the assistant can draft."""
        return int((self.draft_source >= 0).sum())

    @property
    def draftable(self) -> int:
        """Assistant tokens the assistant may draft."""
        return int((self.spelling[:, 0] >= 0).sum())

    def expansion(self, token: int) -> list[int]:
        return self.expansion_ids[self.expansion_offsets[token]: self.expansion_offsets[token + 1]].tolist()

    def assistant_prompt(self, target_ids: Sequence[int]) -> list[int]:
        """The prompt as the assistant reads it: target ids -> text -> assistant ids (see the module docstring)."""
        target = self.target
        out, run, at_start = list(self.assistant_prefix), [], True
        bos = getattr(target.tokenizer, "bos_token_id", None)

        def flush():
            nonlocal at_start, run
            if run and at_start:
                text = target.tokenizer.decode(run, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                out.extend(self.assistant.tokenizer(text, add_special_tokens=False)["input_ids"])
            elif run:
                out.extend(self.encoder.encode_many([target.text_of(run)])[0])
            at_start, run = at_start and not run, []

        for token in (int(i) for i in target_ids):
            if 0 <= token < target.size and target.texts[token] is not None:
                run.append(token)
                continue
            flush()
            if token != bos and 0 <= token < target.size:  # the assistant's own BOS leads its prompt
                out.extend(self.expansion(token))
        flush()
        return out


def build(target_tokenizer, assistant_tokenizer, target_vocab_size: int, assistant_vocab_size: int) -> VocabMap:
    """The tables for a target and an assistant (vocabulary sizes: the models', which may exceed the tokenizers')."""
    target = Vocabulary.read(target_tokenizer, target_vocab_size)
    assistant = Vocabulary.read(assistant_tokenizer, assistant_vocab_size)
    assistant_ids = assistant.canonical_ids()
    draft_source = np.full(target.size, -1, np.int32)
    for text, token in target.canonical_ids().items():
        draft_source[token] = assistant_ids.get(text, -1)
    if not (draft_source >= 0).any():
        raise ValueError(
            "The target's and the assistant's tokenizers share no token with the same text, so the assistant could "
            "never draft a target token. Universal assisted decoding needs overlapping vocabularies: choose an "
            "assistant whose tokenizer covers the target's language (or one with the target's own tokenizer), and "
            "check that tokenizer= and assistant_tokenizer= are the models' own.")
    encoder = Encoder(assistant)
    special_text = {i: text for text, i in target.specials.items()}
    expansions: list[list[int]] = [[] for _ in range(target.size)]
    spelled = []  # target tokens the assistant spells out
    for token in range(target.size):
        if draft_source[token] >= 0:
            expansions[token] = [int(draft_source[token])]
        elif token in special_text:
            same = assistant.specials.get(special_text[token])
            expansions[token] = [same] if same is not None else []
        elif target.texts[token]:
            spelled.append(token)
    texts = [target.texts[t] for t in spelled]
    inexpressible = 0
    for token, text, ids in zip(spelled, texts, encoder.encode_many(texts)):
        expansions[token] = ids
        inexpressible += assistant.text_of(ids) != text
    lengths = np.array([len(e) for e in expansions], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.array([i for e in expansions for i in e], np.int32)
    spelling, spelled_alone = _spellings(target, assistant, draft_source)
    return VocabMap(target, assistant, encoder, draft_source, offsets, flat, _prefix(assistant_tokenizer),
                    inexpressible, spelling, spelled_alone, Healing.build(target, assistant),
                    MergeTable.build(target), MergeTable.build(assistant))


def _spellings(target: Vocabulary, assistant: Vocabulary, draft_source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[V_a, MAX_SPELLING] target ids per assistant token (see the module docstring), and which spell alone."""
    spelling = np.full((assistant.size, MAX_SPELLING), -1, np.int32)
    spelled_alone = np.zeros(assistant.size, bool)
    shared = {int(a): t for t, a in enumerate(draft_source) if a >= 0}
    target_specials = target.specials
    rest = []
    for a, text in enumerate(assistant.texts):
        if a in shared:
            spelling[a, 0], spelled_alone[a] = shared[a], True
        elif text:
            rest.append(a)
    for text, a in assistant.specials.items():  # e.g. ChatML's <|im_end|>, the end of a drafted turn
        if text in target_specials:  # and the target's special expands back to `a` (see `build`)
            spelling[a, 0], spelled_alone[a] = target_specials[text], True
    target_encoder = Encoder(target)
    for a, ids in zip(rest, target_encoder.encode_many([assistant.texts[a] for a in rest])):
        if 0 < len(ids) <= MAX_SPELLING and target.text_of(ids) == assistant.texts[a]:
            spelling[a, : len(ids)] = ids
    return spelling, spelled_alone


@dataclasses.dataclass(frozen=True)
class Healing:
    """Whitespace the assistant's context ends with, redrafted whole (token healing).

    The target cuts code as `):\n` + `    return`, the assistant as `):` + `\n   ` + ` return`. Once the target has
    committed `):\n`, the assistant's context ends with a bare `\n`, which in its own tokenization means "a line
    with no indentation follows", so it drafts e.g. a closing fence. A row whose context ends with a healable
    whitespace token h therefore drafts its first token at h's position instead, among the tokens that extend h
    (`\n`, `\n   `, `\n       `, ...), and drafts only the bytes past h (`suffix_spelling`, in target tokens).
    """

    index: np.ndarray  # [V_a] int32: the healable token's row in the tables below, or -1
    extensions: np.ndarray  # [H, E] int32 assistant tokens whose bytes start with h's (h itself first), -1 padded
    suffix_spelling: np.ndarray  # [H, E, MAX_SPELLING] int32 target tokens of the bytes past h, -1 padded
    spellable: np.ndarray  # [H, E] bool: the suffix has a spelling (an empty one for h itself)

    @classmethod
    def build(cls, target: Vocabulary, assistant: Vocabulary) -> "Healing":
        ids = assistant.canonical_ids()
        longer: dict[bytes, list[int]] = {}
        for text, token in ids.items():
            for cut in range(1, len(text)):
                if text[:cut] in ids and not text[:cut].strip():
                    longer.setdefault(text[:cut], []).append(token)
        healed = sorted((text, tokens) for text, tokens in longer.items() if len(tokens) < MAX_HEAL_EXTENSIONS)
        index = np.full(assistant.size, -1, np.int32)
        width = 1 + max((len(tokens) for _, tokens in healed), default=0)
        extensions = np.full((max(len(healed), 1), width), -1, np.int32)
        suffix_spelling = np.full((*extensions.shape, MAX_SPELLING), -1, np.int32)
        spellable = np.zeros(extensions.shape, bool)
        encoder = Encoder(target)
        for row, (text, tokens) in enumerate(healed):
            index[ids[text]] = row
            extensions[row, 0], spellable[row, 0] = ids[text], True
            suffixes = encoder.encode_many([assistant.texts[t][len(text):] for t in tokens])
            for column, (token, pieces) in enumerate(zip(tokens, suffixes), start=1):
                extensions[row, column] = token
                if len(pieces) <= MAX_SPELLING and target.text_of(pieces) == assistant.texts[token][len(text):]:
                    suffix_spelling[row, column, : len(pieces)] = pieces
                    spellable[row, column] = True
        return cls(index, extensions, suffix_spelling, spellable)


@dataclasses.dataclass(frozen=True)
class MergeTable:
    """(t1, t2) -> the target token whose bytes are t1's then t2's, as an open-addressing hash table the compiled
    loop probes (jaxspec/strategies/universal.py `merge`): slot hash(t1, t2) + j for j < probes."""

    first: np.ndarray  # [T] int32 t1 per slot, -1 empty
    second: np.ndarray  # [T] int32 t2
    merged: np.ndarray  # [T] int32 t12
    probes: int  # the longest probe sequence of any key

    @classmethod
    def build(cls, vocabulary: Vocabulary) -> "MergeTable":
        ids = vocabulary.canonical_ids()
        pairs = [(ids[text[:cut]], ids[text[cut:]], token) for text, token in ids.items() if len(text) > 1
                 for cut in range(1, len(text)) if text[:cut] in ids and text[cut:] in ids]
        size = 1 << max(4, (2 * len(pairs) - 1).bit_length())  # load factor at most 1/2
        first = np.full(size, -1, np.int32)
        second, merged = np.zeros(size, np.int32), np.zeros(size, np.int32)
        probes = 1
        if pairs:
            keys = np.array(pairs, np.int64)
            slots = merge_hash(keys[:, 0].astype(np.uint32), keys[:, 1].astype(np.uint32), size)
            for (t1, t2, t12), slot in zip(pairs, slots.tolist()):
                j = 0
                while first[(slot + j) & (size - 1)] >= 0:
                    j += 1
                at = (slot + j) & (size - 1)
                first[at], second[at], merged[at] = t1, t2, t12
                probes = max(probes, j + 1)
        return cls(first, second, merged, probes)

    def lookup(self, t1: int, t2: int) -> int:
        """The host's reading of the table (tests compare the loop's with it)."""
        slot = int(merge_hash(np.array([t1], np.uint32), np.array([t2], np.uint32), len(self.first))[0])
        for j in range(self.probes):
            at = (slot + j) & (len(self.first) - 1)
            if self.first[at] == t1 and self.second[at] == t2:
                return int(self.merged[at])
        return -1


def merge_hash(t1, t2, size: int, xp=np):
    """The slot of a (t1, t2) key: uint32 arithmetic, which numpy and jax.numpy (`xp`) wrap the same way."""
    mixed = (t1 * xp.uint32(0x9E3779B1)) ^ (t2 * xp.uint32(0x85EBCA77))
    mixed = mixed ^ (mixed >> xp.uint32(15))
    return (mixed & xp.uint32(size - 1)).astype(xp.int32)


def _prefix(tokenizer) -> tuple[int, ...]:
    """The ids a tokenizer adds in front of a text (a BOS), read off its encoding of a sample text."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    cut = len(with_special) - len(plain)
    return tuple(with_special[:cut]) if cut >= 0 and with_special[cut:] == plain else ()


def same_vocabulary(first, second) -> bool:
    """Whether two tokenizers give every text the same ids: the same token -> id table (added tokens included)."""
    return first is second or _cached(("same", first, second), lambda: first.get_vocab() == second.get_vocab())


def vocab_map(target_tokenizer, assistant_tokenizer, target_vocab_size: int, assistant_vocab_size: int) -> VocabMap:
    """`build`, once per tokenizer pair and sizes in a process (tables of large vocabularies take seconds)."""
    key = ("map", target_tokenizer, assistant_tokenizer, target_vocab_size, assistant_vocab_size)
    return _cached(key, lambda: build(target_tokenizer, assistant_tokenizer, target_vocab_size, assistant_vocab_size))


_CACHE: dict[tuple, tuple[list[weakref.ref], Any]] = {}
MAX_CACHED = 8


def _cached(key: tuple, make):
    """A result kept while the tokenizer objects in `key` live (keyed by identity: tokenizers are not hashable
    by value, and a new object is a new pair)."""
    objects = [k for k in key if not isinstance(k, (str, int))]
    ident = tuple(id(k) if not isinstance(k, (str, int)) else k for k in key)
    held = _CACHE.get(ident)
    if held is not None and all(ref() is obj for ref, obj in zip(held[0], objects)):
        return held[1]
    value = make()
    _CACHE[ident] = ([weakref.ref(obj) for obj in objects], value)
    while len(_CACHE) > MAX_CACHED:
        _CACHE.pop(next(iter(_CACHE)))
    return value

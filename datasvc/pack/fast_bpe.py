"""A byte-level BPE tokenizer's text encoding through ``tiktoken``, taken only where it provably gives
the ids ``tokenizers`` gives (``Tokenizer.encode(text, add_special_tokens=False).ids``), 6 to 7
times faster on chat text.

The two BPEs differ in their rules: ``tokenizers`` applies the listed merges, lowest merge index
first; ``tiktoken`` joins any adjacent pair whose bytes are a token, lowest id first, and returns a
piece that is a token whole. ``_merges_in_id_order`` and ``_unreachable_tokens`` say when, and on
which tokens, the rules agree; the pre-tokenizer, normalizer and added tokens are matched field by
field. Anything else gets None, and the caller keeps ``tokenizers``.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from functools import lru_cache

import tiktoken
from tokenizers import Tokenizer, models, normalizers

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN35_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# The libraries run a split pattern on different regex engines (Oniguruma, fancy-regex) with their
# own Unicode tables, so only patterns compared on both, code point by code point in letter, digit,
# space and mark contexts, are taken. Each matches every character, so tiktoken (which drops what
# no match covers) loses nothing.
SPLITS_ALIKE_ON_BOTH_ENGINES = frozenset({GPT2_SPLIT, QWEN2_SPLIT, QWEN35_SPLIT})


class ExactBPE:
    """``text -> ids`` as the tokenizer's ``encode(text, add_special_tokens=False).ids``: its added
    tokens matched first (the longest at the leftmost place, as ``tokenizers`` matches them), the
    text between them normalized and encoded by ``tiktoken``. A lone surrogate is the caller's to
    refuse: ``tokenizers`` raises on one, ``tiktoken`` would replace it."""

    def __init__(self, encoding: tiktoken.Encoding, added: dict[str, int], nfc: bool):
        self._encoding = encoding
        self._added = added
        # A capturing split gives [text, added token, text, ...]; longest first, so a prefix never wins.
        alternatives = "|".join(map(re.escape, sorted(added, key=len, reverse=True)))
        self._split = re.compile(f"({alternatives})").split if added else None
        self._nfc = normalizers.NFC() if nfc else None

    def __call__(self, text: str) -> list[int]:
        if self._split is None:
            return self._plain(text)
        parts = self._split(text)
        ids = self._plain(parts[0])
        for i in range(1, len(parts), 2):
            ids.append(self._added[parts[i]])
            ids += self._plain(parts[i + 1])
        return ids

    def _plain(self, text: str) -> list[int]:
        # Python's NFC check is many times faster than tokenizers' NFC. It answers for tokenizers too:
        # their Unicode tables are older, and text NFC under newer tables is NFC under older ones
        # (marks the older tables lack are starters there, which only block more).
        if self._nfc is not None and not text.isascii() and not unicodedata.is_normalized("NFC", text):
            text = self._nfc.normalize_str(text)  # tokenizers' own NFC, with its tables
        return self._encoding.encode_ordinary(text)


# Verdicts by the digest of a tokenizer's JSON: built and checked once in a process (about a second
# for a 150k vocabulary), however many encoders share the tokenizer.
_VERDICTS: dict[str, ExactBPE | None] = {}


def fast_text_encoder(tokenizer: Tokenizer) -> ExactBPE | None:
    """An ``ExactBPE`` for ``tokenizer``, or None where tiktoken could tokenize some text differently."""
    if tokenizer.encode_special_tokens:  # added special tokens would then stay text: not modelled
        return None
    spec_json = tokenizer.to_str()
    digest = hashlib.sha256(spec_json.encode()).hexdigest()
    if digest not in _VERDICTS:
        _VERDICTS[digest] = _exact_bpe(json.loads(spec_json), tokenizer)
    return _VERDICTS[digest]


def _exact_bpe(spec: dict, tokenizer: Tokenizer) -> ExactBPE | None:
    # The post-processor and decoder play no part: a post-processor only adds special tokens, which
    # these encodings do not ask for.
    model, added = spec["model"], spec.get("added_tokens") or []
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    if (pattern is None or spec.get("normalizer") not in (None, {"type": "NFC"})
            or spec.get("truncation") or spec.get("padding") or not _plain_bpe(model)
            or any(t["normalized"] or t["single_word"] or t["lstrip"] or t["rstrip"] for t in added)):
        return None
    vocab = model["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]  # "a b" or ["a", "b"]
    if not _byte_alphabet_only(vocab) or not _merges_in_id_order(vocab, merges):
        return None
    unreachable = _unreachable_tokens(tokenizer, model, merges)
    if unreachable and model.get("ignore_merges"):  # tokenizers returns them whole, tiktoken never
        return None
    byte_of = str.maketrans({c: chr(b) for c, b in _byte_of_char().items()})
    ranks = {token.translate(byte_of).encode("latin-1"): i
             for token, i in vocab.items() if token not in unreachable}
    encoding = tiktoken.Encoding("exact-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return ExactBPE(encoding, {t["content"]: t["id"] for t in added}, nfc=spec.get("normalizer") is not None)


def _split_pattern(pre: dict | None) -> str | None:
    """The split regex of a byte-level pre-tokenizer tiktoken reproduces: Split(regex, isolated) then
    ByteLevel without its regex, or a ByteLevel with GPT-2's; neither adding a prefix space."""
    if not pre:
        return None
    if pre["type"] == "ByteLevel":
        return GPT2_SPLIT if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers") or []
    if pre["type"] != "Sequence" or len(steps) != 2:
        return None
    split, byte_level = steps
    if (split["type"] != "Split" or "Regex" not in split["pattern"] or split["behavior"] != "Isolated"
            or split.get("invert") or byte_level["type"] != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space")):
        return None
    pattern = split["pattern"]["Regex"]
    return pattern if pattern in SPLITS_ALIKE_ON_BOTH_ENGINES else None


def _plain_bpe(model: dict) -> bool:
    return (model["type"] == "BPE" and model.get("dropout") is None and not model.get("byte_fallback")
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"))


@lru_cache(maxsize=1)
def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level vocabularies are written in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(moved)}


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in byte_chars().items()}


def _byte_alphabet_only(vocab: dict[str, int]) -> bool:
    """Every token written in the byte alphabet, every byte a token, no id twice."""
    alphabet = set(_byte_of_char())
    return alphabet <= set(vocab) and set("".join(vocab)) <= alphabet and len(set(vocab.values())) == len(vocab)


def _merges_in_id_order(vocab: dict[str, int], merges: list[list[str]]) -> bool:
    """Each merge is a pair whose join is a token, and merge index never decreases as the joined
    token's id grows: the lowest merge index first is the lowest id first."""
    if any(len(pair) != 2 for pair in merges):
        return False
    joined = [vocab.get(left + right) for left, right in merges]
    return None not in joined and all(map(int.__le__, joined, joined[1:]))


def _unreachable_tokens(tokenizer: Tokenizer, model: dict, merges: list[list[str]]) -> set[str]:
    """The tokens tokenizers' merges do not build from their own bytes. Left out of tiktoken's ranks,
    the two BPEs agree on every piece (given ``_merges_in_id_order``). Why: at any step of merging a
    piece, no merge has crossed the outer edges of two neighbours u, v yet, so the bytes of u+v went
    through exactly the merges they go through alone: that run passed through [u, v]. If it builds
    the token T = u+v, (u, v) is the one split of T it passes through, a listed merge; if it does
    not, (u, v) is no listed merge (the run would have joined them). So tokenizers and tiktoken
    without the unreachable tokens see the same candidate pairs, one split per token, ranked alike
    and taken leftmost first on ties; and a piece that is a reachable token comes out whole from both.
    """
    # The model alone (no normalizer, pre-tokenizer or added tokens); without its whole-word lookup,
    # which would hide them.
    bare = Tokenizer(models.BPE(model["vocab"], list(map(tuple, merges))) if model.get("ignore_merges")
                     else tokenizer.model)
    words = list(model["vocab"])
    built = bare.encode_batch_fast(words, add_special_tokens=False)
    return {word for word, enc in zip(words, built) if len(enc.ids) != 1}

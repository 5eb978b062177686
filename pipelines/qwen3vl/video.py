"""Qwen3-VL's video facts: how its processor samples and sizes frames, and a video's token span.

From transformers' ``Qwen3VLVideoProcessor`` (class defaults) and ``Qwen3VLProcessor``: 2 frames a
second, 4 to 768 frames, smart resize over frames x height x width within [128, 768] merge windows
of 32 x 32 pixels. The span is the chat template's ``<|vision_start|><|video_pad|><|vision_end|>``
with the pad expanded per temporal group as ``<t.t seconds>`` + ``<|vision_start|>`` + the group's
pads + ``<|vision_end|>`` (the outer start and end stay, as the processor leaves them).
"""
from __future__ import annotations

from datasvc.media.video import VideoSpec

FPS, MIN_FRAMES, MAX_FRAMES = 2.0, 4, 768
MIN_PIXELS, MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32


def video_spec(fps: float, min_frames: int, max_frames: int, min_pixels: int, max_pixels: int,
               max_decode_frame_pixels: int) -> VideoSpec:
    return VideoSpec(fps=fps, min_frames=min_frames, max_frames=max_frames, min_pixels=min_pixels,
                     max_pixels=max_pixels, max_decode_frame_pixels=max_decode_frame_pixels)


class VideoSpans:
    """Token ids of a video's span from its grid and group timestamps."""

    def __init__(self, tokenizer, vision_start: int, vision_end: int, video_pad: int, merge_size: int):
        self.tokenizer = tokenizer
        self.vision_start, self.vision_end, self.video_pad = vision_start, vision_end, video_pad
        self.merge_size = merge_size
        self._stamps: dict[str, list[int]] = {}

    def _stamp(self, seconds: float) -> list[int]:
        text = f"<{seconds:.1f} seconds>"
        if text not in self._stamps:
            self._stamps[text] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._stamps[text]

    def span(self, grid_thw, timestamps) -> list[int]:
        t, h, w = (int(v) for v in grid_thw)
        if len(timestamps) != t:
            raise ValueError(f"{len(timestamps)} timestamps for {t} temporal groups")
        group = [self.vision_start] + [self.video_pad] * (h * w // self.merge_size**2) + [self.vision_end]
        ids = [self.vision_start]
        for seconds in timestamps:
            ids += self._stamp(seconds) + group
        return ids + [self.vision_end]

    def vision_tokens(self, grid_thw) -> int:
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.merge_size**2

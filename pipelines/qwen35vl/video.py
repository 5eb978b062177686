"""Qwen3.5-VL's video facts: transformers maps ``qwen3_5`` and ``qwen3_5_moe`` to Qwen3-VL's video
processor and processor (``Qwen3VLVideoProcessor``, ``Qwen3VLProcessor``), so the frame sampling,
pixel limits and the timestamped span are Qwen3-VL's, here by import."""
from pipelines.qwen3vl.video import FPS, MAX_FRAMES, MAX_PIXELS, MIN_FRAMES, MIN_PIXELS, VideoSpans, video_spec

__all__ = ["FPS", "MAX_FRAMES", "MAX_PIXELS", "MIN_FRAMES", "MIN_PIXELS", "VideoSpans", "video_spec"]

"""Video samples: probe, frame choice, DALI decode, tokens and tensors, checked against the
transformers Qwen3-VL processor on the same decoded frames. Clips are real photos panned and zoomed,
encoded by FFmpeg's encoders through PyAV (libvpx-vp9, MJPEG, libx264)."""
from __future__ import annotations

import io

import numpy as np
import pytest

av = pytest.importorskip("av")

from datasvc.samples import real_photos  # noqa: E402
from datasvc.video import (VideoDecoder, VideoSpec, group_timestamps, plan_video, probe_video,  # noqa: E402
                           sample_frame_indices, to_video_pixel_values, video_target_size)
from datasvc.vision import ImageRejected  # noqa: E402


def _photo(name: str) -> np.ndarray:
    img = next(i for n, i, _ in real_photos() if n == name)
    return img if img.ndim == 3 else np.repeat(img[..., None], 3, axis=2)


def pan_zoom(photo: np.ndarray, frames: int, size: tuple[int, int]) -> list[np.ndarray]:
    """A camera move over a real photo: the crop pans left to right while zooming in 30%."""
    import cv2

    h, w = photo.shape[:2]
    out = []
    for k in range(frames):
        s = k / max(1, frames - 1)
        ch, cw = int(h * (0.9 - 0.3 * s)), int(w * (0.9 - 0.3 * s))
        y, x = (h - ch) // 2, int((w - cw) * s)
        out.append(cv2.resize(np.ascontiguousarray(photo[y:y + ch, x:x + cw, :3]), size[::-1], interpolation=cv2.INTER_AREA))
    return out


def encode_clip(frames: list[np.ndarray], fps: int, codec: str = "libvpx-vp9", fmt: str = "webm",
                audio: bool = False) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.height, s.width = frames[0].shape[:2]
        s.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def audio_only(seconds: float = 0.5) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as c:
        s = c.add_stream("libopus", rate=48000)
        samples = np.zeros((1, 960), np.float32)
        for _ in range(int(seconds * 50)):
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate = 48000
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


SPEC = VideoSpec(fps=2, min_frames=4, max_frames=768, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    astro, coffee = _photo("astronaut"), _photo("coffee")
    return {
        "vp9": encode_clip(pan_zoom(astro, 25, (96, 128)), fps=10),  # 2.5 s
        "mjpeg": encode_clip(pan_zoom(coffee, 13, (112, 160)), fps=6, codec="mjpeg", fmt="matroska"),
        "h264": encode_clip(pan_zoom(astro, 12, (96, 128)), fps=12, codec="libx264", fmt="mp4"),
    }

"""Synthetic video members: real photographs filmed by a virtual camera (a pan with a slow zoom),
encoded by FFmpeg's own encoders through PyAV at a drawn length, frame rate, size, bitrate and
keyframe interval; and the header facts of real video members that calibration fits those to.

Why real photos and real encoders: what a video costs the data path is the decoder's work per
sampled frame, which follows from codec, size, bitrate and how far each sampled frame sits from
its keyframe. A flat or random clip of the same size decodes at a different cost; an encoder's
own bitstream at the real bitrate and GOP does not.
"""
from __future__ import annotations

import functools
import io
from dataclasses import dataclass

import numpy as np

from datasvc.tools.synth.dist import CONTAINERS, ENCODERS, pick

_MAX_RATE_ERROR = 0.12  # re-encode once when the encoder's rate control misses by more


@dataclass(frozen=True, slots=True)
class VideoSpec:
    """One synthetic clip: ``fmt`` is ``codec/extension`` (``vp9/webm``), bitrate in bits/s of the
    video stream, ``gop`` frames between keyframes."""

    fmt: str
    width: int
    height: int
    fps: float
    frames: int
    bitrate: float
    gop: int

    @property
    def codec(self) -> str:
        return self.fmt.split("/")[0]

    @property
    def ext(self) -> str:
        return self.fmt.split("/")[1]


def video_record(data: bytes) -> dict | None:
    """Header facts of one video member from ``datasvc.media.video.probe_video`` (containers demuxed,
    no frame decoded); None for what the service would reject."""
    from datasvc.media.video import probe_video
    from datasvc.media.vision import ImageRejected

    try:
        h = probe_video(data)
    except ImageRejected:
        return None
    seconds = h.duration
    bits = 8 * (h.stream_bytes or len(data))
    return {"codec": h.codec, "w": h.width, "h": h.height, "fps": h.fps, "frames": h.frames, "seconds": seconds,
            "nbytes": len(data), "bitrate": bits / seconds,
            "bits_per_pixel": bits / (h.frames * h.width * h.height),
            "gop_seconds": seconds / max(1, h.keyframes)}


def draw_video_spec(rng: np.random.Generator, p) -> VideoSpec:
    """A clip's parameters from a profile's video distributions. Always the same draws in the same
    order, so one changed field does not reshuffle the others."""
    fmt = pick(rng, p.video_formats)
    size = pick(rng, _of_format(p.video_sizes, fmt))
    fps = p.video_fps.sample(rng)
    seconds = p.video_seconds.sample(rng)
    bpp = _of_format(p.video_bits_per_pixel, fmt).sample(rng)
    gop_s = _of_format(p.video_gop_seconds, fmt).sample(rng)
    w, h = (int(v) for v in size.split("x"))
    w, h = max(16, w // 2 * 2), max(16, h // 2 * 2)  # 4:2:0 chroma needs even sides
    frames = max(2, round(seconds * fps))
    return VideoSpec(fmt, w, h, float(fps), frames, bpp * w * h * fps, max(1, round(gop_s * fps)))


def _of_format(field, fmt: str):
    """A per-format field's entry for ``fmt`` (the first one for a format it lacks); a field that is
    not per format (keys are formats, ``codec/extension``) as it is."""
    if isinstance(field, dict) and any("/" in k for k in field):
        return field.get(fmt) or next(iter(field.values()))
    return field


@functools.lru_cache(maxsize=1)
def _photos() -> tuple[np.ndarray, ...]:
    from datasvc.samples import real_photos

    out = []
    for _name, img, _doc in real_photos():
        img = np.repeat(img[..., None], 3, axis=2) if img.ndim == 2 else img[..., :3]
        if min(img.shape[:2]) >= 128:
            out.append(np.ascontiguousarray(img))
    return tuple(out)


def _camera(rng: np.random.Generator, spec: VideoSpec):
    """A function frame index -> RGB frame: a crop of the clip's aspect ratio moving in a straight
    line across one photo while zooming, with a little sensor noise (as a camera has)."""
    import cv2

    photos = _photos()
    photo = photos[int(rng.integers(len(photos)))]
    ph, pw = photo.shape[:2]
    aspect = spec.width / spec.height
    z0, z1 = rng.uniform(0.55, 0.95, 2)
    (x0, y0), (x1, y1) = rng.random(2), rng.random(2)
    noise = float(rng.uniform(0.5, 2.5))
    seed = int(rng.integers(2**30))
    grain = np.empty((spec.height, spec.width), np.float32)

    def frame(k: int) -> np.ndarray:
        s = k / max(1, spec.frames - 1)
        z = z0 + (z1 - z0) * s
        cw = min(pw, ph * aspect) * z
        ch = cw / aspect
        cx, cy = (x0 + (x1 - x0) * s) * (pw - cw), (y0 + (y1 - y0) * s) * (ph - ch)
        m = np.float32([[cw / spec.width, 0, cx], [0, ch / spec.height, cy]])
        img = cv2.warpAffine(photo, m, (spec.width, spec.height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                             borderMode=cv2.BORDER_REFLECT)
        cv2.setRNGSeed(seed + k)  # OpenCV's generator: a fifth of numpy's cost per frame, as repeatable
        cv2.randn(grain, 0.0, noise)
        return cv2.add(img, cv2.merge([grain, grain, grain]), dtype=cv2.CV_8U)

    return frame


def _encode(spec: VideoSpec, frame, rate: float, frames: int | None = None) -> bytes:
    """The clip (or its first ``frames``) encoded; ``rate`` is bits/s, or MJPEG's fixed quantizer."""
    import av

    n = spec.frames if frames is None else frames
    buf = io.BytesIO()
    # bitexact: no muxer UIDs, dates or encoder version strings, so equal arguments give equal bytes
    with av.open(buf, "w", format=CONTAINERS[spec.ext], options={"fflags": "+bitexact"}) as c:
        s = c.add_stream(ENCODERS[spec.codec], rate=_rate(spec.fps))
        s.width, s.height = spec.width, spec.height
        s.pix_fmt = "yuvj420p" if spec.codec == "mjpeg" else "yuv420p"
        cc = s.codec_context
        if spec.codec == "mjpeg":  # no rate control: one quantizer for every frame
            cc.qscale = True
            cc.qmin = cc.qmax = int(rate)
        else:
            s.bit_rate = int(rate)
            cc.gop_size = spec.gop
        s.options = {"flags": "+bitexact", **_encoder_options(spec)}
        cc.thread_count = 1  # threaded VP8, AV1 and H.264 encoders vary from run to run
        tick = 1 / _rate(spec.fps)  # one frame
        for k in range(n):
            vf = av.VideoFrame.from_ndarray(frame(k), format="rgb24")
            # Explicit timestamps: x264's rate control reads them, and left unset they vary
            vf.pts, vf.time_base = k, tick
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _rate(fps: float):
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001)


def _encoder_options(spec: VideoSpec) -> dict:
    # Fast presets: a synthetic set is written once per benchmark; what decoding costs is set by
    # the bitrate, GOP and size, which these keep.
    if spec.codec in ("vp8", "vp9"):
        return {"deadline": "realtime", "cpu-used": "8"}
    if spec.codec == "h264":
        return {"preset": "veryfast", "x264-params": "threads=1:lookahead-threads=1"}  # repeatable
    if spec.codec == "hevc":
        return {"preset": "ultrafast", "x265-params": f"keyint={spec.gop}:min-keyint={spec.gop}:log-level=error"}
    if spec.codec == "av1":
        return {"preset": "12", "svtav1-params": "enable-overlays=0:lp=1"}
    return {}


def _stream_bitrate(data: bytes) -> float:
    from datasvc.media.video import probe_video

    h = probe_video(data)
    return 8 * (h.stream_bytes or len(data)) / h.duration


def render_video(spec: VideoSpec, rng: np.random.Generator) -> bytes:
    """The clip's bytes, within about 12% of its bitrate where the encoder can reach it: rate
    control over a few seconds misses, so a miss is encoded once more with the target corrected;
    MJPEG's quantizer is found by bisection on a few frames."""
    frame = _camera(rng, spec)
    if spec.codec == "mjpeg":
        return _encode(spec, frame, _mjpeg_quantizer(spec, frame))
    data = _encode(spec, frame, spec.bitrate)
    got = _stream_bitrate(data)
    if abs(got / spec.bitrate - 1) > _MAX_RATE_ERROR:
        data = _encode(spec, frame, spec.bitrate * spec.bitrate / got)
    return data


def _mjpeg_quantizer(spec: VideoSpec, frame) -> int:
    """The quantizer (2 best .. 31) whose first frames come nearest the bitrate."""
    probe = min(spec.frames, 4)
    target = spec.bitrate / spec.fps * probe / 8  # bytes of ``probe`` frames
    lo, hi = 2, 31
    while lo < hi:
        q = (lo + hi) // 2
        if len(_encode(spec, frame, q, probe)) > target:
            lo = q + 1
        else:
            hi = q
    return lo


def fit_sizes(records: list[dict]) -> dict[str, float]:
    """Frame sizes as a mix of ``WxH`` (video sizes are a few standard ones, not a continuum)."""
    keys = [f"{r['w']}x{r['h']}" for r in records]
    return {k: keys.count(k) / len(keys) for k in sorted(set(keys))}


def mean_or_none(values) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None

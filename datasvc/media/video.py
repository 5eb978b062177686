"""Video samples: probe the container, choose frames the way the model's processor does, decode
only those with DALI (CPU or NVDEC through the mixed backend), or with FFmpeg through PyAV where
no DALI backend here takes the video, resize each to the grid's size.

Stages, as for images: ``probe_video`` reads the container's headers and demuxes packets (no frame
is decoded) for codec, size, frame count, frame rate and whether the rate is constant;
``plan_video`` turns that into the frame indices, the resized size and the patch grid, and checks
the caps (sampled frames x stored pixels) before any decode; a ``VideoDecoder`` decodes the planned
frames (``datasvc.media.videodecode``) and returns uint8 frames, padded to the temporal patch, as pixel
rows (one patch of one frame per row, frame after frame, raster order). ``to_video_pixel_values``
makes the model's float rows in the processor's patch order.

The numbers (sampling fps, frame limits, pixel limits) are a pipeline's, given as a ``VideoSpec``.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from datasvc.media.decode import resize_uint8
from datasvc.media.vision import ImageRejected, VisionSpec, fused_kernel_usable, fused_pixel_values

VIDEO_EXTS = ("mp4", "webm", "mkv", "mov")
KNOWN_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mjpeg", "mpeg4")
CPU_CODECS = ("vp8", "vp9", "mjpeg")
"""What DALI's CPU video decoder takes (libavcodec); on a CPU machine the other codecs are decoded
by PyAV (``datasvc.media.videodecode``)."""
VIDEO_STAGES = ("video_decode", "video_preprocess")
"""Stage timers counted per decoded frame; the same seconds are in ``decode`` and ``preprocess``."""
GPU_CODECS = {"h264": (48, 16), "hevc": (144, 144), "vp8": (48, 16), "vp9": (128, 128), "av1": (128, 128),
              "mpeg4": (48, 16)}
"""What DALI's mixed backend (NVDEC) takes, with NVDEC's smallest width and height per codec; it
refuses MJPEG, and a VP9 clip of 128x96 (both seen on an H200, DALI 2.4)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoSpec:
    """How a model's processor samples and sizes a video; the values come from a pipeline."""

    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int  # over frames x height x width, as the processor's smart resize counts them
    max_pixels: int
    max_decode_frame_pixels: int = 400_000_000
    """Sampled frames x stored height x width of one sample's videos: past it the sample is rejected
    ``video_too_large`` from the headers, before anything is decoded."""
    max_frame_rate_spread: float = 0.05
    """Packet durations further than this fraction from their median make a variable-frame-rate
    video, rejected: the processor's timestamps (index / fps) would misplace its frames."""

    def __post_init__(self):
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"video frames: need 1 <= min_frames {self.min_frames} <= max_frames {self.max_frames}")
        if self.fps <= 0:
            raise ValueError(f"video sampling fps must be > 0, got {self.fps}")


@dataclass(frozen=True, slots=True)
class VideoHeader:
    codec: str
    width: int
    height: int
    frames: int
    fps: float
    keyframes: int = 0
    stream_bytes: int = 0  # the video stream's packets, without the container's overhead

    @property
    def duration(self) -> float:
        return self.frames / self.fps


def _reject_open(exc: Exception) -> ImageRejected:
    text = str(exc)
    cut = any(s in text.lower() for s in ("moov atom not found", "end of file", "truncat"))
    return ImageRejected("video_truncated" if cut else "video_corrupt", f"{type(exc).__name__}: {text}"[:200])


def _iso_cut(data: bytes) -> bool:
    """An MP4/MOV (ISO boxes from the first byte) whose top-level boxes run past the end."""
    if data[4:8] not in (b"ftyp", b"wide", b"free", b"mdat", b"moov"):
        return False
    pos = 0
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        if size == 1 and pos + 16 <= len(data):
            size = int.from_bytes(data[pos + 8:pos + 16], "big")
        if size == 0:  # the last box, to the end of the file
            return False
        if size < 8 or pos + size > len(data):
            return True
        pos += size
    return pos != len(data)


def _iso_rotation(data: bytes) -> float:
    """Degrees of the first track header (``tkhd``) whose display matrix is not the identity; 0.0
    when every track's is (or the file is not ISO boxes)."""
    if data[4:8] not in (b"ftyp", b"wide", b"free", b"mdat", b"moov"):
        return 0.0
    at = data.find(b"tkhd")
    while at >= 4:
        version = data[at + 4]
        # version/flags, times, track id, reserved, duration, reserved, layer, group, volume, reserved
        matrix_at = at + 8 + (32 if version == 1 else 20) + 16
        if matrix_at + 36 <= len(data):
            a, b, _u, c, d = (int.from_bytes(data[matrix_at + 4 * k:matrix_at + 4 * k + 4], "big", signed=True)
                              for k in range(5))
            if (a, b, c, d) != (65536, 0, 0, 65536):
                return math.degrees(math.atan2(b, a)) if (a or b) else 0.0
        at = data.find(b"tkhd", at + 4)
    return 0.0


def probe_video(data: bytes, spec: VideoSpec | None = None) -> VideoHeader:
    """Codec, size, frame count and rate from the container alone; ``ImageRejected`` (a counted
    reason) for what no decoder should be handed."""
    try:
        import av
    except ImportError:
        raise RuntimeError("video samples need PyAV to read their containers: pip install av") from None

    if not data:
        raise ImageRejected("video_empty", "zero-length video member")
    if _iso_cut(data):
        raise ImageRejected("video_truncated", "an MP4 box runs past the end of the file")
    if rotation := _iso_rotation(data):
        # The processor trains on frames as stored; a display matrix would make grids and pixels
        # disagree with what a viewer shows, so such a video is counted, not guessed at.
        raise ImageRejected("video_rotated", f"display matrix rotates {rotation:g} degrees")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as exc:
        raise _reject_open(exc) from None
    with container:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise ImageRejected("video_no_video_stream", f"streams: {', '.join(kinds)}")
        stream = container.streams.video[0]
        # The codec, not the decoder PyAV picked for it (AV1 is read by "libdav1d").
        codec = stream.codec_context.codec.canonical_name if stream.codec_context else "unknown"
        if codec not in KNOWN_CODECS:
            raise ImageRejected("video_unsupported_codec", f"codec {codec}")
        width, height = stream.codec_context.width, stream.codec_context.height
        rate = stream.average_rate or stream.guessed_rate
        declared = container.duration / 1e6 if container.duration else None  # microseconds
        try:
            packets = [(p.pts, p.duration, p.pos, p.size, p.is_keyframe)
                       for p in container.demux(stream) if p.size > 0]
        except Exception as exc:
            raise _reject_open(exc) from None
    if width <= 0 or height <= 0:
        raise ImageRejected("video_corrupt", f"frame size {width}x{height}")
    if not packets:
        raise ImageRejected("video_truncated", "no video frames in the container")
    if any(pos is not None and pos >= 0 and pos + size > len(data) for _pts, _d, pos, size, _k in packets):
        raise ImageRejected("video_truncated", "frames indexed past the end of the file")
    if not rate or float(rate) <= 0:
        raise ImageRejected("video_corrupt", "no frame rate in the container")
    header = VideoHeader(codec, width, height, len(packets), float(rate), keyframes=sum(p[4] for p in packets),
                         stream_bytes=sum(p[3] for p in packets))
    _check_constant_rate(packets, spec.max_frame_rate_spread if spec else 0.05)
    if declared and header.duration < 0.9 * declared - 1 / header.fps:
        raise ImageRejected("video_truncated", f"{header.frames} frames ({header.duration:.2f} s) of a "
                            f"{declared:.2f} s video")
    return header


def _check_constant_rate(packets: list, spread: float) -> None:
    pts = sorted(p[0] for p in packets if p[0] is not None)
    if len(pts) < 3:
        return
    steps = np.diff(np.asarray(pts, dtype=np.float64))
    median = float(np.median(steps))
    if median <= 0 or float(np.max(np.abs(steps - median))) > spread * median:
        raise ImageRejected("video_variable_frame_rate",
                            f"frame steps {int(steps.min())}..{int(steps.max())} around {median:g}")


def sample_frame_indices(total_frames: int, video_fps: float, spec: VideoSpec) -> np.ndarray:
    """The processor's frame choice: ``fps`` frames a second of the video, clamped to
    [min_frames, max_frames] and to the frames there are, spread by linspace and rounded."""
    n = int(total_frames / video_fps * spec.fps)
    n = min(max(n, spec.min_frames), spec.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int)


def group_timestamps(indices, video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's time, the last group
    padded with the last index (as the processor does)."""
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    secs = [i / video_fps for i in idx]
    return [(secs[i] + secs[i + temporal_patch_size - 1]) / 2 for i in range(0, len(secs), temporal_patch_size)]


def video_target_size(frames: int, height: int, width: int, vision: VisionSpec, spec: VideoSpec) -> tuple[int, int]:
    """Smart resize over frames x height x width (the video processor's rule)."""
    factor, tps = vision.factor, vision.temporal_patch_size
    if height < factor or width < factor:
        raise ImageRejected("video_too_small", f"{width}x{height} is under {factor} pixels a side")
    if max(height, width) / min(height, width) > vision.max_aspect_ratio:
        raise ImageRejected("aspect_ratio", f"{width}x{height} exceeds {vision.max_aspect_ratio:g}:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = math.ceil(frames / tps) * tps
    if t_bar * h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt(frames * height * width / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """What one video becomes, known before decoding: frames to decode, their size, the grid."""

    data: bytes
    header: VideoHeader
    indices: tuple[int, ...]
    target_hw: tuple[int, int]
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]  # seconds per temporal group

    @property
    def decode_frame_pixels(self) -> int:
        return len(self.indices) * self.header.width * self.header.height


def plan_video(data: bytes, vision: VisionSpec, spec: VideoSpec, header: VideoHeader | None = None) -> VideoPlan:
    header = header or probe_video(data, spec)
    indices = sample_frame_indices(header.frames, header.fps, spec)
    th, tw = video_target_size(len(indices), header.height, header.width, vision, spec)
    tps, p = vision.temporal_patch_size, vision.patch_size
    grid = (-(-len(indices) // tps), th // p, tw // p)
    plan = VideoPlan(data, header, tuple(int(i) for i in indices), (th, tw), grid,
                     tuple(group_timestamps(indices, header.fps, tps)))
    if plan.decode_frame_pixels > spec.max_decode_frame_pixels:
        raise ImageRejected("video_too_large", f"{len(indices)} frames of {header.width}x{header.height} > "
                            f"max_decode_frame_pixels {spec.max_decode_frame_pixels}")
    return plan


def check_sample_videos(plans: list[VideoPlan], spec: VideoSpec) -> None:
    """The frames x pixels cap over all of one sample's videos."""
    total = sum(p.decode_frame_pixels for p in plans)
    if total > spec.max_decode_frame_pixels:
        raise ImageRejected("video_too_large", f"{len(plans)} videos decode {total} frame pixels > "
                            f"max_decode_frame_pixels {spec.max_decode_frame_pixels}")


def frames_to_rows(frames: np.ndarray, plan: VideoPlan, vision: VisionSpec) -> np.ndarray:
    """Decoded frames [F, H, W, 3] -> resized, padded to the temporal patch by repeating the last
    frame, as uint8 rows [t*tps*h*w, 3*P*P] (frame after frame, each in raster order)."""
    if frames.shape[0] != len(plan.indices) or frames.shape[1:3] != (plan.header.height, plan.header.width):
        raise ImageRejected("video_corrupt", f"decoded {frames.shape[:3]}, planned "
                            f"{len(plan.indices)}x{plan.header.height}x{plan.header.width}")
    th, tw = plan.target_hw
    tps = vision.temporal_patch_size
    out = np.empty((plan.grid[0] * tps, th, tw, 3), np.uint8)
    for k, frame in enumerate(frames):
        out[k] = resize_uint8(np.ascontiguousarray(frame), (th, tw))
    out[len(frames):] = out[len(frames) - 1]
    return out.reshape(-1, vision.patch_dim)


def to_video_pixel_values(rows, vision: VisionSpec, grid_thw, dtype=None):
    """Concatenated video rows (``frames_to_rows``) -> normalized ``pixel_values_videos``
    [sum(t*h*w), 3*tps*P*P] in the processor's order: per temporal group, merge windows row-major,
    the patches of a window, then channel, frame, patch pixels. Numpy in, float32 numpy out (or
    ``dtype``); a torch tensor in, a tensor out on its device (float32 unless ``dtype``)."""
    if not isinstance(rows, np.ndarray) and rows.is_cuda and fused_kernel_usable(rows.device):
        import torch

        # One launch straight to ``dtype``: no float32 copy of each video and no concatenation.
        return fused_pixel_values(rows, vision, grid_thw, dtype or torch.float32, video=True)
    return unfused_video_pixel_values(rows, vision, grid_thw, dtype)


def unfused_video_pixel_values(rows, vision: VisionSpec, grid_thw, dtype=None):
    """``to_video_pixel_values`` by numpy or torch array ops, one permute and normalize per video
    (the path on the CPU and where the fused kernel cannot run)."""
    p, m, tps = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    width = 3 * tps * p * p
    mean = np.asarray(vision.image_mean, np.float32).reshape(3, 1, 1, 1)
    scale = (1 / (255.0 * np.asarray(vision.image_std, np.float32))).reshape(3, 1, 1, 1)
    shift = mean / np.asarray(vision.image_std, np.float32).reshape(3, 1, 1, 1)
    is_numpy = isinstance(rows, np.ndarray)
    if not is_numpy:
        import torch

        scale, shift = (torch.as_tensor(a, device=rows.device) for a in (scale, shift))
    out, first = [], 0
    for t, gh, gw in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3).tolist():
        count = t * tps * gh * gw
        x = rows[first:first + count].reshape(t, tps, gh // m, m, p, gw // m, m, p, 3)
        order = (0, 2, 5, 3, 6, 8, 1, 4, 7)  # -> t, gh/m, gw/m, m, m, C, tps, P, P
        x = x.transpose(order).astype(np.float32) if is_numpy else x.permute(order).float()
        out.append((x * scale - shift).reshape(t * gh * gw, width))
        first += count
    if first != rows.shape[0]:
        raise ValueError(f"video_grid_thw covers {first} rows of {rows.shape[0]}")
    if is_numpy:
        values = np.concatenate(out) if out else np.zeros((0, width), np.float32)
        return values if dtype is None else values.astype(dtype)
    import torch

    values = torch.cat(out) if out else torch.zeros((0, width), device=rows.device)
    return values if dtype is None else values.to(dtype)


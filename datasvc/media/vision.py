"""Vision geometry shared by Qwen2/2.5/3-VL style encoders: smart resize and patch layout.

Model-specific numbers live in a pipeline's ``VisionSpec``; this module only does the arithmetic.
Images travel as uint8 RGB pixels in raster order, one temporal frame, cut into rows of one patch's
size (768 bytes for P=16): resized to their grid (``pixel_rows``), or as a decoded frame the
consumer resizes (``FrameRows``, ``finish_resize``). Only the consumer puts them in the model's
patch order and makes float ``pixel_values`` (``to_pixel_values``): on a GPU rank the resize takes
microseconds and the permutation is free inside the normalizing kernel, while on the CPU they took
about a third and 20-30% of the preprocessing actors' time per image
(docs/benchmarks/cpu-preprocessing-per-core.md).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from datasvc.usage import UserError


class ImageRejected(ValueError):
    """An image that can never become model input; ``reason`` is a stable counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class InvalidVision(ValueError, UserError):
    """Pixel bounds that cannot hold an image (a user's setting, answered in one line)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionSpec:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_aspect_ratio: float = 200.0
    # Headers declaring more pixels than this are rejected before any decode is attempted.
    max_decode_pixels: int = 64_000_000
    # Apply the EXIF orientation (as HF's load_image does), grids from the oriented size; False
    # uses the stored pixels as they are (datasvc.media.imagefile).
    exif_orientation: bool = True

    def __post_init__(self):
        if self.min_pixels > self.max_pixels:
            raise InvalidVision(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}: lower --min-pixels "
                                "or raise --max-pixels")
        if self.max_pixels < self.factor**2:
            raise InvalidVision(f"max_pixels must be at least {self.factor**2} (one merge window)")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Width of one uint8 patch row as transported (one frame)."""
        return 3 * self.patch_size * self.patch_size

    @property
    def pixel_values_dim(self) -> int:
        """Width of one model ``pixel_values`` row (all temporal frames)."""
        return self.temporal_patch_size * self.patch_dim

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels, self.max_aspect_ratio)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid for a single image of the given original size."""
        th, tw = self.target_size(height, width)
        return 1, th // self.patch_size, tw // self.patch_size

    def vision_tokens(self, grid_thw) -> int:
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge_size**2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 max_aspect_ratio: float = 200.0) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of ``factor``, area within [min, max]."""
    if height <= 0 or width <= 0:
        raise ImageRejected("empty_image", f"{width}x{height}")
    if max(height, width) / min(height, width) > max_aspect_ratio:
        raise ImageRejected("aspect_ratio", f"{width}x{height} exceeds {max_aspect_ratio:g}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixel_rows(image, spec: VisionSpec):
    """uint8 HWC image (sides multiples of patch*merge) -> its bytes as [h*w, 3*P*P] rows, raster
    order: what travels. A view, no copy, of a contiguous image."""
    return image.reshape(-1, spec.patch_dim)


@dataclass(frozen=True, slots=True)
class FrameRows:
    """A decoded image whose last resize its consumer makes (``finish_resize``): the frame's uint8
    RGB pixels in raster order, in whole rows of ``VisionSpec.patch_dim`` bytes. ``body`` holds
    the rows the frame fills (a view of the decoder's buffer: no copy in the actor), ``tail`` its
    last bytes zero-padded to one row, or no row when the frame fills its rows exactly."""

    body: np.ndarray  # uint8 [n, patch_dim]
    tail: np.ndarray  # uint8 [0 or 1, patch_dim]
    hw: tuple[int, int]

    @property
    def blocks(self) -> tuple[np.ndarray, ...]:
        """The frame's rows, as they travel: their concatenation is ``rows``."""
        return (self.body, self.tail) if len(self.tail) else (self.body,)

    @property
    def rows(self) -> np.ndarray:
        """All the frame's rows in one array (a copy; ``frame_row_count(hw)`` of them)."""
        return np.concatenate(self.blocks)


def frame_row_count(height: int, width: int, spec: VisionSpec) -> int:
    return -(-height * width * 3 // spec.patch_dim)


def frame_rows(image: np.ndarray, spec: VisionSpec) -> FrameRows:
    """The ``FrameRows`` of an HWC uint8 image: a view of a contiguous image's whole rows (copied
    only when its strides are not raster order), and its tail padded in a fresh row."""
    h, w = image.shape[:2]
    flat = np.ascontiguousarray(image).reshape(-1)
    full, rest = divmod(flat.size, spec.patch_dim)
    body = flat[:full * spec.patch_dim].reshape(full, spec.patch_dim)
    tail = np.zeros((1 if rest else 0, spec.patch_dim), np.uint8)
    tail.reshape(-1)[:rest] = flat[full * spec.patch_dim:]
    return FrameRows(body, tail, (h, w))


def grid_hw(grid_thw, patch_size: int) -> np.ndarray:
    """Each image's (h, w) in pixels at its grid's size: int64 [n_images, 2]."""
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)[:, 1:] * patch_size


def image_blocks(images: list, grid_thw, spec: VisionSpec
                 ) -> tuple[tuple[np.ndarray, ...], np.ndarray | None]:
    """A decoder's results for consecutive images (``pixel_rows`` arrays or ``FrameRows``) -> the
    blocks of rows whose concatenation holds them in turn (none is copied here: packing writes
    each once into its micro-batch), and every image's frame size (``EncodedSample.image_frame_hw``)
    when any is a frame, else None."""
    blocks = tuple(b for i in images for b in (i.blocks if isinstance(i, FrameRows) else (i,))) or \
        (np.zeros((0, spec.patch_dim), np.uint8),)
    if not any(isinstance(i, FrameRows) for i in images):
        return blocks, None
    sizes = grid_hw(grid_thw, spec.patch_size)
    for k, i in enumerate(images):
        if isinstance(i, FrameRows):
            sizes[k] = i.hw
    return blocks, sizes


def finish_resize(rows, spec: VisionSpec, grid_thw, frames_hw):
    """Concatenated rows of images that each hold either their ``pixel_rows`` or, where
    ``frames_hw`` differs from the grid's size, a ``FrameRows`` frame -> every image's
    ``pixel_rows`` at its grid's size. ``rows`` itself when no image needs a resize.

    On a GPU the resize is HF's own (``hf_resize``: torch's antialiased bicubic), one image at a
    time; on the CPU (numpy arrays, CPU tensors) it is the preprocessing actors' OpenCV resize
    (``jpegscale.fit_uint8``), which takes a third of torch's time there at the same exactness
    bound (docs/benchmarks/cpu-preprocessing-per-core.md).
    """
    targets = grid_hw(grid_thw, spec.patch_size)
    frames = np.asarray(frames_hw, dtype=np.int64).reshape(-1, 2) if frames_hw is not None else None
    if frames is None or np.array_equal(frames, targets):
        return rows
    if len(frames) != len(targets):
        raise ValueError(f"{len(frames)} frame sizes for {len(targets)} images")
    targets, frames = targets.tolist(), frames.tolist()
    counts = [frame_row_count(h, w, spec) for h, w in frames]  # at the target: its grid's rows
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"the images' frames cover {sum(counts)} rows of {rows.shape[0]}")
    n_out = sum(th * tw for th, tw in targets) // spec.patch_size**2
    cpu_tensor = not isinstance(rows, np.ndarray) and not rows.is_cuda
    if isinstance(rows, np.ndarray) or cpu_tensor:
        from datasvc.media.jpegscale import fit_uint8

        src_rows, out = (rows.numpy() if cpu_tensor else rows), np.empty((n_out, spec.patch_dim), np.uint8)
        resize = fit_uint8
    else:
        import torch

        src_rows, out = rows, torch.empty((n_out, spec.patch_dim), dtype=torch.uint8, device=rows.device)
        resize = hf_resize
    src = dst = 0
    for (th, tw), (h, w), n in zip(targets, frames, counts):
        m = th * tw // spec.patch_size**2
        if (h, w) == (th, tw):
            out[dst:dst + m] = src_rows[src:src + n]
        else:
            frame = src_rows[src:src + n].reshape(-1)[:h * w * 3].reshape(h, w, 3)
            out[dst:dst + m].reshape(th, tw, 3)[...] = resize(frame, (th, tw))
        src, dst = src + n, dst + m
    if cpu_tensor:
        import torch

        return torch.from_numpy(out)
    return out


def hf_resize(frame, target_hw: tuple[int, int]):
    """An HWC uint8 tensor resized as the HF processor's torchvision backend resizes it: torch's
    antialiased bicubic in float32, rounded and clamped to uint8 (HWC, channels-last strides)."""
    import torch.nn.functional as F

    x = frame.permute(2, 0, 1).unsqueeze(0).float()  # NCHW over HWC memory: channels-last
    y = F.interpolate(x, size=tuple(target_hw), mode="bicubic", antialias=True, align_corners=False)
    return y.round_().clamp_(0, 255).to(frame.dtype)[0].permute(1, 2, 0)


PATCH_ORDER = (0, 3, 1, 4, 6, 2, 5)
"""The permutation of ``patch_grid_shape`` that puts an image's pixels in the HF row order."""


def patch_grid_shape(height: int, width: int, spec: VisionSpec, channels: int = 3) -> tuple[int, ...]:
    """An HWC image's shape split into [gh/m, m, P, gw/m, m, P, C]: what ``PATCH_ORDER`` permutes."""
    p, m = spec.patch_size, spec.merge_size
    return height // p // m, m, p, width // p // m, m, p, channels


def _patch_view(image, spec: VisionSpec):
    """HWC image -> a strided view [gh/m, gw/m, m, m, C, P, P] in the HF processor's row order:
    merge windows row-major, the m x m patches of a window consecutive, then channel-major patch
    pixels. Numpy arrays and torch tensors (on any device)."""
    height, width, channels = image.shape
    x = image.reshape(patch_grid_shape(height, width, spec, channels))
    return x.transpose(PATCH_ORDER) if isinstance(x, np.ndarray) else x.permute(PATCH_ORDER)


def patchify(image, spec: VisionSpec):
    """uint8 HWC image (sides multiples of patch*merge) -> uint8 [h*w, 3*P*P] in the HF row order."""
    x = _patch_view(image, spec)
    x = np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x.contiguous()
    return x.reshape(-1, spec.patch_dim)


def _images(rows, spec: VisionSpec, grid_thw):
    """(first row, row count, HWC image view) of each image in concatenated ``pixel_rows``."""
    p, first = spec.patch_size, 0
    for t, gh, gw in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3).tolist():
        if t != 1:
            raise ValueError(f"grid {t, gh, gw}: pixel rows carry one frame per image (t == 1)")
        yield first, gh * gw, rows[first:first + gh * gw].reshape(gh * p, gw * p, 3)
        first += gh * gw
    if first != rows.shape[0]:
        raise ValueError(f"image_grid_thw covers {first} rows of {rows.shape[0]}")


def _normalization(spec: VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (scale, shift) with x_norm = x_uint8 * scale - shift, shaped [1, 3, 1, 1]."""
    mean = np.asarray(spec.image_mean, dtype=np.float32)
    std = np.asarray(spec.image_std, dtype=np.float32)
    return (1.0 / (255.0 * std)).reshape(1, 3, 1, 1), (mean / std).reshape(1, 3, 1, 1)


@functools.lru_cache(maxsize=16)
def _device_normalization(spec: VisionSpec, device):
    """(scale, -shift) as float32 [3] on ``device``. Cached: building these per call is a blocking
    host-to-device copy on every batch."""
    import torch

    scale, shift = _normalization(spec)
    return torch.as_tensor(scale.reshape(3), device=device), torch.as_tensor(-shift.reshape(3), device=device)


def normalize_into(out, pixels, spec: VisionSpec, channel_dim: int) -> None:
    """``out = pixels * scale - shift`` per channel in one kernel: uint8 in, ``out``'s dtype out,
    float32 arithmetic. ``pixels`` may be any strided view (a patchify permutation of an image), so
    patchify, normalize and the cast to bfloat16 cost one pass with no float32 intermediate."""
    import torch

    scale, neg_shift = _device_normalization(spec, out.device)
    shape = [1] * out.dim()
    shape[channel_dim] = 3
    torch.addcmul(neg_shift.view(shape), pixels, scale.view(shape), out=out)


def repeat_frames(values, spec: VisionSpec) -> None:
    """Copy frame 0 of ``values`` [N, 3, T, P*P] onto frames 1..T-1: a still image's frames are equal."""
    if spec.temporal_patch_size > 1:
        values[:, :, 1:] = values[:, :, :1]


def to_pixel_values(rows, spec: VisionSpec, grid_thw, dtype=None, frames_hw=None):
    """Concatenated ``pixel_rows`` of the images in ``grid_thw`` -> normalized float ``pixel_values``
    [N, 3*T*P*P] in the HF row order, frames repeated like HF. With ``frames_hw``, the images
    whose rows hold a frame of another size are resized first (``finish_resize``).

    Numpy in, numpy out (float32 unless ``dtype``); a torch tensor in, a tensor out on its device.
    On a GPU with Triton one kernel launch reads every image's patch permutation in place,
    normalizes, casts and writes all frames (``fused_pixel_values``); elsewhere
    ``torch_pixel_values``.
    """
    rows = finish_resize(rows, spec, grid_thw, frames_hw)
    n = rows.shape[0]
    if isinstance(rows, np.ndarray):
        patches = np.empty_like(rows)
        for first, count, image in _images(rows, spec, grid_thw):
            view = _patch_view(image, spec)
            np.copyto(patches[first:first + count].reshape(view.shape), view)
        out = _normalized_frames(patches, spec).reshape(n, spec.pixel_values_dim)
        return out if dtype is None else out.astype(dtype)
    import torch

    if rows.is_cuda and fused_kernel_usable(rows.device):
        return fused_pixel_values(rows, spec, grid_thw, dtype or torch.float32)
    return torch_pixel_values(rows, spec, grid_thw, dtype)


def fused_pixel_values(rows, spec: VisionSpec, grid_thw, dtype, video: bool = False):
    """``to_pixel_values`` (or, with ``video``, ``video.to_video_pixel_values``) of a uint8 torch
    tensor of raster rows in one Triton kernel launch (``datasvc.media.triton_pixel_values``)."""
    from datasvc.media import triton_pixel_values

    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if not video and (grids[:, 0] != 1).any():
        raise ValueError(f"grids {grids[grids[:, 0] != 1].tolist()}: pixel rows carry one frame per image (t == 1)")
    if (grids[:, 1:] % spec.merge_size).any():
        raise ValueError(f"grids {grids.tolist()} are not whole merge windows of {spec.merge_size}")
    frames = spec.temporal_patch_size if video else 1
    if (covered := int((grids[:, 0] * frames * grids[:, 1] * grids[:, 2]).sum())) != rows.shape[0]:
        raise ValueError(f"{'video' if video else 'image'}_grid_thw covers {covered} rows of {rows.shape[0]}")
    scale, neg_shift = _device_normalization(spec, rows.device)
    return triton_pixel_values.pixel_values(rows, grids, patch_size=spec.patch_size, merge_size=spec.merge_size,
                                            temporal_patch_size=spec.temporal_patch_size, scale=scale,
                                            neg_shift=neg_shift, dtype=dtype, video=video)


@functools.lru_cache(maxsize=None)
def fused_kernel_usable(device) -> bool:
    """Whether the fused kernel imports, compiles and gives ``torch_pixel_values``' result on
    ``device``, for still images and for videos (a video whose frames all equal an image must give
    that image's values): checked once per device on a small batch. When not (no Triton, no C
    compiler for its launcher, an unsupported GPU), a warning says why and ``to_pixel_values`` and
    ``video.to_video_pixel_values`` take torch's path."""
    import torch

    spec, grids = VisionSpec(), [(1, 2, 4), (1, 4, 2)]
    rows = torch.arange(16 * spec.patch_dim, device=device).remainder(251).to(torch.uint8).view(16, -1)
    try:
        still = fused_pixel_values(rows, spec, grids, torch.float32)
        frames = torch.cat([rows[:8]] * spec.temporal_patch_size + [rows[8:]] * spec.temporal_patch_size)
        video = fused_pixel_values(frames, spec, grids, torch.float32, video=True)
        ok = (torch.allclose(still, torch_pixel_values(rows, spec, grids, torch.float32), atol=1e-6)
              and torch.equal(video, still))
        reason = "" if ok else "its values differ from the torch path's"
    except Exception as exc:  # ImportError, a compiler or driver error: each means the torch path
        ok, reason = False, f"{type(exc).__name__}: {exc}"[:300]
    if not ok:
        warnings.warn(f"pixel_values on {device} without the fused Triton kernel ({reason}); "
                      "the torch path gives the same values, slower", RuntimeWarning, stacklevel=3)
    return ok


def torch_pixel_values(rows, spec: VisionSpec, grid_thw, dtype=None):
    """``to_pixel_values`` of a torch tensor in torch alone: one strided normalize per image, then
    one copy of frame 0 onto the others (the path with no Triton, and on the CPU)."""
    import torch

    n, pp = rows.shape[0], spec.patch_size * spec.patch_size
    values = torch.empty((n, 3, spec.temporal_patch_size, pp), dtype=dtype or torch.float32, device=rows.device)
    for first, count, image in _images(rows, spec, grid_thw):
        view = _patch_view(image, spec)
        frame0 = values[first:first + count, :, 0].view(view.shape)
        normalize_into(frame0, view, spec, channel_dim=4)
    repeat_frames(values, spec)
    return values.view(n, spec.pixel_values_dim)


def _normalized_frames(patches: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """uint8 patches [N, 3*P*P] -> float32 [N, 3, T, P*P]: one table lookup per byte (OpenCV's SIMD
    LUT) straight to float32, then one broadcast write of every frame. About 1.4x the cost of
    filling the output on one core; numpy's cast, scale and repeat took 3-4x."""
    import cv2

    n, pp = patches.shape[0], spec.patch_size * spec.patch_size
    scale, shift = (a.reshape(3) for a in _normalization(spec))
    levels = np.arange(256, dtype=np.float32)
    x = patches.reshape(n, 3, pp)
    out = np.empty((n, 3, spec.temporal_patch_size, pp), np.float32)
    if n == 0:
        return out
    if np.all(scale == scale[0]) and np.all(shift == shift[0]):
        out[:] = cv2.LUT(x.reshape(n * 3, pp), levels * scale[0] - shift[0]).reshape(n, 3, 1, pp)
    else:
        for c in range(3):
            out[:, c] = cv2.LUT(np.ascontiguousarray(x[:, c]), levels * scale[c] - shift[c]).reshape(n, 1, pp)
    return out

"""``vision.to_pixel_values`` (and ``video.to_video_pixel_values``) as one Triton kernel: raster
uint8 pixel rows of many images in, normalized ``pixel_values`` in the HF patch order out, every
temporal frame written in the same pass.

The torch path takes one strided ``addcmul`` per image and one frame copy for the whole batch; on a
chunk of 64 decoded images that is 65 launches and the output written twice. Here each program
reads ``ROWS`` patches of one image where they lie in the raster (the patch permutation is only
address arithmetic) and writes their rows once per frame. The programs of a launch are listed in a
small table (image, first patch), so images of any mix of sizes cost one launch.

``vision.fused_pixel_values`` is its entry point for images, ``video.to_video_pixel_values`` for
videos; ``TRITON_INTERPRET=1`` (set before the first
import of triton) runs the same kernel on CPU tensors, which is how the tests check it without a GPU.
"""
from __future__ import annotations

import functools

import numpy as np

ROWS = 16  # patches per program, a [ROWS, P*P] tile per channel: 16 ran 1.6x faster than 8, 1.2x than 32 (H200)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def pixel_values_kernel(src, dst, images, blocks, scale, neg_shift,
                            P: tl.constexpr, PP_BLOCK: tl.constexpr, M: tl.constexpr, T: tl.constexpr,
                            STILL: tl.constexpr, ROWS: tl.constexpr):
        # images: int64 [n, 5] = (first byte in src, first output row, width in patches, output rows,
        #                         patches per frame); a still image's one frame fills all T slots,
        #                         a video's T consecutive frames fill them (``STILL`` False).
        # blocks: int64 [programs, 2] = (image, its first output row in this program)
        pid = tl.program_id(0)
        image = tl.load(blocks + pid * 2)
        first = tl.load(blocks + pid * 2 + 1)
        src_base = tl.load(images + image * 5)
        row0 = tl.load(images + image * 5 + 1)
        gw = tl.load(images + image * 5 + 2)
        count = tl.load(images + image * 5 + 3)
        per_frame = tl.load(images + image * 5 + 4)

        k = first + tl.arange(0, ROWS)[:, None]  # the output row of this image, in HF row order
        yx = tl.arange(0, PP_BLOCK)[None, :]  # the pixel inside a patch, raster order
        mask = (k < count) & (yx < P * P)
        group, patch = k // per_frame, k % per_frame  # temporal group; patch in its frames
        window, inside = patch // (M * M), patch % (M * M)
        py = (window // (gw // M)) * M + inside // M
        px = (window % (gw // M)) * M + inside % M
        pixel = (py * P + yx // P) * (gw * P) + px * P + yx % P  # index in one frame's raster
        frame_bytes = per_frame * (3 * P * P)
        out_row = (row0 + k) * (3 * T * P * P) + yx
        for c in tl.static_range(3):
            if STILL:
                v = tl.load(src + src_base + pixel * 3 + c, mask=mask).to(tl.float32)
                v = tl.fma(v, tl.load(scale + c), tl.load(neg_shift + c)).to(dst.dtype.element_ty)
                for t in tl.static_range(T):
                    tl.store(dst + out_row + (c * T + t) * (P * P), v, mask=mask)
            else:
                for t in tl.static_range(T):
                    at = src + src_base + (group * T + t) * frame_bytes + pixel * 3 + c
                    v = tl.fma(tl.load(at, mask=mask).to(tl.float32), tl.load(scale + c), tl.load(neg_shift + c))
                    tl.store(dst + out_row + (c * T + t) * (P * P), v.to(dst.dtype.element_ty), mask=mask)

    return pixel_values_kernel


def _tables(grids: np.ndarray, patch_dim: int, frames_per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Per image (first byte, first output row, width in patches, output rows, patches per frame)
    and per program (image, first output row) for ``grids`` [n, 3] (t, h, w) of concatenated raster
    rows, ``frames_per_row`` frames of them per output row (1 for still images)."""
    t, gh, gw = grids[:, 0], grids[:, 1], grids[:, 2]
    per_frame = gh * gw
    counts = t * per_frame
    first_rows = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    images = np.stack([first_rows * frames_per_row * patch_dim, first_rows, gw, counts, per_frame],
                      axis=1).astype(np.int64)
    per_image = -(-counts // ROWS)
    image_of_block = np.repeat(np.arange(len(grids)), per_image)
    first_block = np.concatenate([[0], np.cumsum(per_image)[:-1]])
    first = (np.arange(len(image_of_block)) - first_block[image_of_block]) * ROWS
    return images, np.stack([image_of_block, first], axis=1).astype(np.int64)


def pixel_values(rows, grids: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int,
                 scale, neg_shift, dtype, video: bool = False):
    """uint8 raster pixel rows [N, 3*P*P] of the images of ``grids`` [n, 3] (whole merge windows,
    covering the rows: the caller checks) -> a new tensor of ``dtype`` with ``rows * scale +
    neg_shift`` per channel (float32 [3] each, on the rows' device) in the HF patch order, from one
    kernel launch. Still images (t == 1, one frame each) give [N, T*3*P*P], every frame slot the
    same; ``video`` rows hold t*T frames per grid, frame after frame, and give [N/T, T*3*P*P]."""
    import torch
    import triton

    frames = temporal_patch_size if video else 1
    n, p = rows.shape[0] // frames, patch_size
    values = torch.empty((n, temporal_patch_size * rows.shape[1]), dtype=dtype, device=rows.device)
    if n == 0:
        return values
    images, blocks = _tables(grids, rows.shape[1], frames)
    # One small host-to-device copy for both tables; the launch queues behind it on the stream.
    table = torch.from_numpy(np.concatenate([images.ravel(), blocks.ravel()])).to(rows.device, non_blocking=True)
    _kernel()[(len(blocks),)](rows.contiguous(), values, table[:images.size], table[images.size:], scale, neg_shift,
                              P=p, PP_BLOCK=triton.next_power_of_2(p * p), M=merge_size,
                              T=temporal_patch_size, STILL=not video, ROWS=ROWS, num_warps=4)
    return values

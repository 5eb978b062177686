"""What flows between stages: one encoded sample, one packed micro-batch, and that micro-batch as a rank
trains on it (``TrainBatch``).

Arrays are numpy so they cross the Ray object store without copies. Images travel as uint8 pixels,
one temporal frame, in raster order, in rows of 768 bytes (one patch's worth): resized to their grid
(``vision.pixel_rows``), or as the decoded frame whose last resize the rank makes
(``vision.FrameRows``; ``image_frame_hw`` says which). The client turns them into the model's float
``pixel_values`` [N, C*T*P*P] in patch order late, on the rank (see ``datasvc.service.client``). That saves
8x in object-store traffic over float32 with both frames, and leaves the resize and the patch
permutation to the rank's GPU, where they cost microseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: this module's users need not have it
    import torch

IGNORE_INDEX = -100
_NO_VIDEO_ROWS = np.zeros((0, 0), np.uint8)
_NO_GRIDS = np.zeros((0, 3), np.int64)


def grid_patches(grid_thw: np.ndarray) -> int:
    return int(np.prod(np.asarray(grid_thw, np.int64).reshape(-1, 3), axis=1).sum())


@dataclass(slots=True)
class EncodedSample:
    """One sample after decode, preprocess and tokenize, before packing."""

    key: str
    shard: str
    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L], already shifted: labels[i] is the target for position i
    # uint8 [k, 3*P*P] blocks whose concatenation holds each image's ``vision.pixel_rows`` in turn
    # (an array stands for one block). Blocks may be views of a decoder's buffer: packing copies
    # each once, into its micro-batch.
    pixel_blocks: tuple[np.ndarray, ...] | np.ndarray
    image_grid_thw: np.ndarray  # int64 [n_images, 3]
    # int64 [n_images, 2]: the (h, w) of the frame each image's rows hold, when some hold a decoded
    # frame the consumer resizes to its grid's size (``vision.FrameRows``); None: all at that size.
    image_frame_hw: np.ndarray | None = None
    # Videos: uint8 [sum(t*T*h*w), 3*P*P], each video's frames (padded to the temporal patch T) one
    # after the other in raster order (``datasvc.media.video.frames_to_rows``); grids [n_videos, 3].
    video_pixels: np.ndarray = field(default_factory=lambda: _NO_VIDEO_ROWS)
    video_grid_thw: np.ndarray = field(default_factory=lambda: _NO_GRIDS)
    # The epoch it was drawn for and its ordinal in the plan (``WorkItem``), set by the producer.
    epoch: int = 0
    ordinal: int = -1
    # Blocks it has waited for a fuller row in the current chain (``pack.epoch.MAX_WAITS``), counted
    # by the producer.
    waited: int = 0

    def __post_init__(self):
        if isinstance(self.pixel_blocks, np.ndarray):
            self.pixel_blocks = (self.pixel_blocks,)

    @property
    def pixels(self) -> np.ndarray:
        """The sample's rows in one array (a copy when they travel in several blocks)."""
        blocks = self.pixel_blocks
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_patches(self) -> int:
        return grid_patches(self.image_grid_thw)

    @property
    def num_video_patches(self) -> int:
        """Patches the vision encoder sees for this sample's videos (t*h*w each)."""
        return grid_patches(self.video_grid_thw)

    @property
    def vision_patches(self) -> int:
        return self.num_patches + self.num_video_patches


@dataclass(slots=True)
class PackedBatch:
    """One micro-batch: B rows of S tokens, several samples per row.

    Row r holds ``num_samples[r]`` samples; sample j of row r spans tokens
    ``cu_seqlens[r, j] : cu_seqlens[r, j + 1]``; tokens past ``cu_seqlens[r, num_samples[r]]``
    are padding (pad id, label -100, loss_mask 0). Images appear in ``pixels``/``image_grid_thw``
    in the order their pad spans appear in ``tokens`` read row-major.
    """

    tokens: np.ndarray  # int64 [B, S]
    labels: np.ndarray  # int64 [B, S], -100 where not supervised
    loss_mask: np.ndarray  # float32 [B, S]
    cu_seqlens: np.ndarray  # int32 [B, K+1], K = max samples per row; unused tail repeats the end
    num_samples: np.ndarray  # int32 [B]
    pixels: np.ndarray  # uint8 [N, 3*P*P]: each image's ``vision.pixel_rows`` in turn
    image_grid_thw: np.ndarray  # int64 [n_images, 3]
    image_frame_hw: np.ndarray | None = None  # as EncodedSample's, over all images
    sample_keys: list[str] = field(default_factory=list)  # "shard/key", in row-major order
    sample_rows: np.ndarray | None = None  # int32 [n_samples]: the row each key sits in
    video_pixels: np.ndarray = field(default_factory=lambda: _NO_VIDEO_ROWS)  # as EncodedSample's, in turn
    video_grid_thw: np.ndarray = field(default_factory=lambda: _NO_GRIDS)  # int64 [n_videos, 3]
    # int64 [n_samples] each, row-major as sample_keys: the epoch each sample was drawn for and its
    # ordinal in the plan; what a rank records as trained (``datasvc.remainder.TrainedSamples``).
    sample_epochs: np.ndarray | None = None
    sample_ordinals: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    @property
    def real_tokens(self) -> int:
        return int(self.cu_seqlens[np.arange(len(self.num_samples)), self.num_samples].sum())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens, self.labels, self.loss_mask, self.cu_seqlens,
                                      self.num_samples, self.pixels, self.image_grid_thw,
                                      self.video_pixels, self.video_grid_thw) + (self.image_frame_hw,)
                   if a is not None)

    def sample_spans(self) -> list[tuple[int, int, int]]:
        """(row, start, end) of every sample, row-major; the trainer builds THD params from these."""
        spans = []
        for r, n in enumerate(self.num_samples.tolist()):
            for j in range(n):
                spans.append((r, int(self.cu_seqlens[r, j]), int(self.cu_seqlens[r, j + 1])))
        return spans


# eq=False: a batch is compared by identity, as a tensor has no single truth value to compare fields by.
@dataclass(kw_only=True, slots=True, eq=False)
class TrainBatch:
    """One micro-batch as a rank trains on it: ``PackedBatch``'s rows as torch tensors, on the rank's
    device, with the model's float ``pixel_values`` in the client's ``pixel_dtype``
    (``datasvc.stream.tensors.batch_tensors`` makes it; ``DataClient`` yields it). Both trainer
    backends and the benches' peer data paths take this type. ``as_dict()`` gives the fields as a
    dict, for code that wants one."""

    tokens: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S], already shifted; -100 where not supervised
    loss_mask: torch.Tensor  # float32 [B, S]
    cu_seqlens: torch.Tensor  # int32 [B, K+1], K = max samples per row; the unused tail repeats the end
    num_samples: torch.Tensor  # int32 [B]
    pixel_values: torch.Tensor  # pixel_dtype [N, C*T*P*P] in patch order, N = the images' t*h*w summed
    image_grid_thw: torch.Tensor  # int64 [n_images, 3]
    sample_keys: list[str] = field(default_factory=list)  # "shard/key", in row-major order
    sample_epochs: list[int] = field(default_factory=list)  # the epoch each sample was drawn for, as sample_keys
    pixel_values_videos: torch.Tensor | None = None  # pixel_dtype [sum(t*h*w), C*T*P*P]; None without videos
    video_grid_thw: torch.Tensor | None = None  # int64 [n_videos, 3]; None without videos

    @property
    def has_images(self) -> bool:
        return self.image_grid_thw is not None and self.image_grid_thw.shape[0] > 0

    @property
    def has_videos(self) -> bool:
        return self.video_grid_thw is not None and self.video_grid_thw.shape[0] > 0

    @property
    def vision_patches(self) -> int:
        """Vision patches, images and videos: the tower's input size. The grids may be numpy arrays
        or torch tensors on any device."""
        grids = (self.image_grid_thw, self.video_grid_thw)
        return sum(int(g.prod(-1).sum()) for g in grids if g is not None and g.shape[0])

    @property
    def vision_patches_sq(self) -> int:
        """Sum over the tower's attention units of their patches squared: the tower attends within
        each image, and within each temporal group of a video (``t`` units of ``h * w`` patches)."""
        grids = (self.image_grid_thw, self.video_grid_thw)
        return sum(int((g[:, 0] * (g[:, 1] * g[:, 2]) ** 2).sum()) for g in grids if g is not None and g.shape[0])

    @property
    def sample_tokens_sq(self) -> int:
        """Sum over the samples of their tokens squared (the decoder attends per sample). The
        boundaries may be numpy arrays or torch tensors on any device."""
        cu, counts = (np.asarray(x.cpu() if hasattr(x, "cpu") else x, dtype=np.int64)
                      for x in (self.cu_seqlens, self.num_samples))
        return int(sum((np.diff(cu[r, :n + 1]) ** 2).sum() for r, n in enumerate(counts)))

    def to(self, device, *, non_blocking: bool = False) -> TrainBatch:
        """The batch with its tensors on ``device``, dtypes kept; the key and epoch lists are shared."""
        import torch

        return TrainBatch(**{name: value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor)
                             else value for name, value in self._items()})

    def as_dict(self) -> dict:
        """The fields by name, the video ones left out when the batch holds none (their None is no value
        to hand on)."""
        return {name: value for name, value in self._items() if value is not None}

    def _items(self):
        return ((f.name, getattr(self, f.name)) for f in fields(self))

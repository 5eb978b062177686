"""The decoded ChatML of each packed row, as ``vlmfeed inspect`` writes it (``text-NNNNN.txt``).

Each sample in a row is the tokenizer's decode of its tokens, with two marks:

- an image's run of pad tokens collapses to ``<image HxW = N tokens>`` (H x W its patch grid, N its
  pads, t*H*W / merge**2), and a video's run for temporal group g of G to ``<video g/G HxW = N
  tokens>``; a run whose length disagrees with its grid says so (``<image HxW: R tokens, grid says N>``);
- the tokens the loss does not train are wrapped in ``[[...]]``: a token is trained when the label
  one position back (labels are shifted: ``labels[i]`` is the target at ``i``) is not -100.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datasvc.batch import IGNORE_INDEX

LEGEND = ("[[...]]: not trained (label -100); <image HxW = N tokens>: an image's pad run, grid H x W patches; "
          "<video g/G HxW = N tokens>: temporal group g of a video's G")
_TEXT, _TRAINED, _IMAGE, _VIDEO = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class VisionTokenIds:
    image_pad: int
    video_pad: int | None  # None: the pipeline takes no video


def vision_token_ids(pipeline) -> VisionTokenIds:
    """The pad ids from the pipeline's own encoder: model facts stay in the model's package."""
    return VisionTokenIds(image_pad=pipeline.image_pad_id, video_pad=pipeline.video_pad_id)


@dataclass(frozen=True, slots=True)
class SampleText:
    key: str
    row: int
    start: int
    end: int
    vision_tokens: int  # pad tokens of its images and videos in the row
    trained_tokens: int
    body: str


class RowDecoder:
    """Decodes the rows of packed micro-batches, marking vision spans and untrained tokens."""

    def __init__(self, tokenizer, ids: VisionTokenIds, merge_size: int):
        self.tokenizer, self.ids, self.merge_size = tokenizer, ids, merge_size

    def micro_batch(self, arrays: dict[str, np.ndarray]) -> list[SampleText]:
        """Every sample of a ``packed_arrays`` micro-batch, row-major, as ``SampleText``."""
        images = iter(np.asarray(arrays["image_grid_thw"]).reshape(-1, 3).tolist())
        groups = iter(_video_groups(np.asarray(arrays["video_grid_thw"]).reshape(-1, 3)))
        keys = [str(k) for k in arrays["sample_keys"]]
        out, k = [], 0
        for row, count in enumerate(np.asarray(arrays["num_samples"]).tolist()):
            cu = arrays["cu_seqlens"][row]
            for j in range(count):
                start, end = int(cu[j]), int(cu[j + 1])
                tokens, labels = arrays["tokens"][row, start:end], arrays["labels"][row, start:end]
                trained = np.zeros(len(tokens), bool)
                trained[1:] = labels[:-1] != IGNORE_INDEX
                kinds = self._kinds(tokens, trained)
                out.append(SampleText(keys[k] if k < len(keys) else "?", row, start, end,
                                      int((kinds >= _IMAGE).sum()), int(trained.sum()),
                                      self._body(tokens, kinds, images, groups)))
                k += 1
        return out

    def _kinds(self, tokens: np.ndarray, trained: np.ndarray) -> np.ndarray:
        kinds = trained.astype(np.int8)
        kinds[tokens == self.ids.image_pad] = _IMAGE
        if self.ids.video_pad is not None:
            kinds[tokens == self.ids.video_pad] = _VIDEO
        return kinds

    def _body(self, tokens: np.ndarray, kinds: np.ndarray, images, groups) -> str:
        """The sample's text, pad runs collapsed and untrained stretches in [[...]]."""
        bounds = [0, *(np.flatnonzero(np.diff(kinds)) + 1).tolist(), len(tokens)]
        pieces: list[tuple[str, bool]] = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            kind = int(kinds[a])
            if kind == _IMAGE:
                pieces.append((self._image_marker(next(images, None), b - a), False))
            elif kind == _VIDEO:
                pieces.append((self._video_marker(next(groups, None), b - a), False))
            else:
                pieces.append((self.tokenizer.decode(tokens[a:b].tolist(), skip_special_tokens=False),
                               kind == _TRAINED))
        return _wrap_untrained(pieces)

    def _image_marker(self, grid, run: int) -> str:
        if grid is None:
            return f"<image ?: {run} tokens, no grid left>"
        t, h, w = grid
        expected = t * h * w // self.merge_size**2
        return _marker("image", f"{h}x{w}", run, expected)

    def _video_marker(self, group, run: int) -> str:
        if group is None:
            return f"<video ?: {run} tokens, no grid left>"
        g, count, h, w = group
        return _marker("video", f"{g}/{count} {h}x{w}", run, h * w // self.merge_size**2)


def _marker(kind: str, what: str, run: int, expected: int) -> str:
    if run == expected:
        return f"<{kind} {what} = {run} tokens>"
    return f"<{kind} {what}: {run} tokens, grid says {expected}>"


def _video_groups(grids: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(group number from 1, groups, h, w) of every temporal group of every video, in order."""
    return [(g + 1, t, h, w) for t, h, w in grids.tolist() for g in range(t)]


def _wrap_untrained(pieces: list[tuple[str, bool]]) -> str:
    out, open_span = [], False
    for text, trained in pieces:
        if not trained and not open_span:
            out.append("[[")
        elif trained and open_span:
            out.append("]]")
        open_span = not trained
        out.append(text)
    if open_span:
        out.append("]]")
    return "".join(out)


def micro_batch_text(name: str, position: dict, arrays: dict[str, np.ndarray], samples: list[SampleText]) -> str:
    """The whole ``text-NNNNN.txt`` of one micro-batch."""
    tokens = arrays["tokens"]
    lines = [f"# {name}: epoch {position['epoch']}, block {position['block']}, batch {position['batch']}, "
             f"step {position['step']}; {tokens.shape[0]} rows of {tokens.shape[1]} tokens",
             f"# {LEGEND}", ""]
    for row, count in enumerate(np.asarray(arrays["num_samples"]).tolist()):
        used = int(arrays["cu_seqlens"][row, count])
        lines.append(f"== row {row}: {count} samples, {used} tokens, {tokens.shape[1] - used} padding ==")
        for s in (s for s in samples if s.row == row):
            lines += [sample_heading(s), s.body, ""]
    return "\n".join(lines)


def sample_heading(s: SampleText) -> str:
    return (f"-- {s.key} (tokens {s.start}-{s.end}: {s.vision_tokens} vision, "
            f"{s.end - s.start - s.vision_tokens} text; {s.trained_tokens} trained)")


def preview(samples: list[SampleText], count: int = 2, max_chars: int = 400) -> str:
    """The first samples' text, each cut to ``max_chars``: what stdout shows."""
    parts = []
    for s in samples[:count]:
        body = s.body if len(s.body) <= max_chars else s.body[:max_chars] + f" ... ({len(s.body) - max_chars} more chars)"
        parts.append(f"{sample_heading(s)}\n{body}")
    return "\n".join(parts)

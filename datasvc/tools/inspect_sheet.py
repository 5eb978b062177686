"""Contact sheets: the images and video frames one packed micro-batch carries, as thumbnails.

``vlmfeed inspect`` draws one per micro-batch (``sheet-NNNNN.png``): each image, and a few frames of
each video, at most ``TILE`` pixels a side, labelled with its sample key, row, grid (t x h x w) and
vision tokens. A sheet holds at most ``MAX_TILES`` tiles, so it stays a few hundred KB whatever the
micro-batch holds; its title says how many were left off.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 160
COLUMNS = 6
MAX_TILES = 24
FRAMES_PER_VIDEO = 4
LINE_HEIGHT = 13
LABEL_LINES = 3
MARGIN = 6
TITLE_HEIGHT = 2 * LINE_HEIGHT
CELL_WIDTH = TILE + MARGIN
MIN_WIDTH = 720  # room for the title line
CELL_HEIGHT = TILE + LABEL_LINES * LINE_HEIGHT + MARGIN


@dataclass(frozen=True, slots=True)
class Tile:
    image: np.ndarray  # uint8 HWC at its grid's size
    lines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SheetLayout:
    tiles: int  # tiles the micro-batch gives
    shown: int  # tiles drawn (at most MAX_TILES)
    columns: int
    rows: int
    width: int
    height: int


def micro_batch_tiles(arrays: dict[str, np.ndarray], merge_size: int) -> list[Tile]:
    """A tile per image and up to ``FRAMES_PER_VIDEO`` per video of a ``packed_arrays`` micro-batch,
    sample by sample in row order (a sample's images, then its videos)."""
    p, tps = int(arrays["patch_size"]), int(arrays["temporal_patch_size"])
    images = iter(_image_pixels(arrays, p))
    videos = iter(_video_frames(arrays, p, tps))
    tiles = []
    for k, name in enumerate(str(s) for s in arrays["sample_names"]):
        row = int(arrays["sample_rows"][k])
        for _ in range(int(arrays["sample_images"][k])):
            (t, h, w), image = next(images)
            tiles.append(Tile(image, (name, f"row {row} image {t}x{h}x{w}", f"{t * h * w // merge_size**2} tokens")))
        for _ in range(int(arrays["sample_videos"][k])):
            (t, h, w), frames = next(videos)
            for f in _spread(len(frames), FRAMES_PER_VIDEO):
                tiles.append(Tile(frames[f], (name, f"row {row} video {t}x{h}x{w}",
                                              f"frame {f + 1}/{len(frames)}, {t * h * w // merge_size**2} tokens")))
    return tiles


def _image_pixels(arrays: dict[str, np.ndarray], p: int):
    """(grid, HWC image) of each image, in order."""
    first = 0
    for t, h, w in arrays["image_grid_thw"].tolist():
        yield (t, h, w), arrays["image_pixels"][first:first + h * w].reshape(h * p, w * p, 3)
        first += h * w


def _video_frames(arrays: dict[str, np.ndarray], p: int, tps: int):
    """(grid, frames [t*T, H, W, 3]) of each video, in order."""
    first = 0
    for t, h, w in arrays["video_grid_thw"].tolist():
        count = t * tps * h * w
        yield (t, h, w), arrays["video_pixels"][first:first + count].reshape(t * tps, h * p, w * p, 3)
        first += count


def _spread(count: int, most: int) -> list[int]:
    """Up to ``most`` indices spread evenly over ``count``, first and last included."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def draw_sheet(tiles: list[Tile], path: str, title: str) -> SheetLayout:
    """Draw ``tiles`` on one PNG at ``path``; the layout drawn."""
    from PIL import Image, ImageDraw, ImageFont

    layout = sheet_layout(len(tiles))
    shown = tiles[:layout.shown]
    sheet = Image.new("RGB", (layout.width, layout.height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    left_off = len(tiles) - len(shown)
    draw.text((MARGIN, 4), title + (f"; {left_off} more tiles not shown" if left_off else ""), fill=(0, 0, 0), font=font)
    if not shown:
        draw.text((MARGIN, TITLE_HEIGHT), "no images or videos in this micro-batch", fill=(96, 96, 96), font=font)
    for i, tile in enumerate(shown):
        x = MARGIN + (i % layout.columns) * CELL_WIDTH
        y = TITLE_HEIGHT + MARGIN + (i // layout.columns) * CELL_HEIGHT
        thumb = Image.fromarray(np.ascontiguousarray(tile.image))
        thumb.thumbnail((TILE, TILE))
        sheet.paste(thumb, (x + (TILE - thumb.width) // 2, y + (TILE - thumb.height) // 2))
        for n, line in enumerate(tile.lines[:LABEL_LINES]):
            draw.text((x, y + TILE + 2 + n * LINE_HEIGHT), _fit(line, font, TILE), fill=(0, 0, 0), font=font)
    sheet.save(path, optimize=True)
    return layout


def sheet_layout(tiles: int) -> SheetLayout:
    """Where ``tiles`` tiles go: at most ``MAX_TILES`` drawn, ``COLUMNS`` a line."""
    shown = min(tiles, MAX_TILES)
    columns = max(1, min(COLUMNS, shown))
    rows = max(1, -(-shown // columns))
    return SheetLayout(tiles, shown, columns, rows, max(MIN_WIDTH, MARGIN + columns * CELL_WIDTH),
                       TITLE_HEIGHT + MARGIN + rows * CELL_HEIGHT)


def _fit(text: str, font, width: int) -> str:
    """``text`` cut from the left to ``width`` pixels: a key's end tells samples apart."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength("..." + text) > width:
        text = text[1:]
    return "..." + text

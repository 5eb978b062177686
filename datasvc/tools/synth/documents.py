"""Synthetic document pages and UI screenshots: rendered text, tables, charts and thumbnails."""
from __future__ import annotations


import cv2
import numpy as np

from datasvc.tools.synth.images import _compose, _hsv_to_rgb, _photo_layers, _uniform_noise
from datasvc.tools.synth.text import _ADJ, _CONJ, _DET, _NOUN, _PREP, _VERB, _zipf_pick

_FONTS = [cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX,
          cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_PLAIN]
_DOC_WORDS = _NOUN + _ADJ + _VERB + _PREP + _DET + _CONJ + ["of", "to", "for", "by", "from", "is", "are", "was"]


class _Font:
    """A Hershey font sized to a target line height in pixels."""

    def __init__(self, face: int, px: float, bold: bool = False):
        (_, h0), base0 = cv2.getTextSize("Hg", face, 1.0, 1)
        self.face = face
        self.scale = max(0.25, px / (h0 + base0))
        self.thick = max(1, int(round(self.scale * (1.6 if bold else 0.9))))
        (cw, ch), base = cv2.getTextSize("abcdefghijklmnopqrstuvwxyz", face, self.scale, self.thick)
        self.char_w = cw / 26.0
        self.asc = ch
        self.line_h = int((ch + base) * 1.45) + 1

    def put(self, img: np.ndarray, text: str, x: int, y: int, color) -> None:
        cv2.putText(img, text, (int(x), int(y)), self.face, self.scale, color, self.thick, cv2.LINE_AA)


def _text_line(rng: np.random.Generator, n_chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < n_chars:
        r = rng.random()
        wd = (f"{rng.integers(0, 10000)}" if r < 0.06 else
              _zipf_pick(rng, _DOC_WORDS) + ("," if r > 0.95 else ""))
        if not words or rng.random() < 0.08:
            wd = wd.capitalize()
        words.append(wd)
        length += len(wd) + 1
    return " ".join(words)[: max(1, n_chars)]


def _paragraph(rng, img, font: _Font, x0: int, x1: int, y: int, y_max: int, n_lines: int, color) -> int:
    chars = max(4, int((x1 - x0) / font.char_w))
    for i in range(n_lines):
        if y + font.line_h > y_max:
            break
        last = i == n_lines - 1
        font.put(img, _text_line(rng, int(chars * (rng.uniform(0.3, 0.9) if last else rng.uniform(0.92, 1.0)))),
                 x0, y + font.asc, color)
        y += font.line_h
    return y


def _figure(rng, img, x0: int, y0: int, x1: int, y1: int) -> None:
    bw, bh = x1 - x0, y1 - y0
    if bw < 16 or bh < 16:
        return
    if rng.random() < 0.5:   # a photo
        base, det = _photo_layers(rng, bw, bh)
        img[y0:y1, x0:x1] = _compose(base, det, rng.uniform(0.5, 1.2))
    else:                    # a bar/line chart
        cv2.rectangle(img, (x0, y0), (x1 - 1, y1 - 1), (90, 90, 90), 1)
        n = int(rng.integers(4, 16))
        vals = rng.uniform(0.1, 0.95, n)
        colr = tuple(int(c) for c in _hsv_to_rgb(np.array([[rng.uniform(0, 360), 0.6, 0.8]]))[0])
        bar_w = bw / (n * 1.5)
        for i, v in enumerate(vals):
            bx = x0 + (i * 1.5 + 0.5) * bar_w
            cv2.rectangle(img, (int(bx), int(y1 - v * bh)), (int(bx + bar_w), y1 - 2), colr, -1)
        for gy in np.linspace(y0, y1, 5)[1:-1]:
            cv2.line(img, (x0, int(gy)), (x1, int(gy)), (200, 200, 200), 1)


def _table(rng, img, font: _Font, x0: int, x1: int, y: int, y_max: int, color) -> int:
    rows, cols = int(rng.integers(3, 10)), int(rng.integers(2, 6))
    row_h = font.line_h + 6
    rows = min(rows, max(0, (y_max - y) // row_h))
    if rows < 2:
        return y
    cw = (x1 - x0) / cols
    chars = max(2, int(cw / font.char_w) - 2)
    for r in range(rows + 1):
        cv2.line(img, (x0, y + r * row_h), (x1, y + r * row_h), (120, 120, 120), 1)
    for c in range(cols + 1):
        cv2.line(img, (int(x0 + c * cw), y), (int(x0 + c * cw), y + rows * row_h), (120, 120, 120), 1)
    for r in range(rows):
        for c in range(cols):
            txt = _text_line(rng, chars) if (c == 0 or r == 0) else f"{rng.uniform(0, 1000):.{int(rng.integers(0, 3))}f}"
            font.put(img, txt[:chars], x0 + c * cw + 4, y + r * row_h + 3 + font.asc, color)
    return y + rows * row_h + font.line_h


def _page(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A printed page: margins, headings, justified-ish paragraphs, tables, figures, lists."""
    paper = int(rng.integers(244, 256))
    img = np.full((h, w, 3), paper, np.uint8)
    ink = tuple(int(v) for v in rng.integers(0, 50, 3))
    mx, my = int(w * rng.uniform(0.06, 0.12)), int(h * rng.uniform(0.04, 0.08))
    face = _FONTS[int(rng.integers(len(_FONTS)))]
    body = _Font(face, float(np.clip(w * rng.uniform(0.011, 0.018), 8, 90)))
    head = _Font(face, body.line_h * rng.uniform(1.1, 1.7), bold=True)
    ncol = 2 if (w > 900 and rng.random() < 0.35) else 1
    gap = int(w * 0.04)
    col_w = (w - 2 * mx - (ncol - 1) * gap) // ncol
    for c in range(ncol):
        x0 = mx + c * (col_w + gap)
        x1 = x0 + col_w
        y = my
        while y < h - my - body.line_h:
            r = rng.random()
            if r < 0.12:
                head.put(img, _text_line(rng, int(rng.integers(10, 40)))[: int(col_w / head.char_w)], x0, y + head.asc, ink)
                y += int(head.line_h * 1.4)
            elif r < 0.20:
                y = _table(rng, img, body, x0, x1, y, h - my, ink)
            elif r < 0.27:
                fh = int(h * rng.uniform(0.1, 0.3))
                if y + fh < h - my:
                    _figure(rng, img, x0, y, x1, y + fh)
                y += fh + body.line_h
            elif r < 0.35:
                for _ in range(int(rng.integers(2, 7))):
                    if y + body.line_h > h - my:
                        break
                    cv2.circle(img, (x0 + body.line_h // 3, y + body.asc // 2), max(1, body.asc // 5), ink, -1, cv2.LINE_AA)
                    body.put(img, _text_line(rng, int(col_w / body.char_w * rng.uniform(0.3, 0.9))), x0 + body.line_h, y + body.asc, ink)
                    y += body.line_h
                y += body.line_h // 2
            else:
                y = _paragraph(rng, img, body, x0, x1, y, h - my, int(rng.integers(2, 14)), ink) + body.line_h // 2
    return img


def _screenshot(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """An app/web UI: top bar, optional sidebar, cards with text, buttons and thumbnails."""
    dark = rng.random() < 0.3
    bg = int(rng.integers(28, 42)) if dark else int(rng.integers(238, 252))
    fg = (225, 225, 225) if dark else tuple(int(v) for v in rng.integers(20, 60, 3))
    card = bg + (12 if dark else 5)
    card = min(card, 255)
    accent = tuple(int(c) for c in _hsv_to_rgb(np.array([[rng.uniform(0, 360), rng.uniform(0.5, 0.9), rng.uniform(0.6, 0.9)]]))[0])
    img = np.full((h, w, 3), bg, np.uint8)
    face = _FONTS[int(rng.integers(0, 2))]  # UI text: sans faces
    body = _Font(face, float(np.clip(min(w, h) * rng.uniform(0.018, 0.03), 9, 80)))
    head = _Font(face, body.line_h * 1.3, bold=True)
    bar_h = int(h * rng.uniform(0.04, 0.08)) if h > w else int(h * rng.uniform(0.06, 0.1))
    cv2.rectangle(img, (0, 0), (w, bar_h), accent, -1)
    head.put(img, _text_line(rng, int(rng.integers(8, 24))), body.line_h, (bar_h + head.asc) // 2, (255, 255, 255))
    x0 = int(w * 0.03)
    if w > h and rng.random() < 0.6:
        sb = int(w * rng.uniform(0.15, 0.22))
        cv2.rectangle(img, (0, bar_h), (sb, h), (bg + 8 if dark else bg - 10,) * 3, -1)
        y = bar_h + body.line_h
        while y < h - body.line_h:
            cv2.circle(img, (body.line_h, y + body.asc // 2), max(2, body.asc // 2), accent, -1, cv2.LINE_AA)
            body.put(img, _text_line(rng, int(rng.integers(5, 16)))[: int((sb - 2 * body.line_h) / body.char_w)], 2 * body.line_h, y + body.asc, fg)
            y += int(body.line_h * rng.uniform(1.5, 2.2))
        x0 = sb + int(w * 0.02)
    x1 = w - int(w * 0.03)
    y = bar_h + int(h * 0.02)
    while y < h - 3 * body.line_h:
        ch = int(min(h - y - body.line_h, h * rng.uniform(0.08, 0.3)))
        cv2.rectangle(img, (x0, y), (x1, y + ch), (card,) * 3, -1)
        cv2.rectangle(img, (x0, y), (x1, y + ch), (bg - 25 if not dark else bg + 25,) * 3, 1)
        tx = x0 + body.line_h
        if ch > 4 * body.line_h and rng.random() < 0.4:   # thumbnail
            tw = int(min(ch - body.line_h, (x1 - x0) * 0.35))
            _figure(rng, img, tx, y + body.line_h // 2, tx + tw, y + body.line_h // 2 + tw if tw < ch - body.line_h else y + ch - body.line_h // 2)
            tx += tw + body.line_h
        yy = y + body.line_h // 2
        head.put(img, _text_line(rng, int(rng.integers(8, 30)))[: max(1, int((x1 - tx) / head.char_w) - 1)], tx, yy + head.asc, fg)
        yy += head.line_h
        yy = _paragraph(rng, img, body, tx, x1 - body.line_h, yy, y + ch - 2 * body.line_h, int(rng.integers(1, 6)), fg)
        if rng.random() < 0.5 and yy + body.line_h * 1.5 < y + ch:
            bw = int(body.char_w * rng.integers(6, 14)) + body.line_h
            cv2.rectangle(img, (tx, yy), (tx + bw, yy + int(body.line_h * 1.3)), accent, -1)
            body.put(img, _text_line(rng, int(rng.integers(3, 10))), tx + body.line_h // 2, yy + body.asc + body.line_h // 6, (255, 255, 255))
        y += ch + int(body.line_h * rng.uniform(0.5, 1.5))
    return img


def _document_image(rng: np.random.Generator, w: int, h: int, scanned: bool) -> np.ndarray:
    img = _page(rng, w, h) if rng.random() < 0.55 else _screenshot(rng, w, h)
    if scanned:  # a scan or phone photo of a page: soft, noisy, uneven paper
        img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.5, 1.0))
        noise = _uniform_noise(rng, h, w) * rng.uniform(2, 5)
        img = cv2.add(img.astype(np.float32), cv2.merge([noise, noise, noise]), dtype=cv2.CV_8U)
    return img



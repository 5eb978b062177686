"""What each member of a sample is to it, from its extension alone (``k.jpg``: an image; ``k.txt``:
the caption; ``k.001.txt``: text under a longer extension, which the reader names rather than
drops), so that the reader, the budgets and the tools sort members one way. Members are anything
with ``ext`` (lower-cased, after the key) and ``size``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

IMAGE_EXTS = ("jpg", "jpeg", "jpe", "jfif", "png", "apng", "webp", "gif", "bmp", "tif", "tiff")
# Images and videos this service does not decode: the sample is rejected rather than trained
# without them as text alone.
UNDECODED_MEDIA_EXTS = ("heic", "heif", "avif", "jxl", "jp2", "j2k", "jpx", "svg", "ico", "tga", "psd", "pbm",
                        "pgm", "ppm", "pnm", "dng", "cr2", "nef", "arw", "exr", "hdr", "dds", "pcx", "eps", "xcf",
                        "avi", "m4v")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov")  # decoded by datasvc.media.video
MEDIA_EXTS = frozenset(IMAGE_EXTS + UNDECODED_MEDIA_EXTS + VIDEO_EXTS)
# Members that would execute code when unpickled: never loaded, always counted.
PICKLE_EXTS = ("pyd", "pickle", "pkl", "pth", "npy", "npz")


def image_order(ext: str) -> tuple:
    """Natural order of image members: ``2.jpg`` before ``10.jpg``, numbers before names; total for
    any mix of names (``jpg`` and ``0.jpg``), so sorting never fails."""
    return tuple((0, int(p), p) if p.isascii() and p.isdigit() else (1, 0, p) for p in ext.split("."))


@dataclass(slots=True)
class SampleMembers:
    """A sample's members by what they are to it."""

    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    text: object | None = None  # the k.txt member
    json: object | None = None  # the k.json member
    dotted_text: list = field(default_factory=list)  # text under a longer extension: 001.txt, jpg.txt
    unsupported: list = field(default_factory=list)  # media not decoded here: heic, jpg.gz
    ignored: list = field(default_factory=list)  # pickles, unknown extensions: never read

    @property
    def read(self) -> list:
        """The members a sample's reading loads: images, videos and its text."""
        return [*self.images, *self.videos, *(m for m in (self.text, self.json) if m is not None)]


def sort_members(members) -> SampleMembers:
    out = SampleMembers()
    for m in members:
        last = m.ext.rsplit(".", 1)[-1]
        if m.ext == "txt":
            out.text = m
        elif m.ext == "json":
            out.json = m
        elif last in ("txt", "json"):  # what the key rule makes of img.001.txt or k.jpg.txt
            out.dotted_text.append(m)
        elif last in IMAGE_EXTS:
            out.images.append(m)
        elif last in VIDEO_EXTS:
            out.videos.append(m)
        elif any(p in MEDIA_EXTS for p in m.ext.split(".")):  # .heic, .jpg.gz
            out.unsupported.append(m)
        else:
            out.ignored.append(m)
    return out


def encoded_bytes(members) -> int:
    """Encoded bytes that reading a sample holds: its images, videos and text, from its tar headers."""
    return sum(max(0, m.size) for m in sort_members(members).read)

"""``vlmfeed info``: what shards hold, from headers alone: counts, member formats, image sizes,
text and vision tokens as the service's header planner predicts them, and rejections by the
service's reasons; bad paths are one line."""
import json
import os
import struct
import zlib

import pytest

from datasvc.read.shards import index_shard
from datasvc.samples import encode_image, real_photos
from datasvc.tools.info import main
from datasvc.wire import WorkItem

MAX_PIXELS = 512 * 512


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` and which holds no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def write_shard(path, samples):
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return str(path)


@pytest.fixture(scope="module")
def photos():
    out = []
    for name, img, caption in real_photos()[:6]:
        rgb = img[..., :3] if img.ndim == 3 else img
        out.append((name, encode_image(rgb), caption, rgb.shape[1], rgb.shape[0]))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory, photos):
    """Two shards: four captioned photos and a two-image conversation; then a cut JPEG, a photo
    without text, and a PNG header declaring more pixels than the decode cap."""
    root = tmp_path_factory.mktemp("info")
    conversation = {"messages": [{"role": "user", "content": "<image>\n<image>\nWhat differs?"},
                                 {"role": "assistant", "content": "The second is brighter."}]}
    good = [{"__key__": name, "jpg": data, "txt": caption} for name, data, caption, _, _ in photos[:4]]
    good.append({"__key__": "pair", "0.jpg": photos[4][1], "1.jpg": photos[5][1],
                 "json": json.dumps(conversation).encode()})
    bad = [{"__key__": "cut", "jpg": photos[0][1][: len(photos[0][1]) // 2], "txt": "A cut photo."},
           {"__key__": "mute", "jpg": photos[1][1]},
           {"__key__": "bomb", "png": png_header_only(9000, 9000), "txt": "Too many pixels."}]
    return [write_shard(root / "a.tar", good), write_shard(root / "b.tar", bad)]


def run_info(capsys, *argv):
    capsys.readouterr()
    code = main([*map(str, argv), "--no-progress", "--max-pixels", str(MAX_PIXELS)])
    out, err = capsys.readouterr()
    return code, out, err


def test_counts_formats_sizes_and_rejections(shards, photos, tmp_path, capsys):
    code, out, err = run_info(capsys, *shards, "--json", tmp_path / "info.json")
    assert code == 0, err
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["shards"]["count"] == info["shards"]["read"] == 2
    assert info["samples"] == {"read": 8, "usable": 5, "rejected": 3, "skipped_by_rule": 0}
    assert info["rejected"] == {"truncated_image": 1, "missing_text": 1, "too_many_pixels": 1}
    assert {e["key"] for examples in info["examples"].values() for e in examples} == {"cut", "mute", "bomb"}
    assert info["members"] == {"jpg": 8, "txt": 6, "json": 1, "png": 1}
    assert info["shapes"] == {"one image": 4, "several images": 1}
    widths = sorted(w for _, _, _, w, _ in photos)
    assert info["measures"]["image_width"]["count"] == 6 and info["measures"]["image_width"]["max"] == widths[-1]
    assert info["measures"]["images_per_sample"]["max"] == 2
    assert info["pipeline"]["max_pixels"] == MAX_PIXELS
    for reason in info["rejected"]:  # the table names each reason and a sample it rejected
        assert reason in out
    assert "text tokens / sample" in out and "vision tokens / sample" in out and f"wrote {tmp_path / 'info.json'}" in out


def test_tokens_are_the_service_header_planners(shards, tmp_path, capsys):
    from datasvc.config import ServiceConfig
    from datasvc.pack.sizes import HeaderProcessor

    cfg = ServiceConfig(shards=tuple(shards), pipeline_options={"max_pixels": MAX_PIXELS})
    planner = HeaderProcessor(cfg)
    spec = planner.pipeline.vision
    planned = [s for path in shards for s in planner(WorkItem(path, 0, tuple(index_shard(path).samples))).samples]
    code, _, err = run_info(capsys, *shards, "--json", tmp_path / "info.json")
    assert code == 0, err
    measures = json.loads((tmp_path / "info.json").read_text())["measures"]
    tokens = sorted(s.num_tokens for s in planned)
    vision = sorted(sum(spec.vision_tokens(g) for g in s.image_grid_thw) for s in planned)
    assert measures["tokens"]["max"] == tokens[-1] and measures["vision_tokens"]["max"] == vision[-1]
    assert measures["tokens"]["count"] == len(planned) == 5
    text = sorted(s.num_tokens - v for s, v in zip(planned, (sum(spec.vision_tokens(g) for g in s.image_grid_thw)
                                                              for s in planned)))
    assert measures["text_tokens"]["max"] == text[-1] and measures["text_tokens"]["p50"] == text[2]


def test_limit_seq_len_and_a_directory(shards, tmp_path, capsys):
    code, out, err = run_info(capsys, *shards, "--limit", 3, "--json", tmp_path / "first.json")
    first = json.loads((tmp_path / "first.json").read_text())
    assert code == 0 and first["samples"]["read"] == 3 and first["shards"]["read"] == 1, err
    assert "1 of 2 read" in out and "(--limit 3)" in out
    code, _, err = run_info(capsys, os.path.dirname(shards[0]), "--seq-len", 100, "--json", tmp_path / "all.json")
    every = json.loads((tmp_path / "all.json").read_text())
    assert code == 0 and every["shards"]["count"] == 2, err
    assert every["samples"]["read"] == 8 and every["skipped_by_rule"]["longer_than_seq_len"] >= 1
    assert every["samples"]["usable"] == 5 - every["skipped_by_rule"]["longer_than_seq_len"]


def test_a_video_sample(tmp_path, photos, capsys):
    pytest.importorskip("av")
    import numpy as np

    from datasvc.media.video import plan_video
    from datasvc.registry import get_pipeline
    from datasvc.tools.synth.videos import VideoSpec, render_video

    clip = render_video(VideoSpec("h264/mp4", 320, 240, 10.0, 20, 0.08 * 320 * 240 * 10, 10),
                        np.random.default_rng(0))
    shard = write_shard(tmp_path / "video.tar", [{"__key__": "clip", "mp4": clip, "txt": "A camera pans."},
                                                 {"__key__": "photo", "jpg": photos[0][1], "txt": photos[0][2]}])
    code, out, err = run_info(capsys, shard, "--json", tmp_path / "info.json")
    info = json.loads((tmp_path / "info.json").read_text())
    assert code == 0 and info["samples"]["usable"] == 2, (err, info["rejected"])
    assert info["members"] == {"mp4": 1, "txt": 2, "jpg": 1}
    assert info["shapes"] == {"with video": 1, "one image": 1}
    assert info["measures"]["video_seconds"] == {"count": 1, "p50": 2.0, "p90": 2.0, "max": 2.0, "mean": 2.0}
    spec = get_pipeline("qwen3vl", max_pixels=MAX_PIXELS).vision
    video = spec.vision_tokens(plan_video(clip, spec, get_pipeline("qwen3vl").video).grid)
    photo = spec.vision_tokens(spec.grid(photos[0][4], photos[0][3]))
    vision = info["measures"]["vision_tokens"]  # two samples: their values are the max and 2 x mean - max
    assert sorted([vision["max"], 2 * vision["mean"] - vision["max"]]) == sorted([video, photo])


def test_bad_paths_are_one_line(tmp_path, shards, capsys):
    (tmp_path / "empty").mkdir()
    for argv in ([tmp_path / "missing.tar"], [tmp_path / "*.tar"], [tmp_path / "empty"],
                 [*shards, "--json", tmp_path / "nowhere" / "info.json"], [*shards, "--pipeline", "nosuch"]):
        code, out, err = run_info(capsys, *argv)
        assert code == 2 and out == "", (argv, out)
        assert len(err.strip().splitlines()) == 1 and err.startswith("vlmfeed info: ") and "Traceback" not in err


def test_registered_as_a_vlmfeed_subcommand():
    from datasvc.tools.cli import SUBCOMMANDS

    assert SUBCOMMANDS["info"][0] == "datasvc.tools.info"

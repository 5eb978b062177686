"""``vlmfeed inspect`` (``python -m datasvc.tools.inspect``) end to end, as a subprocess, on real photo
and video shards plus broken input: what it writes is what a rank receives, at the trainer's geometry."""
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest

from pipelines.qwen3vl import TOKENS, VIDEO_PAD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_PAD = TOKENS.image_pad


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from datasvc.samples import encode_image, real_photos, write_photo_shards

    d = tmp_path_factory.mktemp("inspect")
    paths = write_photo_shards(str(d / "photos"), samples_per_shard=12, copies=1)
    extra = str(d / "extra.tar")
    photo = real_photos()[1][1]  # chelsea
    with tarfile.open(extra, "w") as tar:
        _add(tar, "broken_jpeg.jpg", b"this is not a jpeg")  # one broken sample
        _add(tar, "broken_jpeg.txt", b"A caption for an image that cannot be decoded.")
        _add(tar, "nested/dir/cat.jpg", encode_image(photo))  # a key with '/' in it
        _add(tar, "nested/dir/cat.txt", b"A cat, in a nested key.")
        _add(tar, "long_caption.jpg", encode_image(photo))  # longer than --seq-len: skipped by rule
        _add(tar, "long_caption.txt", (" ".join(["word"] * 3000)).encode())
    return paths + [extra]


def _pan_clip(photo: np.ndarray, frames: int = 10, size: tuple[int, int] = (96, 128), fps: int = 4) -> bytes:
    """A VP9 WebM of a camera panning across a real photo (a codec the CPU decodes)."""
    av = pytest.importorskip("av")
    import cv2

    h, w = photo.shape[:2]
    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=fps)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"deadline": "realtime", "cpu-used": "8"}
        for k in range(frames):
            x = (w // 2) * k // (frames - 1)
            crop = np.ascontiguousarray(photo[:, x:x + w // 2, :3])
            frame = av.VideoFrame.from_ndarray(cv2.resize(crop, size[::-1]), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    """inspect over a shard of a photo, a 2.5 s clip and a second photo, at the CPU trainer's geometry."""
    from datasvc.samples import encode_image, real_photos

    photos = {name: image for name, image, _ in real_photos()}
    d = tmp_path_factory.mktemp("inspect-video")
    shard = str(d / "video.tar")
    with tarfile.open(shard, "w") as tar:
        _add(tar, "cat.jpg", encode_image(photos["chelsea"]))
        _add(tar, "cat.txt", b"A cat.")
        _add(tar, "pan.webm", _pan_clip(photos["astronaut"]))
        _add(tar, "pan.txt", b"A camera pans across an astronaut.")
        _add(tar, "rocket.jpg", encode_image(photos["rocket"]))
        _add(tar, "rocket.txt", b"A rocket on its launch pad.")
    out = d / "out"
    proc = run_inspect([shard, "--out", str(out), "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text()), proc


def run_inspect(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "datasvc.tools.inspect", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _sample_spans(z):
    """(key, row, start, end) of every sample of a packed micro-batch, row-major."""
    keys, spans = [str(k) for k in z["sample_keys"]], []
    for row, count in enumerate(z["num_samples"].tolist()):
        for j in range(count):
            spans.append((keys[len(spans)], row, int(z["cu_seqlens"][row, j]), int(z["cu_seqlens"][row, j + 1])))
    return spans


def test_a_default_run_is_small_and_at_the_trainers_geometry(shards, tmp_path):
    """No flags: the geometry trainer.run trains with on this machine, 16 samples, a few MB."""
    import torch

    from datasvc.training import DEVICE_DEFAULTS

    device = "gpu" if torch.cuda.is_available() else "cpu"
    out = tmp_path / "out"
    proc = run_inspect([*shards, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    g = summary["geometry"]
    assert g["device"] == device and g["built_by"] == "datasvc.training.training_config"
    assert g["seq_len"] == DEVICE_DEFAULTS[device].seq_len and g["max_pixels"] == DEVICE_DEFAULTS[device].max_pixels
    assert g["micro_batch_size"] == 1 and g["chain_blocks"] == 4 and g["items_per_block"] >= 1
    assert f"device {device}" in proc.stdout and f"seq_len {g['seq_len']}" in proc.stdout

    # --limit 16 by default: whole micro-batches up to the one that brings the rank's samples to 16.
    a = summary["accounting"]
    assert summary["limit"] == 16 and summary["stopped_at_limit"] and summary["balanced"]
    assert 16 <= a["delivered"] < a["read"] and a["in_flight"] > 0
    packed = sorted(out.glob("packed-*.npz"))
    assert len(packed) == summary["packing"]["micro_batches"] >= 1
    assert len(list(out.glob("sheet-*.png"))) == len(list(out.glob("text-*.txt"))) == len(packed)
    assert not (out / "samples").exists()

    # Every grid within the device's pixel cap: a 1411x1411 photo is 16x16 patches (64 tokens) on the CPU path.
    cap = DEVICE_DEFAULTS[device].max_pixels
    delivered = [r for r in summary["samples"] if r["status"] == "ok"]
    assert all(h * w * 16 * 16 <= cap for r in delivered for _, h, w in r["grids"])
    if device == "cpu":
        retina = next(r for r in delivered if "1411x1411" in r["image_sizes"])
        assert retina["grids"][retina["image_sizes"].index("1411x1411")] == [1, 16, 16]

    # Compact: deflated arrays, pixels as uint8, a few MB in all; the closing line says so.
    on_disk = sum(p.stat().st_size for p in out.iterdir())
    if device == "cpu":
        assert on_disk < 6 * 2**20, on_disk
    with zipfile.ZipFile(packed[0]) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}
    z = np.load(packed[0])
    assert z["image_pixels"].dtype == np.uint8 and "pixel_values" not in z.files
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out}/ (") and "MB on disk" in last and "packed-*.npz" in last
    assert "decoded text, first samples" in proc.stdout and "<image " in proc.stdout


def test_inspect_end_to_end(shards, tmp_path):
    out = tmp_path / "out"
    proc = run_inspect([*shards, "--out", str(out), "--all", "--device", "cpu", "--seq-len", "2048", "--mbs", "2",
                        "--max-pixels", str(512 * 512)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    from datasvc.tools.inspect_arrays import rank_fields

    summary = json.loads((out / "summary.json").read_text())
    rows = {r["key"]: r for r in summary["samples"]}
    by_full_key = {f"{r['shard']}/{r['key']}": r for r in summary["samples"]}
    n_photo = 24  # 21 captioned photos + 3 two-image conversations
    assert len(rows) == n_photo + 3 and summary["geometry"]["seq_len"] == 2048
    assert summary["vision"]["max_pixels"] == 512 * 512 and not summary["stopped_at_limit"]

    # The table names every sample, with the broken one's reason.
    assert "broken_jpeg" in proc.stdout and "undecodable_image" in proc.stdout
    assert "astronaut_000" in proc.stdout and "512x512" in proc.stdout
    assert rows["broken_jpeg"]["status"] == "rejected" and rows["broken_jpeg"]["reason"] == "undecodable_image"
    assert rows["long_caption"]["reason"] == "longer_than_seq_len"

    # Accounting holds and the quarantine log records (shard, key, reason).
    a = summary["accounting"]
    assert a["read"] == n_photo + 3 and a["in_flight"] == 0 and summary["balanced"]
    assert a["read"] == a["delivered"] + sum(a["quarantined"].values()) + sum(a["skipped_by_rule"].values())
    assert a["quarantined"] == {"undecodable_image": 1} and a["skipped_by_rule"] == {"longer_than_seq_len": 1}
    log = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert {(e["key"], e["reason"]) for e in log} == {("broken_jpeg", "undecodable_image"),
                                                       ("long_caption", "longer_than_seq_len")}
    assert all(e["shard"].endswith("extra.tar") for e in log)

    # Packed micro-batches: every delivered sample exactly once, the contract's arrays and shapes; each
    # sample's table row names its file and row, and its vision tokens are its pads there.
    packed = sorted(out.glob("packed-*.npz"))
    p = summary["packing"]
    assert len(packed) == p["micro_batches"] >= 1
    keys = []
    for f in packed:
        z = rank_fields(str(f))
        grid = z["image_grid_thw"]
        assert z["tokens"].shape == z["labels"].shape == z["loss_mask"].shape == (2, 2048)
        assert z["pixel_values"].shape == (int(grid.prod(axis=1).sum()), 1536)
        assert z["pixel_values"].dtype == np.float32
        assert -1.0 - 1e-6 <= z["pixel_values"].min() and z["pixel_values"].max() <= 1.0 + 1e-6
        assert int((z["tokens"] == IMAGE_PAD).sum()) == int(grid.prod(axis=1).sum()) // 4
        assert z["cu_seqlens"].shape[0] == 2 and z["num_samples"].shape == (2,)
        for key, row, start, end in _sample_spans(z):
            r = by_full_key[key]
            assert r["file"] == f.name and r["row"] == row and r["tokens"] == end - start
            assert r["vision_tokens"] == int((z["tokens"][row, start:end] == IMAGE_PAD).sum())
            assert r["text_tokens"] + r["vision_tokens"] == r["tokens"]
        keys.extend(str(k) for k in z["sample_keys"])
    assert len(keys) == len(set(keys)) == a["delivered"] == n_photo + 1
    assert not any(k.endswith("/long_caption") or k.endswith("/broken_jpeg") for k in keys)
    assert len(rows["pair_coffee_rocket_000"]["grids"]) == 2
    assert p["packing_efficiency"] > p["padding_efficiency"] > 0
    assert p["image_tokens"] == sum(r["vision_tokens"] for r in rows.values() if r["status"] == "ok")
    assert "packing efficiency" in proc.stdout


def test_video_fields_and_tokens_are_what_the_row_holds(video_run):
    """A video sample's pixel_values_videos and video_grid_thw are in the file, and its vision tokens
    in the table and the summary are the video pads its packed row holds."""
    from datasvc.tools.inspect_arrays import rank_fields

    out, summary, proc = video_run
    rows = {r["key"]: r for r in summary["samples"]}
    pan = rows["pan"]
    (t, h, w), = pan["video_grids"]
    assert t >= 2 and pan["video_tokens"] == t * h * w // 4 > 0
    assert pan["vision_tokens"] == pan["video_tokens"] and pan["image_tokens"] == 0
    assert pan["video_sizes"] == ["128x96 10f@4"]

    (packed,) = sorted(out.glob("packed-*.npz"))
    z = rank_fields(str(packed))
    assert z["video_grid_thw"].tolist() == [[t, h, w]]
    assert z["video_pixels"].dtype == np.uint8 and z["video_pixels"].shape == (t * 2 * h * w, 768)
    assert z["pixel_values_videos"].shape == (t * h * w, 1536) and z["pixel_values_videos"].dtype == np.float32
    spans = {key.rsplit("/", 1)[-1]: (row, start, end) for key, row, start, end in _sample_spans(z)}
    row, start, end = spans["pan"]
    assert int((z["tokens"][row, start:end] == VIDEO_PAD).sum()) == pan["vision_tokens"]
    for key in ("cat", "rocket"):
        row, start, end = spans[key]
        assert int((z["tokens"][row, start:end] == IMAGE_PAD).sum()) == rows[key]["vision_tokens"] > 0

    (record,) = summary["packing"]["micro_batch_files"]
    assert record["video_tokens"] == summary["packing"]["video_tokens"] == pan["vision_tokens"]
    assert record["image_tokens"] == rows["cat"]["vision_tokens"] + rows["rocket"]["vision_tokens"]
    assert record["fields"]["pixel_values_videos"] == [[t * h * w, 1536], "float32"]
    assert record["fields"]["video_grid_thw"] == [[1, 3], "int64"]
    assert f"{pan['video_tokens']} video" in proc.stdout


def test_the_contact_sheet_shows_each_image_and_a_few_frames_of_each_video(video_run):
    from PIL import Image

    from datasvc.tools.inspect_sheet import FRAMES_PER_VIDEO, sheet_layout

    out, summary, _ = video_run
    (record,) = summary["packing"]["micro_batch_files"]
    t = summary["samples"][[r["key"] for r in summary["samples"]].index("pan")]["video_grids"][0][0]
    expected_tiles = 2 + min(FRAMES_PER_VIDEO, 2 * t)  # two photos, frames of the one video
    assert record["sheet_tiles"] == record["sheet_tiles_shown"] == expected_tiles
    with Image.open(out / record["sheet"]) as im:
        layout = sheet_layout(expected_tiles)
        assert im.format == "PNG" and im.size == (layout.width, layout.height)
        assert layout.columns * layout.rows >= expected_tiles > layout.columns * (layout.rows - 1)
        assert (out / record["sheet"]).stat().st_size < 1 << 20


def test_a_sheet_stays_bounded_however_many_images(tmp_path):
    from PIL import Image

    from datasvc.tools.inspect_sheet import MAX_TILES, Tile, draw_sheet

    tiles = [Tile(np.full((64, 96, 3), i * 7 % 255, np.uint8), (f"key_{i}", "row 0 image 1x4x6", "6 tokens"))
             for i in range(MAX_TILES + 5)]
    layout = draw_sheet(tiles, str(tmp_path / "sheet.png"), "many")
    assert layout.tiles == MAX_TILES + 5 and layout.shown == MAX_TILES
    with Image.open(tmp_path / "sheet.png") as im:
        assert im.size == (layout.width, layout.height)


def test_the_text_marks_each_image_span_with_its_grid_and_the_untrained_spans(video_run):
    out, summary, proc = video_run
    text = (out / "text-00000.txt").read_text()
    rows = {r["key"]: r for r in summary["samples"]}
    for key in ("cat", "rocket"):
        (_, h, w), = rows[key]["grids"]
        assert f"<|vision_start|><image {h}x{w} = {h * w // 4} tokens><|vision_end|>" in text
    (t, h, w), = rows["pan"]["video_grids"]
    for g in range(1, t + 1):
        assert f"<video {g}/{t} {h}x{w} = {h * w // 4} tokens>" in text
    assert "<|image_pad|>" not in text and "<|video_pad|>" not in text
    # Captions are trained; the prompt around them is not.
    assert "]]A cat.<|im_end|>[[" in text and "[[<|im_start|>user" in text
    assert "-- " in proc.stdout and "[[<|im_start|>user" in proc.stdout


def test_inspect_without_packing_and_bad_pattern(shards, tmp_path):
    out = tmp_path / "out2"
    proc = run_inspect([shards[0], "--out", str(out), "--no-pack", "--all", "--max-pixels", str(256 * 256)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(out.glob("packed-*.npz"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["packing"] is None and summary["accounting"]["delivered"] == 12 and summary["balanced"]
    assert (out / "quarantine.jsonl").read_text() == ""
    files = sorted(p.name for p in (out / "samples").glob("*.npz"))
    assert len(files) == 12 and all(r["file"] == f"samples/{r['key']}.npz" for r in summary["samples"])
    z = np.load(out / "samples" / "astronaut_000.npz")
    grid = z["image_grid_thw"]
    assert z["image_pixels"].dtype == np.uint8 and z["image_pixels"].shape == (int(grid.prod(axis=1).sum()), 768)
    assert int((z["input_ids"] == IMAGE_PAD).sum()) == int(grid.prod(axis=1).sum()) // 4

    proc = run_inspect([str(tmp_path / "missing-*.tar"), "--out", str(tmp_path / "x")])
    assert proc.returncode == 2 and "no shard files match" in proc.stderr


@pytest.mark.parametrize("args, says", [
    (["{missing}", "--out", "{out}"], "no such file"),
    (["{shard}", "--out", "{out}", "--dp-size", "2", "--rank", "2"], "--rank 2 must be in [0, --dp-size 2)"),
    (["{shard}", "--out", "{out}", "--limit", "-1"], "--limit must be >= 0"),
])
def test_mistakes_exit_2_with_one_line(shards, tmp_path, args, says):
    filled = [a.format(missing=str(tmp_path / "nope.tar"), out=str(tmp_path / "o"), shard=shards[0]) for a in args]
    proc = run_inspect(filled, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_inspect_writes_what_each_rank_receives(shards, tmp_path):
    """The packed files are the rank's stream from the feeder's own producer at trainer.run's
    geometry, in delivery order with their positions, pixels and all; two ranks get disjoint samples."""
    from datasvc.media.vision import to_pixel_values
    from datasvc.stream.producer import BlockProducer
    from datasvc.tools.inspect import InspectConfig, service_config
    from datasvc.tools.inspect_arrays import rank_fields

    args = ["--all", "--device", "cpu", "--seq-len", "2048", "--mbs", "2", "--max-pixels", str(256 * 256), "--data-seed", "3"]
    keys, files = {}, {}
    for rank in (0, 1):
        out = tmp_path / f"rank{rank}"
        proc = run_inspect([*shards, "--out", str(out), "--dp-size", "2", "--rank", str(rank), *args])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"rank {rank} of 2 receives" in proc.stdout
        files[rank] = sorted(out.glob("packed-*.npz"))
        packed = [np.load(f) for f in files[rank]]
        keys[rank] = [str(k) for z in packed for k in z["sample_keys"]]
        steps = [int(z["position"][3]) for z in packed]
        assert steps == list(range(len(packed)))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["balanced"] and summary["packing"]["dp_size"] == 2
        assert [p["step"] for p in summary["packing"]["positions"]] == steps
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])

    # Rank 1's files hold exactly what its feeder's producer yields, in the same order, and their
    # uint8 pixels rebuild the very pixel_values the rank computes.
    config = InspectConfig(device="cpu", seq_len=2048, micro_batch_size=2, dp_size=2, rank=1, seed=3,
                           max_pixels=256 * 256)
    cfg, _ = service_config(sorted(shards), config)
    assert cfg.epochs == 1 and cfg.chain_blocks == 4 and cfg.blocks_span_epochs
    stream = list(BlockProducer(cfg, 1).micro_batches())
    assert [k for b, _ in stream for k in b.sample_keys] == keys[1]
    from datasvc.registry import get_layout

    spec = get_layout(cfg.pipeline, **cfg.pipeline_options).vision
    for (batch, _), path in zip(stream, files[1]):
        expected = to_pixel_values(batch.pixels, spec, batch.image_grid_thw, frames_hw=batch.image_frame_hw)
        np.testing.assert_array_equal(rank_fields(str(path))["pixel_values"], expected)

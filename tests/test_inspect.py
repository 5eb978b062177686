"""``vlmfeed inspect`` (``python -m datasvc.tools.inspect``) end to end, as a subprocess, on real photo shards plus broken input."""
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from pipelines.qwen3vl import TOKENS

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


def run_inspect(args, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "datasvc.tools.inspect", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_inspect_end_to_end(shards, tmp_path):
    out = tmp_path / "out"
    proc = run_inspect([*shards, "--pipeline", "qwen3vl", "--out", str(out), "--seq-len", "2048", "--mbs", "2",
                        "--max-pixels", str(512 * 512)])
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    rows = {r["key"]: r for r in summary["samples"]}
    n_photo = 24  # 21 captioned photos + 3 two-image conversations
    assert len(rows) == n_photo + 3

    # The table names every sample, with the broken one's reason.
    assert "broken_jpeg" in proc.stdout and "undecodable_image" in proc.stdout
    assert "astronaut_000" in proc.stdout and "512x512" in proc.stdout
    assert rows["broken_jpeg"]["status"] == "rejected" and rows["broken_jpeg"]["reason"] == "undecodable_image"
    assert rows["long_caption"]["reason"] == "longer_than_seq_len"

    # Accounting holds and the quarantine log records (shard, key, reason).
    a = summary["accounting"]
    assert a["read"] == n_photo + 3
    assert a["read"] == a["delivered"] + sum(a["quarantined"].values()) + sum(a["skipped_by_rule"].values())
    assert a["quarantined"] == {"undecodable_image": 1} and a["skipped_by_rule"] == {"longer_than_seq_len": 1}
    log = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert {(e["key"], e["reason"]) for e in log} == {("broken_jpeg", "undecodable_image"),
                                                       ("long_caption", "longer_than_seq_len")}
    assert all(e["shard"].endswith("extra.tar") for e in log)

    # Per-sample .npz: everything that decoded (the too-long one too: it is skipped only at packing).
    files = sorted(p.name for p in out.glob("*.npz") if not p.name.startswith("packed-"))
    assert len(files) == n_photo + 2
    assert "nested__dir__cat.npz" in files and not (out / "nested").exists()
    for name in ("astronaut_000.npz", "pair_coffee_rocket_000.npz", "nested__dir__cat.npz"):
        z = np.load(out / name)
        grid = z["image_grid_thw"]
        assert grid.ndim == 2 and grid.shape[1] == 3
        assert z["pixel_values"].shape == (int(grid.prod(axis=1).sum()), 1536)
        assert z["pixel_values"].dtype == np.float32
        assert -1.0 - 1e-6 <= z["pixel_values"].min() and z["pixel_values"].max() <= 1.0 + 1e-6
        assert z["input_ids"].shape == z["labels"].shape
        assert int((z["input_ids"] == IMAGE_PAD).sum()) == int(grid.prod(axis=1).sum()) // 4
        assert (z["labels"] != -100).any()
        r = rows[str(z["key"])]
        assert r["vision_tokens"] == int(grid.prod(axis=1).sum()) // 4
        assert r["text_tokens"] + r["vision_tokens"] == len(z["input_ids"])
    assert len(rows["pair_coffee_rocket_000"]["grids"]) == 2

    # Packed micro-batches: every delivered sample exactly once, the contract's arrays and shapes.
    packed = sorted(out.glob("packed-*.npz"))
    p = summary["packing"]
    assert len(packed) == p["micro_batches"] >= 1
    keys = []
    for f in packed:
        z = np.load(f)
        assert z["tokens"].shape == z["labels"].shape == z["loss_mask"].shape == (2, 2048)
        assert z["pixel_values"].shape == (int(z["image_grid_thw"].prod(axis=1).sum()), 1536)
        assert int((z["tokens"] == IMAGE_PAD).sum()) == int(z["image_grid_thw"].prod(axis=1).sum()) // 4
        assert z["cu_seqlens"].shape[0] == 2 and z["num_samples"].shape == (2,)
        keys.extend(str(k) for k in z["sample_keys"])
    assert len(keys) == len(set(keys)) == a["delivered"] == n_photo + 1
    assert not any(k.endswith("/long_caption") or k.endswith("/broken_jpeg") for k in keys)
    assert p["packing_efficiency"] > p["padding_efficiency"] > 0
    assert "packing efficiency" in proc.stdout


def test_inspect_without_packing_and_bad_pattern(shards, tmp_path):
    out = tmp_path / "out2"
    proc = run_inspect([shards[0], "--out", str(out), "--max-pixels", str(256 * 256)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(out.glob("packed-*.npz"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["packing"] is None and summary["accounting"]["delivered"] == 12
    assert (out / "quarantine.jsonl").read_text() == ""

    proc = run_inspect([str(tmp_path / "missing-*.tar"), "--out", str(tmp_path / "x")])
    assert proc.returncode == 2 and "no shard files match" in proc.stderr


def test_inspect_writes_what_each_rank_receives(shards, tmp_path):
    """The packed files are the rank's stream from the feeder's own producer, in delivery order with
    their positions; two ranks get disjoint samples that together make one rank's epoch."""
    from datasvc.producer import BlockProducer
    from datasvc.tools.inspect import _data_config

    args = ["--seq-len", "2048", "--mbs", "2", "--max-pixels", str(256 * 256), "--seed", "3"]
    keys = {}
    for rank in (0, 1):
        out = tmp_path / f"rank{rank}"
        proc = run_inspect([*shards, "--out", str(out), "--dp-size", "2", "--rank", str(rank), *args])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"rank {rank} of 2 receives" in proc.stdout
        packed = [np.load(f) for f in sorted(out.glob("packed-*.npz"))]
        keys[rank] = [str(k) for z in packed for k in z["sample_keys"]]
        steps = [int(z["position"][3]) for z in packed]
        assert steps == list(range(len(packed)))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["balanced"] and summary["packing"]["dp_size"] == 2
        assert [p["step"] for p in summary["packing"]["positions"]] == steps
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])

    # Rank 1's files hold exactly what its feeder's producer yields, in the same order.
    cfg = _data_config(sorted(shards), "qwen3vl", {"max_pixels": 256 * 256}, "cpu", 2048, 2, 2, 3)
    assert [k for b, _ in BlockProducer(cfg, 1).micro_batches() for k in b.sample_keys] == keys[1]

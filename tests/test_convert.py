"""``vlmfeed convert``: Parquet in the Hugging Face datasets layout and LLaVA JSON + image folder ->
WebDataset shards, byte for byte, sized by bytes, resumable; the service reads what it writes."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from datasvc.process import WorkItem, process_item
from datasvc.samples import encode_image, real_photos
from datasvc.shards import ReadLimits, index_shard, read_samples
from datasvc.tools.convert import PROGRESS, LlavaSource, ParquetSource, convert, main, parse_bytes


@pytest.fixture(scope="module")
def photos():
    out = []
    for name, img, caption in real_photos()[:9]:
        rgb = img[..., :3] if img.ndim == 3 else img
        out.append((name, encode_image(rgb, "png" if name == "coffee" else "jpg", quality=80), caption))
    return out


def read_back(out_dir):
    samples = {}
    for path in sorted(p for p in os.listdir(out_dir) if p.endswith(".tar")):
        full = os.path.join(out_dir, path)
        for raw in read_samples(full, index_shard(full).samples, ReadLimits()):
            assert not raw.problem, (raw.key, raw.problem)
            samples[raw.key] = raw
    return samples


@pytest.fixture(scope="module")
def caption_parquet(tmp_path_factory, photos):
    """Two Parquet files as ``datasets`` writes them: an Image feature, a caption, a metadata column."""
    from datasets import Dataset, Features, Image, Value

    root = tmp_path_factory.mktemp("parquet")
    features = Features({"image": Image(), "text": Value("string"), "similarity": Value("float64")})
    rows = [{"image": {"bytes": data, "path": None}, "text": caption, "similarity": 0.25 + 0.01 * i}
            for i, (_, data, caption) in enumerate(photos)]
    for part, chunk in enumerate((rows[:5], rows[5:])):
        ds = Dataset.from_list(chunk, features=features)
        os.makedirs(root / "data", exist_ok=True)
        ds.to_parquet(str(root / "data" / f"train-{part:05d}-of-00002.parquet"))
    return str(root / "data"), rows


def test_parquet_round_trip_is_byte_exact_and_sized_by_bytes(caption_parquet, tmp_path, qwen3vl, cpu_decoder):
    src, rows = caption_parquet
    summary = convert(ParquetSource(sorted(os.path.join(src, f) for f in os.listdir(src))), str(tmp_path),
                      shard_bytes=400_000, progress=False)
    assert summary.samples == len(rows) and summary.shards >= 3 and not summary.skipped
    back = read_back(str(tmp_path))
    assert sorted(back) == [f"{i:09d}" for i in range(len(rows))]
    for i, row in enumerate(rows):
        raw = back[f"{i:09d}"]
        assert [d for _, d in raw.images] == [row["image"]["bytes"]]
        assert raw.text == row["text"] and raw.metadata == {"similarity": row["similarity"]}
    tars = sorted(p for p in os.listdir(tmp_path) if p.endswith(".tar"))
    sizes = [os.path.getsize(tmp_path / p) for p in tars]
    biggest_sample = max(len(r["image"]["bytes"]) for r in rows) + 4096
    assert all(s <= 400_000 + biggest_sample for s in sizes)
    idx = index_shard(str(tmp_path / tars[0]))  # and the service takes them as they are
    res = process_item(WorkItem(idx.path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
    assert len(res.samples) == len(idx.samples) and not res.accounting.quarantined


def test_parquet_messages_with_image_lists(tmp_path, photos, qwen3vl):
    from datasets import Dataset, Features, Image, List, Value

    features = Features({"images": List(Image()), "messages": List({
        "role": Value("string"), "content": List({"type": Value("string"), "text": Value("string")})})})
    rows = []
    for a, b in zip(photos[0:6:2], photos[1:6:2]):
        rows.append({"images": [{"bytes": a[1], "path": None}, {"bytes": b[1], "path": None}], "messages": [
            {"role": "user", "content": [{"type": "image", "text": None}, {"type": "image", "text": None},
                                         {"type": "text", "text": "What differs?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"{a[2]} / {b[2]}"}]}]})
    Dataset.from_list(rows, features=features).to_parquet(str(tmp_path / "vqa.parquet"))
    out = tmp_path / "out"
    assert main([str(tmp_path / "vqa.parquet"), "--out", str(out), "--quiet"]) == 0
    back = read_back(str(out))
    for i, row in enumerate(rows):
        raw = back[f"{i:09d}"]
        assert [d for _, d in raw.images] == [im["bytes"] for im in row["images"]]
        written = [{**m, "content": [{k: v for k, v in part.items() if v is not None} for part in m["content"]]}
                   for m in row["messages"]]  # Arrow's null fields of a struct are left out
        assert raw.conversation["messages"] == written
        ids, _ = qwen3vl.encode(raw, [(1, 2, 2), (1, 2, 4)])
        assert (ids == 151655).sum() == 3


def test_resume_keeps_intact_shards_and_rewrites_the_rest_identically(caption_parquet, tmp_path):
    src, rows = caption_parquet
    source = ParquetSource(sorted(os.path.join(src, f) for f in os.listdir(src)))
    convert(source, str(tmp_path), shard_bytes=300_000, progress=False)
    tars = sorted(p for p in os.listdir(tmp_path) if p.endswith(".tar"))
    digest = {p: hashlib.sha1((tmp_path / p).read_bytes()).hexdigest() for p in tars}
    first_mtime = os.stat(tmp_path / tars[0]).st_mtime_ns
    os.remove(tmp_path / tars[1])  # as if the run had died while writing it
    (tmp_path / "shard-000009.tar.tmp").write_bytes(b"partial")
    summary = convert(source, str(tmp_path), shard_bytes=300_000, progress=False)
    assert summary.kept_shards == 1 and summary.samples == len(rows)
    assert os.stat(tmp_path / tars[0]).st_mtime_ns == first_mtime
    assert sorted(p for p in os.listdir(tmp_path) if not p.startswith(".")) == tars
    assert {p: hashlib.sha1((tmp_path / p).read_bytes()).hexdigest() for p in tars} == digest
    again = convert(source, str(tmp_path), shard_bytes=300_000, progress=False)  # complete: nothing rewritten
    assert again.kept_shards == len(tars) and os.stat(tmp_path / tars[0]).st_mtime_ns == first_mtime
    with pytest.raises(SystemExit, match="another conversion"):
        convert(source, str(tmp_path), shard_bytes=100_000, progress=False)
    assert json.loads((tmp_path / PROGRESS).read_text())["complete"]


def test_llava_json_with_an_image_folder(tmp_path, photos, qwen3vl):
    images = tmp_path / "images" / "coco"
    images.mkdir(parents=True)
    for name, data, _ in photos[:4]:
        (images / f"{name}.{'png' if data.startswith(b'\x89PNG') else 'jpg'}").write_bytes(data)
    files = sorted(os.listdir(images))
    entries = [
        {"id": "a", "image": f"coco/{files[0]}", "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A photo."}]},
        {"id": "b", "image": [f"coco/{files[1]}", f"coco/{files[2]}"], "conversations": [
            {"from": "human", "value": "<image> vs <image>"}, {"from": "gpt", "value": "Different."}]},
        {"id": "c", "image": "coco/missing.jpg", "conversations": [
            {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "?"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
    ]
    (tmp_path / "llava.json").write_text(json.dumps(entries))
    summary = convert(LlavaSource(str(tmp_path / "llava.json"), str(tmp_path / "images")), str(tmp_path / "out"),
                      progress=False)
    assert summary.samples == 3 and summary.skipped == {"image_file_not_found": 1}
    back = read_back(str(tmp_path / "out"))
    assert sorted(back) == ["000000000", "000000001", "000000003"]
    assert [d for _, d in back["000000000"].images] == [(images / files[0]).read_bytes()]
    assert [d for _, d in back["000000001"].images] == [(images / f).read_bytes() for f in files[1:3]]
    for key, entry in (("000000000", entries[0]), ("000000001", entries[1]), ("000000003", entries[3])):
        assert back[key].conversation["conversations"] == entry["conversations"]
        assert back[key].metadata == {"id": entry["id"]}
    ids, _ = qwen3vl.encode(back["000000001"], [(1, 2, 2), (1, 4, 4)])
    assert (ids == 151655).sum() == 5


def test_sizes_and_the_module_entry_point():
    assert parse_bytes("512MB") == 512_000_000 and parse_bytes("1GiB") == 1 << 30 and parse_bytes("1000") == 1000
    out = subprocess.run([sys.executable, "-m", "datasvc.tools.convert", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--shard-bytes" in out.stdout

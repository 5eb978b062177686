"""``vlmfeed convert``: Parquet in the Hugging Face datasets layout and LLaVA JSON + image folder ->
WebDataset shards, byte for byte, sized by bytes, resumable; the service reads what it writes."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from datasvc.read.shards import ReadLimits, index_shard, read_samples
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import process_item
from datasvc.tools.convert import PROGRESS, REPORT, LlavaSource, ParquetSource, convert, main, parse_bytes
from datasvc.tools.convert_inputs import Converted, Skip
from datasvc.usage import UserError
from datasvc.wire import WorkItem


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
    assert sorted(p for p in os.listdir(tmp_path) if not p.startswith(".") and p != REPORT) == tars
    assert {p: hashlib.sha1((tmp_path / p).read_bytes()).hexdigest() for p in tars} == digest
    again = convert(source, str(tmp_path), shard_bytes=300_000, progress=False)  # complete: nothing rewritten
    assert again.kept_shards == len(tars) and os.stat(tmp_path / tars[0]).st_mtime_ns == first_mtime
    with pytest.raises(UserError, match="another conversion"):
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


# ---- mistakes: one line, the right exit status, and never a shard of wrong content ----

def run_main(capsys, *argv):
    capsys.readouterr()  # what writing the input printed (datasets' progress bars) is not the command's
    code = main([*map(str, argv), "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code, err, out_dir, *words):
    """Exit status 2, one line on stderr naming ``words``, and no shard written."""
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not os.path.exists(out_dir) or not [p for p in os.listdir(out_dir) if ".tar" in p]


def write_captioned(path, photos, captions=None, images=None, extra=None):
    """A Parquet file as ``datasets`` writes it: an Image column, a caption, an id (and ``extra``
    columns); ``None`` in ``captions`` or ``images`` leaves that row's value out."""
    from datasets import Dataset, Features, Image, Value

    captions = captions or [c for _, _, c in photos]
    images = images or [d for _, d, _ in photos]
    features = {"image": Image(), "caption": Value("string"), "id": Value("string")}
    rows = [{"image": {"bytes": d, "path": None} if d else None, "caption": c, "id": name}
            for (name, _, _), d, c in zip(photos, images, captions)]
    for name, (feature, values) in (extra or {}).items():
        features[name] = feature
        for row, value in zip(rows, values):
            row[name] = value
    Dataset.from_list(rows, features=Features(features)).to_parquet(str(path))
    return str(path)


def test_a_column_that_is_not_there_is_refused_naming_the_columns_there_are(tmp_path, photos, capsys):
    src = write_captioned(tmp_path / "data.parquet", photos[:3])
    code, _, err = run_main(capsys, src, "--out", tmp_path / "out", "--image-column", "img")
    assert_refused(code, err, tmp_path / "out", "no column 'img'", "its columns are: image, caption, id",
                   "--image-column")
    code, _, err = run_main(capsys, src, "--out", tmp_path / "out", "--text-column", "body")
    assert_refused(code, err, tmp_path / "out", "no column 'body'", "image, caption, id", "--text-column")
    code, _, err = run_main(capsys, write_captioned(tmp_path / "ids.parquet", photos[:3], captions=[None] * 3),
                            "--out", tmp_path / "out", "--text-column", "image")
    assert_refused(code, err, tmp_path / "out", "'image'", "holds bytes", "--text-column")


def test_image_bytes_never_reach_the_json(tmp_path, photos, capsys):
    from datasets import Value

    thumbs = [d[:2000] for _, d, _ in photos[:3]]
    src = write_captioned(tmp_path / "two.parquet", photos[:3], extra={"thumb": (Value("binary"), thumbs)})
    code, _, err = run_main(capsys, src, "--out", tmp_path / "out")
    assert_refused(code, err, tmp_path / "out", "'thumb'", "--image-column thumb", "--drop-column thumb")
    code, out, err = run_main(capsys, src, "--out", tmp_path / "out", "--drop-column", "thumb")
    assert code == 0, err
    back = read_back(str(tmp_path / "out"))
    assert [back[f"{i:09d}"].metadata for i in range(3)] == [{"id": name} for name, _, _ in photos[:3]]
    assert [[d for _, d in back[f"{i:09d}"].images] for i in range(3)] == [[d] for _, d, _ in photos[:3]]
    with pytest.raises(Skip, match="bytes_in_json"):  # the last guard, should a column check miss one
        Converted([], "a caption", {"blob": b"\xff\xd8"}).members("k")


def test_every_skipped_row_is_named_in_a_report_and_counted(tmp_path, photos, capsys):
    captions = [photos[0][2], photos[1][2], None, photos[3][2]]
    images = [photos[0][1], None, photos[2][1], photos[3][1]]
    src = write_captioned(tmp_path / "data.parquet", photos[:4], captions=captions, images=images)
    code, out, err = run_main(capsys, src, "--out", tmp_path / "out")
    assert code == 0, err
    assert sorted(read_back(str(tmp_path / "out"))) == ["000000000", "000000003"]
    report = [json.loads(line) for line in (tmp_path / "out" / REPORT).read_text().splitlines()]
    assert [(r["row"], r["id"], r["reason"]) for r in report] == [
        (1, photos[1][0], "no_image"), (2, photos[2][0], "no_text_or_messages")]
    assert all(r["file"] == src and r["file_row"] == r["row"] for r in report)
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"wrote 2 samples in 1 shard (") and lines[0].endswith("shard-000000.tar")
    assert lines[1] == f"skipped 2 rows (no_image 1, no_text_or_messages 1), each named in {tmp_path / 'out' / REPORT}"


def test_a_run_that_writes_no_sample_fails(tmp_path, photos, capsys):
    src = write_captioned(tmp_path / "data.parquet", photos[:3], captions=["", " ", None])
    code, out, err = run_main(capsys, src, "--out", tmp_path / "out")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "nothing usable was written" in err
    assert "wrote 0 samples in 0 shards" in out and "skipped 3 rows (no_text_or_messages 3)" in out
    assert len((tmp_path / "out" / REPORT).read_text().splitlines()) == 3
    assert not [p for p in os.listdir(tmp_path / "out") if ".tar" in p]


def test_llava_images_looked_for_in_the_wrong_folder(tmp_path, photos, capsys):
    (tmp_path / "images" / "coco").mkdir(parents=True)
    (tmp_path / "ann").mkdir()
    entries = []
    for i, (name, data, caption) in enumerate(photos[:4]):
        if i != 2:  # the third entry's image is missing from the folder
            (tmp_path / "images" / "coco" / f"{name}.jpg").write_bytes(data)
        entries.append({"id": name, "image": f"coco/{name}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": caption}]})
    src = tmp_path / "ann" / "llava.json"
    src.write_text(json.dumps(entries))
    code, _, err = run_main(capsys, src, "--out", tmp_path / "out")
    assert_refused(code, err, tmp_path / "out", "none of the first 4 images", "(the JSON's folder)", "--images-dir")
    code, out, err = run_main(capsys, src, "--out", tmp_path / "out", "--images-dir", tmp_path / "images")
    assert code == 0, err
    assert sorted(read_back(str(tmp_path / "out"))) == ["000000000", "000000001", "000000003"]
    [missing] = [json.loads(line) for line in (tmp_path / "out" / REPORT).read_text().splitlines()]
    assert missing == {"row": 2, "id": photos[2][0], "reason": "image_file_not_found",
                       "detail": str(tmp_path / "images" / "coco" / f"{photos[2][0]}.jpg")}
    assert "skipped 1 row (image_file_not_found 1)" in out and f"looked up under {tmp_path / 'images'}" in out
    lines = src.with_suffix(".jsonl")  # JSON Lines: a line that does not parse is one row skipped
    lines.write_text("\n".join([json.dumps(entries[0]), "{not json", json.dumps(entries[1])]))
    code, out, err = run_main(capsys, lines, "--out", tmp_path / "out2", "--images-dir", tmp_path / "images")
    assert code == 0 and "skipped 1 row (bad_json 1)" in out, err


def test_hub_ids_and_save_to_disk_folders_say_what_to_do(tmp_path, photos, capsys, monkeypatch):
    from datasets import Dataset

    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "someorg/captions", "--out", "out")
    assert_refused(code, err, "out", "'someorg/captions' is not a local path",
                   "load_dataset('someorg/captions', split='train').to_parquet(", "hf download someorg/captions")
    Dataset.from_list([{"caption": c} for _, _, c in photos[:2]]).save_to_disk(str(tmp_path / "saved"))
    code, _, err = run_main(capsys, "saved", "--out", "out")
    assert_refused(code, err, "out", "save_to_disk folder", "load_from_disk('saved').to_parquet(")


def test_inputs_convert_does_not_read_get_one_line(tmp_path, capsys):
    (tmp_path / "x.csv").write_text("image,caption\n")
    code, _, err = run_main(capsys, tmp_path / "x.csv", "--out", tmp_path / "out")
    assert_refused(code, err, tmp_path / "out", "does not read .csv files", ".parquet", ".json/.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    code, _, err = run_main(capsys, tmp_path / "bad.parquet", "--out", tmp_path / "out")
    assert_refused(code, err, tmp_path / "out", "not a readable Parquet file")
    (tmp_path / "bad.json").write_text('[{"id": 1,')
    code, _, err = run_main(capsys, tmp_path / "bad.json", "--out", tmp_path / "out")
    assert_refused(code, err, tmp_path / "out", "not valid JSON")
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(capsys, tmp_path / "empty", "--out", tmp_path / "out")
    assert_refused(code, err, tmp_path / "out", "no .parquet files under")
    proc = subprocess.run([sys.executable, "-m", "datasvc.tools.convert", str(tmp_path / "x.csv"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert_refused(proc.returncode, proc.stderr, tmp_path / "out", "does not read .csv files")


def test_a_resumed_run_names_every_skipped_row_once(tmp_path, photos, capsys):
    captions = [None if i % 3 == 0 else c for i, (_, _, c) in enumerate(photos)]
    src = write_captioned(tmp_path / "data.parquet", photos, captions=captions)
    out = tmp_path / "out"
    assert run_main(capsys, src, "--out", out, "--shard-bytes", "150kB")[0] == 0
    first = (out / REPORT).read_text()
    assert [json.loads(line)["row"] for line in first.splitlines()] == [0, 3, 6]
    os.remove(out / "shard-000001.tar")  # as if the run had died while writing it
    code, printed, _ = run_main(capsys, src, "--out", out, "--shard-bytes", "150kB")
    assert code == 0 and "1 kept from an earlier run" in printed and "skipped 3 rows" in printed
    assert (out / REPORT).read_text() == first


def test_images_are_read_only_from_under_the_images_folder(tmp_path, photos, capsys, monkeypatch):
    """A LLaVA entry (or a Parquet path column) names files; only regular files whose real path lies
    under --images-dir (the Parquet file's folder) are packed. An absolute path out of it, a ``..``,
    a symlink out of it and the converting process's own environment are named skips; a FIFO is
    never waited on."""
    monkeypatch.setenv("CONVERT_CANARY", "canary-value-never-packed")
    images = tmp_path / "images"
    (tmp_path / "secret.txt").write_bytes(b"SECRET=1")
    (images / "coco").mkdir(parents=True)
    (images / "coco" / "a.jpg").write_bytes(photos[0][1])
    os.symlink(tmp_path / "secret.txt", images / "coco" / "out.jpg")
    os.symlink(images / "coco" / "a.jpg", images / "coco" / "alias.jpg")
    os.mkfifo(images / "coco" / "pipe.jpg")
    names = ["coco/a.jpg", "/proc/self/environ", "../secret.txt", "coco/../../secret.txt", "coco/out.jpg",
             str(tmp_path / "secret.txt"), "coco/alias.jpg", str(images / "coco" / "a.jpg"), "coco/pipe.jpg"]
    entries = [{"id": str(i), "image": n, "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                             {"from": "gpt", "value": "A photo."}]}
               for i, n in enumerate(names)]
    (tmp_path / "llava.json").write_text(json.dumps(entries))
    code, out, err = run_main(capsys, tmp_path / "llava.json", "--out", tmp_path / "out", "--images-dir", images)
    assert code == 0, err
    report = {r["id"]: r["reason"] for r in map(json.loads, (tmp_path / "out" / REPORT).read_text().splitlines())}
    assert report == {**{str(i): "image_outside_images_dir" for i in range(1, 6)}, "8": "image_file_not_found"}
    assert "image_outside_images_dir 5" in out
    back = read_back(str(tmp_path / "out"))
    assert [[d for _, d in s.images] for s in back.values()] == [[photos[0][1]]] * 3
    shards = b"".join((tmp_path / "out" / p).read_bytes() for p in os.listdir(tmp_path / "out") if ".tar" in p)
    assert b"SECRET" not in shards and b"canary-value-never-packed" not in shards


def test_parquet_path_columns_stay_under_the_files_folder(tmp_path, photos, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "a.jpg").write_bytes(photos[0][1])
    src = tmp_path / "data" / "paths.parquet"
    pq.write_table(pa.table({"image": ["img/a.jpg", "/proc/self/environ", "../../etc/passwd"],
                             "caption": ["a", "b", "c"]}), src)
    code, out, err = run_main(capsys, src, "--out", tmp_path / "out", "--image-column", "image")
    assert code == 0, err
    assert "skipped 2 rows (image_outside_images_dir 2)" in out
    assert [[d for _, d in s.images] for s in read_back(str(tmp_path / "out")).values()] == [[photos[0][1]]]

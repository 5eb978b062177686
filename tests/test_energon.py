"""Datasets prepared with the real ``energon prepare``: their splits and sample types are read as
Energon reads them (checked against Energon's own loader), and trained on without conversion."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import webdataset as wds

from datasvc.batch import IGNORE_INDEX
from datasvc.read.shards import NoShardsError, ReadLimits, expand_shards, index_shard, read_samples
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import process_item
from datasvc.wire import WorkItem

ENERGON = os.path.join(os.path.dirname(sys.executable), "energon")
pytestmark = pytest.mark.skipif(not os.path.exists(ENERGON), reason="megatron-energon is not installed")


def prepare(root, sample_type, field_map):
    cmd = [ENERGON, "prepare", str(root), "--non-interactive", "--no-progress", "--split-ratio", "0.5,0.5,0",
           "--sample-type", sample_type, "--field-map", json.dumps(field_map)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def write_shards(root, samples, per_shard=3):
    os.makedirs(root, exist_ok=True)
    for s in range(0, len(samples), per_shard):
        with wds.TarWriter(os.path.join(root, f"part-{s // per_shard:04d}.tar")) as sink:
            for sample in samples[s:s + per_shard]:
                sink.write(sample)


@pytest.fixture(scope="module")
def photos():
    return [(n, encode_image(img[..., :3] if img.ndim == 3 else img, quality=80), c) for n, img, c in real_photos()[:12]]


@pytest.fixture(scope="module")
def captioning(tmp_path_factory, photos):
    root = tmp_path_factory.mktemp("energon") / "captions"
    write_shards(str(root), [{"__key__": n, "jpg": d, "txt": c} for n, d, c in photos])
    prepare(root, "CaptioningSample", {"image": "jpg", "caption": "txt"})
    return str(root)


@pytest.fixture(scope="module")
def vqa(tmp_path_factory, photos):
    root = tmp_path_factory.mktemp("energon") / "vqa"
    samples = [{"__key__": n, "jpg": d, "json": json.dumps({"question": f"What is shown in picture {i}?",
                                                           "answers": [c, "something else"], "source": "test"})}
               for i, (n, d, c) in enumerate(photos)]
    write_shards(str(root), samples)
    prepare(root, "VQASample", {"image": "jpg", "context": "json[question]", "answers": "json[answers]"})
    return str(root)


def energon_samples(root, split="val"):
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    ds = get_val_dataset(root, batch_size=None, split_part=split,
                         worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    return {s.__key__: s for s in get_loader(ds)}


def ours(root, spec, qwen3vl, cpu_decoder):
    out = {}
    for path in expand_shards([spec]):
        idx = index_shard(path)
        res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
        assert not res.accounting.quarantined, res.accounting.as_dict()
        raws = {r.key: r for r in read_samples(path, idx.samples, ReadLimits())}
        out.update({s.key: (raws[s.key], s) for s in res.samples})
    return out


def test_splits_are_energons(captioning):
    import yaml
    from braceexpand import braceexpand

    parts = yaml.safe_load(open(os.path.join(captioning, ".nv-meta", "split.yaml")))["split_parts"]
    for spec, split in ((captioning, "train"), (captioning + ":val", "val")):
        named = [os.path.join(captioning, n) for p in parts[split] for n in braceexpand(p)]
        assert expand_shards([spec]) == sorted(named) and named
    assert not set(expand_shards([captioning])) & set(expand_shards([captioning + ":val"]))
    with pytest.raises(ValueError, match="no split 'nope'"):
        expand_shards([captioning + ":nope"])


def test_excluded_shards_are_left_out(captioning, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(captioning, copy)
    split_file = copy / ".nv-meta" / "split.yaml"
    import yaml

    split = yaml.safe_load(split_file.read_text())
    first = expand_shards([str(copy)])[0]
    split["exclude"] = [os.path.basename(first)]
    split_file.write_text(yaml.safe_dump(split))
    assert first not in expand_shards([str(copy)])
    os.remove(expand_shards([str(copy) + ":val"])[0])
    with pytest.raises(ValueError, match="not there"):
        expand_shards([str(copy) + ":val"])


def test_captioning_reads_as_energon_does(captioning, qwen3vl, cpu_decoder):
    theirs = energon_samples(captioning)
    mine = ours(captioning, captioning + ":val", qwen3vl, cpu_decoder)
    assert sorted(mine) == sorted(theirs) and len(mine) >= 3
    for key, (raw, encoded) in mine.items():
        assert raw.text == theirs[key].caption
        reply = [int(t) for t in encoded.labels if t != IGNORE_INDEX]
        assert qwen3vl.tokenizer.decode(reply[:-1]) == theirs[key].caption


def test_vqa_becomes_a_question_and_its_answer(vqa, qwen3vl, cpu_decoder):
    theirs = energon_samples(vqa)
    mine = ours(vqa, vqa + ":val", qwen3vl, cpu_decoder)
    assert sorted(mine) == sorted(theirs) and len(mine) >= 3
    for key, (raw, encoded) in mine.items():
        assert raw.metadata["source"] == "test"
        text = qwen3vl.tokenizer.decode(encoded.input_ids.tolist(), skip_special_tokens=False)
        assert theirs[key].context in text and text.count("<|vision_start|>") == 1
        reply = [int(t) for t in encoded.labels if t != IGNORE_INDEX]
        assert qwen3vl.tokenizer.decode(reply[:-1]) == theirs[key].answers[0]


def test_a_dataset_directory_without_energon_metadata_is_still_an_error(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(NoShardsError, match="directory"):
        expand_shards([str(tmp_path / "plain")])


def test_unreadable_sample_types_fail_fast(captioning, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(captioning, copy)
    (copy / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: SimilarityInterleavedSample\nfield_map: {}\n")
    with pytest.raises(ValueError, match="SimilarityInterleavedSample"):
        expand_shards([str(copy)])


def test_an_energon_metadataset_is_a_blend(captioning, vqa, tmp_path):
    from datasvc.config import ServiceConfig
    from datasvc.pack.epoch import EpochPlan
    from datasvc.read.blend import parse_blend

    mix = tmp_path / "mix.yaml"
    mix.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                   f"      - weight: 3\n        path: {os.path.relpath(captioning, tmp_path)}\n"
                   f"      - weight: 1\n        path: {vqa}\n        split_part: val\n")
    sources = parse_blend(str(mix))
    assert [(s.name, s.weight) for s in sources] == [("captions", 3.0), ("vqa", 1.0)]
    assert sources[0].shards == (f"{captioning}:train",) and sources[1].shards == (f"{vqa}:val",)
    plan = EpochPlan(ServiceConfig(shards=(), blend=str(mix), samples_per_item=1))
    order = plan.items(0, 0)
    assert {plan.blend.source_of(i) for i in order} == {"captions", "vqa"}
    assert sum(plan.blend.source_of(i) == "vqa" for i in order) == round(len(order) / 4)


def hand_prepared(root, field_map: str, split_parts: str) -> None:
    """A dataset's .nv-meta as ``energon prepare`` writes it, by hand: the schema and the splits."""
    meta = root / ".nv-meta"
    meta.mkdir(parents=True)
    (meta / "dataset.yaml").write_text("sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
                                       f"field_map: {field_map}\n")
    (meta / "split.yaml").write_text(f"split_parts: {split_parts}\nexclude: []\n")


def alt_text_shards(directory, photos) -> None:
    write_shards(str(directory), [{"__key__": n, "jpg": d, "txt": "the txt caption",
                                   "json": json.dumps({"alt": "the alt text"})} for n, d, _ in photos[:3]])


def captions(spec) -> set[str]:
    return {raw.text for path in expand_shards([spec]) for raw in read_samples(path, index_shard(path).samples,
                                                                               ReadLimits())}


def test_a_schema_applies_to_the_dataset_named_and_says_so(tmp_path, photos, caplog):
    root = tmp_path / "named"
    alt_text_shards(root / "shards", photos)
    hand_prepared(root, "{image: jpg, caption: 'json[alt]'}", "{train: [shards/part-0000.tar]}")
    with caplog.at_level("INFO", logger="datasvc.read.energon"):
        assert captions(str(root)) == {"the alt text"}
    assert f"Energon dataset {root}, split 'train': 1 shards read as CaptioningSample" in caplog.text
    assert "json[alt]" in caplog.text


@pytest.mark.parametrize("named_by", ["glob", "path", "directory"])
def test_a_stray_nv_meta_above_plain_shards_changes_nothing(tmp_path, photos, named_by):
    """Shards named by their own path, a glob or their own directory are plain shards: a .nv-meta in
    a parent directory (a dataset.yaml left there, another dataset's) does not replace their captions."""
    root = tmp_path / "parent"
    alt_text_shards(root / "deeper" / "shards", photos)
    hand_prepared(root, "{image: jpg, caption: 'json[alt]'}", "{train: [deeper/shards/part-0000.tar]}")
    shards = root / "deeper" / "shards"
    spec = {"glob": f"{shards}/*.tar", "path": str(shards / "part-0000.tar"), "directory": str(shards)}[named_by]
    assert captions(spec) == {"the txt caption"}

"""Tests for datasvc.tools.synth: realistic synthetic shards, calibration and the mock mode."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from datasvc.tools import synth
from datasvc.tools.synth import PROFILES, Dist, Profile, calibrate, image_statistics, write_shards

ROOT = Path(__file__).resolve().parents[1]


def small_profile(**overrides) -> Profile:
    """A profile with small images (~0.12 MP) so tests stay fast, but every feature exercised."""
    kw = dict(
        name="test-small",
        megapixels=Dist.lognormal(0.12, 0.4, 0.04, 0.4),
        aspect=Dist.choice([4 / 3, 3 / 4, 1.0, 16 / 9], [0.4, 0.2, 0.2, 0.2]),
        jpeg_quality=Dist.choice([80, 90], [0.5, 0.5]),
        kinds={"photo/jpeg": 0.7, "photo/png": 0.15, "document/png": 0.15},
        images_per_sample=Dist.choice([1, 2, 3], [0.7, 0.2, 0.1]),
        caption_words=Dist.lognormal(20, 0.6, 2, 200),
        conversation_fraction=0.3,
        question_words=Dist.lognormal(8, 0.4, 2, 40),
        answer_words=Dist.lognormal(30, 0.7, 1, 300),
        progressive_fraction=0.2,
        subsampling={"4:2:0": 0.7, "4:4:4": 0.3},
    )
    kw.update(overrides)
    return Profile(**kw)


def tar_members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


def all_members(paths) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for p in paths:
        out.update(tar_members(p))
    return out


def samples_of(paths) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes}, WebDataset grouping."""
    out: dict[str, dict[str, bytes]] = {}
    for name, data in all_members(paths).items():
        key, ext = name.split(".", 1)
        out.setdefault(key, {})[ext] = data
    return out


def spectrum_slope(gray: np.ndarray, f_lo: float = 0.01, f_hi: float = 0.25) -> float:
    """Log-log slope of the radially averaged power spectrum over [f_lo, f_hi] cycles/pixel."""
    g = gray.astype(np.float64)
    g -= g.mean()
    h, w = g.shape
    p = np.abs(np.fft.fftshift(np.fft.fft2(g * np.outer(np.hanning(h), np.hanning(w))))) ** 2
    yy, xx = np.indices(p.shape)
    r = np.hypot((yy - h // 2) / h, (xx - w // 2) / w).ravel()
    edges = np.logspace(np.log10(f_lo), np.log10(f_hi), 16)
    idx = np.digitize(r, edges)
    f, pw = [], []
    for i in range(1, len(edges)):
        m = idx == i
        if m.any():
            f.append(r[m].mean())
            pw.append(p.ravel()[m].mean())
    return float(np.polyfit(np.log(f), np.log(pw), 1)[0])


def jpeg_bpp(arr: np.ndarray, quality: int = 85) -> float:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return len(buf.getvalue()) / (arr.shape[0] * arr.shape[1])


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    return write_shards(out, 60, small_profile(), seed=7, samples_per_shard=25, progress=False)


# ---------------------------------------------------------------------------------------------
# profiles and distributions


def test_profiles_roundtrip_json(tmp_path):
    for name, p in PROFILES.items():
        assert Profile.from_json(p.to_json()) == p, name
    p = small_profile()
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    assert Profile.load("documents") is PROFILES["documents"]
    with pytest.raises(ValueError):
        Profile.load("no-such-profile")


def test_quantile_dist_keeps_mean_and_range():
    data = np.random.default_rng(0).lognormal(0, 0.8, 500)
    d = Dist.fit_quantiles(data)
    assert d.mean() == pytest.approx(data.mean(), rel=0.03)
    rng = np.random.default_rng(1)
    draws = np.array([d.sample(rng) for _ in range(4000)])
    assert draws.min() >= data.min() - 1e-9 and draws.max() <= data.max() + 1e-9
    assert draws.mean() == pytest.approx(data.mean(), rel=0.05)


# ---------------------------------------------------------------------------------------------
# determinism and format


def test_deterministic_bytes(tmp_path, small_shards):
    p = small_profile()
    a = write_shards(tmp_path / "a", 12, p, seed=7, samples_per_shard=5, progress=False)
    b = write_shards(tmp_path / "b", 12, p, seed=7, samples_per_shard=5, progress=False)
    c = write_shards(tmp_path / "c", 12, p, seed=8, samples_per_shard=5, progress=False)
    assert [Path(x).name for x in a] == ["synth-000000.tar", "synth-000001.tar", "synth-000002.tar"]
    digest = lambda paths: [hashlib.sha256(Path(x).read_bytes()).hexdigest() for x in paths]  # noqa: E731
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    # a sample depends only on (seed, index): same members whatever the shard size
    ma, mbig = all_members(a), all_members(small_shards)
    assert all(mbig[name] == data for name, data in ma.items())
    assert all_members(c).keys() != ma.keys() or any(all_members(c)[n] != d for n, d in ma.items())


def test_members_decode_and_follow_the_format(small_shards):
    samples = samples_of(small_shards)
    assert len(samples) == 60
    n_multi = n_conv = n_png = 0
    for key, members in samples.items():
        image_exts = sorted((e for e in members if e.rsplit(".", 1)[-1] in ("jpg", "png")),
                            key=lambda e: int(e.split(".")[0]) if "." in e else 0)
        assert image_exts, key
        assert ("txt" in members) != ("json" in members), key
        if len(image_exts) > 1:
            n_multi += 1
            assert [e.split(".")[0] for e in image_exts] == [str(i) for i in range(len(image_exts))]
        for ext in image_exts:
            im = Image.open(io.BytesIO(members[ext]))
            assert im.format == ("JPEG" if ext.endswith("jpg") else "PNG")
            im.load()  # full decode must succeed
            assert min(im.size) >= 16
            n_png += ext.endswith("png")
        if "json" in members:
            n_conv += 1
            msgs = json.loads(members["json"])["messages"]
            assert [m["role"] for m in msgs] == ["user", "assistant"]
            assert msgs[0]["content"].count("<image>") == len(image_exts)
            assert msgs[1]["content"].strip()
        else:
            assert len(members["txt"].decode().split()) >= 1
    assert n_multi > 0 and n_conv > 0 and n_png > 0


# ---------------------------------------------------------------------------------------------
# natural-image statistics


def test_photos_have_natural_statistics(tmp_path):
    p = small_profile(megapixels=Dist.uniform(0.4, 0.6), kinds={"photo/jpeg": 1.0},
                      jpeg_quality=Dist.choice([85]), images_per_sample=Dist.choice([1]),
                      progressive_fraction=0.0, subsampling={"4:2:0": 1.0})
    paths = write_shards(tmp_path, 8, p, seed=3, progress=False)
    slopes, bpps = [], []
    for members in samples_of(paths).values():
        data = members["jpg"]
        arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        h, w = arr.shape[:2]
        bpps.append(len(data) / (w * h))
        slopes.append(spectrum_slope(cv2.cvtColor(arr, cv2.COLOR_RGB2GRAY)))
        # not flat: real tonal range and local structure everywhere
        assert arr.std() > 20
        assert len(np.unique(arr.reshape(-1, 3)[::97], axis=0)) > 500
        # a flat image at the same size costs a tiny fraction; uniform noise far more
        flat = np.full_like(arr, 128)
        noise = np.random.default_rng(0).integers(0, 256, arr.shape, dtype=np.uint8)
        assert bpps[-1] > 8 * jpeg_bpp(flat)
        assert bpps[-1] < 0.5 * jpeg_bpp(noise)
    assert all(-3.5 < s < -1.5 for s in slopes), slopes
    # photos at q85: ~0.15-0.5 bytes/px
    assert 0.12 < float(np.median(bpps)) < 0.5, bpps
    assert all(0.08 < b < 0.8 for b in bpps), bpps


def test_reference_photos_measure_like_synthetic_ones():
    """The slope metric itself: real photographs land in the band the synthetic test demands."""
    skd = pytest.importorskip("skimage.data")
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        gray = cv2.cvtColor(getattr(skd, name)(), cv2.COLOR_RGB2GRAY)
        assert -3.5 < spectrum_slope(gray) < -1.5, name
    white = np.random.default_rng(0).integers(0, 256, (256, 256)).astype(np.uint8)
    assert spectrum_slope(white) > -0.5


def test_documents_profile_is_png_heavy_tall_and_texty(tmp_path):
    p = PROFILES["documents"]
    # keep the test fast: same profile, pages scaled down
    p = Profile.from_dict({**p.to_dict(), "megapixels": Dist.lognormal(0.4, 0.3, 0.2, 0.8).to_dict()})
    paths = write_shards(tmp_path, 16, p, seed=1, progress=False)
    st = image_statistics(paths)
    assert st["format_mix"].get("png", 0) > 0.4
    assert st["median_aspect"] < 1.0
    assert st["conversation_fraction"] > 0.4
    for members in samples_of(paths).values():
        for ext, data in members.items():
            if ext.endswith("png"):
                arr = np.asarray(Image.open(io.BytesIO(data)).convert("L"))
                # text: lots of sharp horizontal intensity changes, on a mostly uniform page
                edges = np.abs(np.diff(arr.astype(np.int16), axis=1)) > 60
                assert edges.mean() > 0.002


def test_sft_and_interleaved_profiles_read_as_the_service_reads_them(tmp_path):
    """llava-sft: one photo and several turns, images only in the first question; interleaved: 4-8
    images a sample. Both are read by the service's own reader with nothing rejected."""
    from datasvc.read.shards import ReadLimits, index_shard, read_samples

    small = Dist.lognormal(0.05, 0.3, 0.02, 0.1).to_dict()  # fast: same profiles, small pictures
    for name, turns, images in (("llava-sft", (2, 8), (1, 1)), ("interleaved", (1, 1), (4, 8))):
        p = Profile.from_dict({**PROFILES[name].to_dict(), "megapixels": small})
        paths = write_shards(tmp_path / name, 12, p, seed=3, progress=False)
        raws = [r for path in paths for r in read_samples(path, index_shard(path).samples, ReadLimits())]
        assert len(raws) == 12 and not [r.problem for r in raws if r.problem], name
        for raw in raws:
            assert images[0] <= len(raw.images) <= images[1], (name, len(raw.images))
            if raw.conversation is None:
                continue
            msgs = raw.conversation["messages"]
            users = [m["content"] for m in msgs if m["role"] == "user"]
            assert turns[0] <= len(users) <= turns[1] and len(msgs) == 2 * len(users), name
            assert users[0].count("<image>") == len(raw.images) and not any("<image>" in u for u in users[1:])


def test_one_turn_profiles_write_the_text_they_always_wrote(tmp_path):
    """A turn count drawn after the first turn leaves a one-turn profile's samples as they were."""
    p = Profile.from_dict({**PROFILES["web-photos"].to_dict(), "conversation_fraction": 1.0,
                           "megapixels": Dist.lognormal(0.05, 0.3, 0.02, 0.1).to_dict()})
    two = Profile.from_dict({**p.to_dict(), "turns": Dist.choice([2], [1.0]).to_dict()})
    one_msgs = json.loads(samples_of(write_shards(tmp_path / "a", 2, p, seed=5, progress=False))["00000000"]["json"])
    two_msgs = json.loads(samples_of(write_shards(tmp_path / "b", 2, two, seed=5, progress=False))["00000000"]["json"])
    assert two_msgs["messages"][:2] == one_msgs["messages"] and len(two_msgs["messages"]) == 4


def test_jpeg_quality_estimate_reads_quant_tables():
    arr = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    for q in (50, 75, 85, 90, 95):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=q)
        assert synth.estimate_jpeg_quality(Image.open(io.BytesIO(buf.getvalue()))) == q


def test_bytes_per_pixel_target_is_hit(tmp_path):
    p = small_profile(megapixels=Dist.uniform(0.3, 0.5), kinds={"photo/jpeg": 1.0},
                      images_per_sample=Dist.choice([1]), jpeg_quality=Dist.choice([88]),
                      jpeg_bpp=Dist.choice([0.45]))
    st = image_statistics(write_shards(tmp_path / "hi", 6, p, seed=2, progress=False))
    assert st["jpeg_bytes_per_pixel"] == pytest.approx(0.45, rel=0.12)
    p.jpeg_bpp = Dist.choice([0.18])
    st = image_statistics(write_shards(tmp_path / "lo", 6, p, seed=2, progress=False))
    assert st["jpeg_bytes_per_pixel"] == pytest.approx(0.18, rel=0.12)


# ---------------------------------------------------------------------------------------------
# calibration


def test_calibration_recovers_a_known_profile(tmp_path, small_shards):
    truth = small_profile()
    st = image_statistics(small_shards)
    fitted = calibrate(small_shards)
    # the shards follow the profile ...
    assert st["mean_megapixels"] == pytest.approx(truth.megapixels.mean(), rel=0.10)
    # ... and the fit follows the shards
    assert fitted.megapixels.mean() == pytest.approx(st["mean_megapixels"], rel=0.10)
    assert fitted.megapixels.mean() == pytest.approx(truth.megapixels.mean(), rel=0.10)
    assert fitted.images_per_sample.mean() == pytest.approx(truth.images_per_sample.mean(), rel=0.10)
    for kind, frac in truth.kinds.items():
        assert fitted.kinds.get(kind, 0.0) == pytest.approx(frac, abs=0.1), kind
    assert fitted.caption_words.mean() == pytest.approx(truth.caption_words.mean(), rel=0.15)
    # few conversations in 60 samples: compare the fit with what the shards hold, not the truth
    answers = [len(json.loads(m["json"])["messages"][1]["content"].split())
               for m in samples_of(small_shards).values() if "json" in m]
    assert fitted.answer_words.mean() == pytest.approx(np.mean(answers), rel=0.05)
    assert fitted.conversation_fraction == pytest.approx(truth.conversation_fraction, abs=0.12)
    assert fitted.jpeg_quality.mean() == pytest.approx(85, abs=3)
    assert set(fitted.subsampling) == {"4:2:0", "4:4:4"}

    # shards written from the fitted profile match the originals
    again = image_statistics(write_shards(tmp_path, 60, fitted, seed=99, progress=False))
    assert again["mean_megapixels"] == pytest.approx(st["mean_megapixels"], rel=0.10)
    assert again["caption_words"] == pytest.approx(st["caption_words"], rel=0.15)
    assert again["jpeg_bytes_per_pixel"] == pytest.approx(st["jpeg_bytes_per_pixel"], rel=0.15)
    assert again["format_mix"]["png"] == pytest.approx(st["format_mix"]["png"], abs=0.1)


# real photos shipped in scikit-image, one-line captions from their docstrings
REAL = {
    "astronaut": "Eileen Collins, an American astronaut, in her orange space suit.",
    "chelsea": "Chelsea the cat, a tabby, looking to the side.",
    "coffee": "A cup of coffee on a saucer, seen from above.",
    "rocket": "A Falcon 9 rocket on the launch pad at Cape Canaveral.",
    "hubble_deep_field": "Hubble eXtreme Deep Field: thousands of distant galaxies.",
    "immunohistochemistry": "Immunohistochemical staining of colonic glands.",
    "cat": "A close-up of a cat's face with green eyes and long whiskers.",
}


@pytest.fixture(scope="module")
def real_shard(tmp_path_factory):
    skd = pytest.importorskip("skimage.data")
    from webdataset import TarWriter

    path = tmp_path_factory.mktemp("real") / "real-000000.tar"
    with TarWriter(str(path), encoder=False, mtime=0) as tw:
        for i, (name, caption) in enumerate(REAL.items()):
            for scale in (1.0, 0.6):  # two sizes each: a resolution distribution, not a point
                arr = getattr(skd, name)()
                if scale != 1.0:
                    arr = cv2.resize(arr, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
                buf = io.BytesIO()
                Image.fromarray(arr).save(buf, "JPEG", quality=90)
                tw.write({"__key__": f"{name}-{i}-{int(scale * 10)}", "jpg": buf.getvalue(),
                          "txt": caption.encode(), "pyd": b"\x80\x04never-unpickled."})
    return path


def test_calibration_from_real_photos(tmp_path, real_shard):
    real = image_statistics(real_shard)
    assert real["images"] == 2 * len(REAL) and real["jpeg_quality"] == 90
    fitted = calibrate(real_shard)
    assert fitted.kinds == {"photo/jpeg": 1.0}
    assert fitted.conversation_fraction == 0.0
    fitted.save(tmp_path / "fitted.json")
    fitted = Profile.load(tmp_path / "fitted.json")
    syn = image_statistics(write_shards(tmp_path / "syn", 56, fitted, seed=5, progress=False))
    assert syn["format_mix"] == {"jpeg": 1.0}
    assert syn["jpeg_quality"] == pytest.approx(90, abs=0.5)
    assert syn["mean_megapixels"] == pytest.approx(real["mean_megapixels"], rel=0.15)
    assert syn["mean_aspect"] == pytest.approx(real["mean_aspect"], rel=0.10)
    assert syn["jpeg_bytes_per_pixel"] == pytest.approx(real["jpeg_bytes_per_pixel"], rel=0.15)
    assert syn["caption_words"] == pytest.approx(real["caption_words"], rel=0.15)
    assert syn["images_per_sample"] == 1.0
    # bytes per image (what decode pays for) also in line
    per_img = lambda s: s["total_image_bytes"] / s["images"]  # noqa: E731
    assert per_img(syn) == pytest.approx(per_img(real), rel=0.25)


def test_calibration_reads_only_images_and_text(tmp_path):
    """Unknown members are skipped unread; LLaVA-style conversations are understood."""
    path = tmp_path / "mixed.tar"
    buf = io.BytesIO()
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(buf, "PNG")
    conv = {"conversations": [{"from": "human", "value": "<image>\nWhat is shown here today?"},
                              {"from": "gpt", "value": "A black rectangle."}]}
    with tarfile.open(path, "w") as tf:
        for name, data in [("a.png", buf.getvalue()), ("a.json", json.dumps(conv).encode()),
                           ("a.pth", b"\x80\x04garbage"), ("b.png", buf.getvalue()), ("b.txt", b"only text here"),
                           ("b.cls", b"3"), ("c.jpg", b"not a jpeg at all")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    st = image_statistics(path)
    # c.jpg is unreadable: skipped, not fatal (a caption without its image would be missing_image)
    assert st["samples"] == 2 and st["images"] == 2
    assert st["conversation_fraction"] == 0.5
    p = calibrate(path)
    assert p.question_words.mean() == 5 and p.answer_words.mean() == 3
    assert p.caption_words.mean() == 3
    assert p.kinds == {"document/png": 1.0}  # a flat PNG compresses far below a photo's 1.5+ B/px


# ---------------------------------------------------------------------------------------------
# mock mode


def test_mock_has_same_text_and_no_images(tmp_path, small_shards):
    mock = write_shards(tmp_path, 60, small_profile(), seed=7, samples_per_shard=25, mock=True, progress=False)
    real_samples, mock_samples = samples_of(small_shards), samples_of(mock)
    assert mock_samples.keys() == real_samples.keys()
    for key, members in mock_samples.items():
        assert set(members) == {"txt"}
        real = real_samples[key]
        if "txt" in real:
            assert members["txt"] == real["txt"]
        else:
            msgs = json.loads(real["json"])["messages"]
            words = [w for m in msgs for w in m["content"].split() if w != "<image>"]
            assert members["txt"].decode().split() == words
    st_mock, st_real = image_statistics(mock), image_statistics(small_shards)
    assert st_mock["images"] == 0
    assert st_mock["caption_words"] == pytest.approx(st_real["caption_words"], rel=1e-9)
    # and it is what makes naive benchmarks fast: a fraction of the bytes
    size = lambda ps: sum(os.path.getsize(p) for p in ps)  # noqa: E731
    assert size(mock) < 0.05 * size(small_shards)


# ---------------------------------------------------------------------------------------------
# command line


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "datasvc.tools.synth", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_end_to_end(tmp_path, real_shard):
    prof = tmp_path / "small.json"
    small_profile().save(prof)
    r = run_cli("--out", tmp_path / "a", "--samples", 7, "--profile", prof, "--seed", 3,
                "--samples-per-shard", 4, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "a")) == ["synth-000000.tar", "synth-000001.tar"]
    assert "wrote 2 shard(s), 7 samples" in r.stdout and "mean MP" in r.stdout
    assert all_members(sorted((tmp_path / "a").glob("*.tar"))) == all_members(
        write_shards(tmp_path / "api", 7, small_profile(), seed=3, samples_per_shard=4, progress=False))

    r = run_cli("--out", tmp_path / "cal", "--samples", 5, "--calibrate-from", real_shard,
                "--save-profile", tmp_path / "fit.json", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "reference" in r.stdout and "synthetic" in r.stdout
    fitted = Profile.load(tmp_path / "fit.json")
    assert fitted.kinds == {"photo/jpeg": 1.0}

    r = run_cli("--out", tmp_path / "m", "--samples", 5, "--profile", "web-photos", "--mock", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert image_statistics(tmp_path / "m")["images"] == 0

    r = run_cli("--out", tmp_path / "x", "--samples", 1, "--profile", "nope")
    assert r.returncode != 0 and "no profile named" in r.stderr


def test_a_writer_killed_mid_write_leaves_no_temporary_set_behind(tmp_path, monkeypatch):
    """A cached set whose writer was killed is written again, and the dead writer's half-written
    directory is deleted; a live writer's is left alone."""
    from datasvc.samples import cached_tars

    monkeypatch.setenv("VLMFEED_CACHE", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    dead = tmp_path / f"set.tmp{child.pid}"
    dead.mkdir()
    (dead / ".synth-000000.tar.tmp").write_bytes(b"half")
    live = tmp_path / f"set.tmp{os.getppid()}"
    live.mkdir()

    def write(directory):
        os.makedirs(directory)
        Path(directory, "a.tar").write_bytes(b"")

    assert [Path(p).name for p in cached_tars("set", write)] == ["a.tar"]
    assert not dead.exists() and live.exists()

"""Calibrated synthetic video: calibration reads real clips' headers (length, rate, size, codec,
bitrate, keyframes), the synthetic shards reproduce them with real encoders, and the service decodes
them (real DALI) into the same kind of samples. The "real" clips are real photos panned and zoomed,
encoded by FFmpeg's encoders through PyAV."""
from __future__ import annotations

import dataclasses
import json
import tarfile

import pytest

pytest.importorskip("av")

from test_video import _photo, _run, encode_clip, pan_zoom, write_tar  # noqa: E402

from datasvc.samples import encode_image  # noqa: E402
from datasvc.tools.synth import PROFILES, Dist, Profile, calibrate, image_statistics, write_shards  # noqa: E402


def _conv(markers: str, question: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": f"{markers}{question}"},
                                    {"role": "assistant", "content": "The camera moves slowly to the right."}]}).encode()


@pytest.fixture(scope="module")
def real_video_shard(tmp_path_factory):
    """Eight samples: VP9 WebM and MJPEG MKV clips of 1-2 s at two sizes, one with a photo too,
    conversations with ``<video>`` placeholders and captions."""
    astro, coffee, rocket = _photo("astronaut"), _photo("coffee"), _photo("rocket")
    vp9 = lambda photo, n, size, fps: encode_clip(pan_zoom(photo, n, size), fps=fps)  # noqa: E731
    mjpeg = lambda photo, n, size, fps: encode_clip(pan_zoom(photo, n, size), fps=fps, codec="mjpeg",  # noqa: E731
                                                    fmt="matroska")
    members = [
        ("a.webm", vp9(astro, 36, (96, 128), 24)), ("a.json", _conv("<video>\n", "What does the camera do?")),
        ("b.webm", vp9(coffee, 30, (120, 160), 20)), ("b.txt", b"A cup of coffee seen from above."),
        ("c.webm", vp9(rocket, 48, (96, 128), 24)), ("c.json", _conv("<video>\n", "Where is the rocket?")),
        ("d.mkv", mjpeg(coffee, 24, (96, 128), 12)), ("d.txt", b"A slow pan over a coffee cup."),
        ("e.mkv", mjpeg(astro, 20, (120, 160), 10)), ("e.json", _conv("<video>\n", "Who is this?")),
        ("f.jpg", encode_image(_photo("chelsea"))), ("f.webm", vp9(astro, 40, (120, 160), 20)),
        ("f.json", _conv("<image>\n<video>\n", "Compare the cat and the person.")),
        ("g.webm", vp9(rocket, 24, (96, 128), 24)), ("g.txt", b"A rocket on its pad."),
        ("h.mkv", mjpeg(rocket, 18, (96, 128), 12)), ("h.txt", b"The launch pad, panning."),
    ]
    return write_tar(tmp_path_factory.mktemp("real-video") / "real-000000.tar", members)


def test_calibration_reads_video_headers(real_video_shard):
    st = image_statistics(real_video_shard)
    assert st["videos"] == 8 and st["images"] == 1
    assert st["video_format_mix"] == {"mjpeg/mkv": 3 / 8, "vp9/webm": 5 / 8}
    assert st["video_seconds"] == pytest.approx((1.5 + 1.5 + 2 + 2 + 2 + 2 + 1 + 1.5) / 8)
    assert 0 < st["video_gop_seconds"] and st["video_kbps"] > 0
    p = calibrate(real_video_shard)
    assert p.media_per_sample == {"0+1": 7 / 8, "1+1": 1 / 8}
    assert p.video_sizes == {"mjpeg/mkv": {"128x96": 2 / 3, "160x120": 1 / 3},
                             "vp9/webm": {"128x96": 3 / 5, "160x120": 2 / 5}}  # sizes go with their format
    assert sorted(p.video_fps.values) == [10, 12, 20, 24]
    assert set(p.video_bits_per_pixel) == {"mjpeg/mkv", "vp9/webm"}  # one rate distribution per format
    # MJPEG stores every frame whole: its keyframe interval is one frame, VP9's many
    assert p.video_gop_seconds["mjpeg/mkv"].mean() < 0.11 < p.video_gop_seconds["vp9/webm"].mean()
    assert Profile.from_json(p.to_json()) == p


def test_calibrated_synthetic_videos_match_the_real_ones(tmp_path, real_video_shard, qwen3vl):
    real = image_statistics(real_video_shard)
    fitted = calibrate(real_video_shard)
    paths = write_shards(tmp_path / "syn", 24, fitted, seed=3, samples_per_shard=12, progress=False)
    syn = image_statistics(paths)
    assert syn["videos"] == 24 and syn["videos_per_sample"] == 1.0
    assert set(syn["video_format_mix"]) == {"mjpeg/mkv", "vp9/webm"}
    assert syn["video_seconds"] == pytest.approx(real["video_seconds"], rel=0.15)
    assert syn["video_fps"] == pytest.approx(real["video_fps"], rel=0.2)
    assert syn["video_megapixels"] == pytest.approx(real["video_megapixels"], rel=0.2)
    assert syn["video_kbps"] == pytest.approx(real["video_kbps"], rel=0.35)
    per_video = lambda s: s["total_video_bytes"] / s["videos"]  # noqa: E731
    assert per_video(syn) == pytest.approx(per_video(real), rel=0.35)

    # the service takes them as it takes the real ones: decoded by DALI, tokens with timestamps
    res, reasons = _run(paths[0], qwen3vl)
    assert not reasons and len(res.samples) == 12
    assert all(len(s.video_grid_thw) == 1 and s.video_pixels.shape[0] == int(s.video_grid_thw.prod() * 2)
               for s in res.samples)
    with tarfile.open(paths[0]) as tf:
        convs = [json.loads(tf.extractfile(m).read()) for m in tf.getmembers() if m.name.endswith(".json")]
    assert convs and all("<video>\n" in c["messages"][0]["content"] for c in convs)
    text = qwen3vl.tokenizer.decode(res.samples[0].input_ids.tolist(), skip_special_tokens=False)
    assert "seconds><|vision_start|><|video_pad|>" in text


def test_drawn_length_rate_size_and_bitrate_are_what_is_written(tmp_path):
    """Each format's encoder writes the drawn clip: frames = seconds x fps, the size, the codec,
    the keyframe interval, and the bitrate within the rate control's reach."""
    from datasvc.tools.synth.videos import draw_video_spec, render_video, video_record
    import numpy as np

    base = dataclasses.replace(PROFILES["video-clips"], video_sizes={"160x120": 1.0}, video_fps=Dist.choice([24]),
                               video_seconds=Dist.choice([2.0]), video_gop_seconds=Dist.choice([1.0]))
    for fmt, bpp in (("vp9/webm", 0.3), ("h264/mp4", 0.3), ("mjpeg/mkv", 1.0), ("vp8/mkv", 0.3)):
        p = dataclasses.replace(base, video_formats={fmt: 1.0}, video_bits_per_pixel=Dist.choice([bpp]))
        spec = draw_video_spec(np.random.default_rng(0), p)
        rec = video_record(render_video(spec, np.random.default_rng(1)))
        assert (rec["codec"], rec["w"], rec["h"], rec["frames"], rec["fps"]) == (fmt.split("/")[0], 160, 120, 48, 24)
        assert rec["bits_per_pixel"] == pytest.approx(bpp, rel=0.3), fmt
        if fmt != "mjpeg/mkv":
            assert rec["gop_seconds"] == pytest.approx(1.0, abs=0.05), fmt


def test_mock_of_a_video_profile_is_text_only(tmp_path):
    p = dataclasses.replace(PROFILES["video-clips"], video_sizes={"128x96": 1.0}, video_seconds=Dist.choice([1.0]))
    real = write_shards(tmp_path / "real", 6, p, seed=1, progress=False)
    mock = write_shards(tmp_path / "mock", 6, p, seed=1, mock=True, progress=False)
    with tarfile.open(mock[0]) as tf:
        names = [m.name for m in tf.getmembers()]
    assert names and all(n.endswith(".txt") for n in names)
    assert image_statistics(mock)["videos"] == 0 and image_statistics(real)["videos"] >= 6


def test_the_video_bench_times_each_decoder_on_the_same_clips(tmp_path):
    """``vlmfeed bench video`` on two small clips: DALI CPU and PyAV on VP9, PyAV alone on H.264
    (the CPU decoder refuses it), ratios against the fastest of each row, what was not run and why."""
    from datasvc.tools.bench.cli import main as bench_main

    out = tmp_path / "video.json"
    assert bench_main(["video", "--formats", "vp9/webm", "h264/mp4", "--sizes", "160x120", "--seconds", "1",
                       "--fps", "24", "--repeats", "1", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["question"] == "How fast is video decode, per decoder?" and rep["command"].startswith("vlmfeed bench video")
    assert rep["date"] and rep["machine"]["cpus"] >= 1 and rep["machine"]["versions"]["av"]
    rows = {(r["format"], r["mode"]): r for r in rep["rows"]}
    assert set(rows) == {(f, m) for f in ("vp9/webm", "h264/mp4") for m in ("all", "sampled")}
    assert set(rows["vp9/webm", "all"]["results"]) >= {"dali_cpu", "pyav"}
    assert "dali_cpu" not in rows["h264/mp4", "all"]["results"]
    for (fmt, mode), r in rows.items():
        # every frame of 1 s at 24 fps, or the processor's 2 a second (its minimum of 4)
        assert r["frames_wanted"] == (24 if mode == "all" else 4)
        assert all(x["frames"] == r["frames_wanted"] and x["frames_per_s"] > 0 for x in r["results"].values())
        assert max(x["vs_fastest"] for x in r["results"].values()) == 1.0
    assert rep["summary"]["all"]["dali_cpu_over_pyav_geomean"] > 0
    assert "dali_gpu" in rep["absent"] or "dali_gpu" in rows["h264/mp4", "all"]["results"]
    assert all(r["failed"] == {} for r in rows.values())  # a decoder that takes a clip and fails is named there
    resize = rep["resize"]  # the actors' frame resize against area alone, per clip length's target
    assert [r["clip_seconds"] for r in resize] == [4.0, 10.0, 30.0] and {r["size"] for r in resize} == {"160x120"}
    for r in resize:
        assert r["ours_cpu_ms_per_frame"] > 0 and r["area_cpu_ms_per_frame"] > 0 and r["area_over_ours"] > 0
        assert 0 <= r["ours_hf_mean_abs_diff_max"] < 0.05 and 0 <= r["area_hf_mean_abs_diff_max"] < 0.1


def test_delivered_video_tokens_are_vision_tokens_in_the_stream_stats(tmp_path, qwen3vl):
    from datasvc.pack.packing import PackingConfig, pack
    from datasvc.stats import StreamStats

    p = dataclasses.replace(PROFILES["video-clips"], media_per_sample={"1+1": 1.0}, video_sizes={"128x96": 1.0},
                            video_seconds=Dist.choice([1.0]), video_formats={"vp9/webm": 1.0},
                            megapixels=Dist.choice([0.05]))
    res, reasons = _run(write_shards(tmp_path, 3, p, seed=4, progress=False)[0], qwen3vl)
    assert not reasons
    (b,), _ = pack(res.samples, PackingConfig(seq_len=4096, micro_batch_size=1, pad_id=qwen3vl.pad_id), 768)
    st = StreamStats()
    st.add_batch(b, 2)
    pads = int(((b.tokens == 151655) | (b.tokens == 151656)).sum())  # image and video pad tokens
    assert st.vision_tokens == pads and st.text_tokens == b.real_tokens - pads


def test_calibrated_synthetic_videos_cost_what_the_real_ones_cost(tmp_path, real_video_shard):
    """The in-process video cost (``vlmfeed profile compare`` prints it): calibrated synthetic clips
    against the real ones, per sampled frame of decode + resize, and in vision tokens per video."""
    from datasvc.tools.profile.videocost import video_cost, video_cost_table

    syn = write_shards(tmp_path / "syn", 16, calibrate(real_video_shard), seed=5, progress=False)
    image_only = write_shards(tmp_path / "img", 2, "web-photos", seed=0, progress=False)
    assert video_cost({"images": image_only}) == {}
    cost = video_cost({"real": [real_video_shard], "synthetic": syn}, repeat=3)
    real, synth = cost["real"], cost["synthetic"]
    assert real["videos"] == 8 and synth["videos"] == 16 and synth["rejected_videos"] == 0
    assert real["sampled_frames"] == 4 * 8  # 1-2 s clips: the processor's minimum of 4 frames each
    assert synth["ratio"]["vision_tokens_per_video"] == pytest.approx(1.0, abs=0.15)
    assert 0.6 < synth["ratio"]["cpu_ms_per_frame"] < 1.6
    table = video_cost_table(cost)
    assert "dec+resize CPU ms/frame" in table and "x)" in table


def test_video_shards_repeat_byte_for_byte(tmp_path):
    """Equal arguments, equal bytes (bitexact muxers, one encoder thread) for VP9, VP8 and MJPEG; the
    package's H.264 clips are the exception (x264's rate control varies from run to run here)."""
    import hashlib

    p = dataclasses.replace(PROFILES["video-clips"], video_sizes={"128x96": 1.0}, video_seconds=Dist.choice([1.0]),
                            video_formats={"vp9/webm": 0.4, "vp8/webm": 0.3, "mjpeg/mkv": 0.3})
    digest = lambda d: hashlib.sha256(open(write_shards(tmp_path / d, 4, p, seed=3, progress=False)[0], "rb").read())  # noqa: E731
    assert digest("a").digest() == digest("b").digest()


def test_rendering_in_processes_writes_the_same_shards(tmp_path):
    """A sample depends only on (seed, index): two processes write what one writes, byte for byte
    (bitexact encoders), shard boundaries and all."""
    import hashlib

    p = dataclasses.replace(PROFILES["image-video-mix"], video_sizes={"128x96": 1.0}, video_seconds=Dist.choice([1.0]),
                            video_formats={"vp9/webm": 0.5, "mjpeg/mkv": 0.5}, megapixels=Dist.choice([0.05]))
    one = write_shards(tmp_path / "one", 6, p, seed=5, samples_per_shard=4, progress=False)
    two = write_shards(tmp_path / "two", 6, p, seed=5, samples_per_shard=4, progress=False, processes=2)
    digest = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()  # noqa: E731
    assert len(one) == len(two) == 2 and [digest(a) for a in one] == [digest(b) for b in two]

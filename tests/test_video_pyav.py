"""The PyAV (FFmpeg) video backend, for videos no DALI backend here takes: H.264, HEVC, AV1 and
MPEG-4 part 2 on a CPU machine, clips under NVDEC's smallest size on a GPU one. Checked against
DALI's CPU decoder on the codecs both take, against transformers' Qwen3-VL processor, frame by frame
on clips whose frames say their own index, and end to end through a work item. Clips are real
photos panned and zoomed (tests/test_video.py), encoded by FFmpeg's encoders through PyAV."""
from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

av = pytest.importorskip("av")

from test_video import (CONVERSATION, SPEC, TEMPLATE, VIDEO_PAD, _hf_processor, _llava,  # noqa: E402
                        _photo, _run, encode_clip, pan_zoom, video_decoder, vision, write_tar)

from datasvc.media.video import VideoHeader, plan_video, to_video_pixel_values  # noqa: E402
from datasvc.media.videodecode import VideoDecoder, _pyav_frames, _PyAVVideo, pyav_decodes  # noqa: E402
from datasvc.media.vision import ImageRejected  # noqa: E402

# (encoder, container, the codec the probe reads) for every codec DALI's CPU backend refuses
REFUSED_BY_DALI_CPU = [("libx264", "mp4", "h264"), ("libx265", "mp4", "hevc"), ("libsvtav1", "mp4", "av1"),
                       ("mpeg4", "mp4", "mpeg4")]


def _keyframes(data: bytes) -> list[int]:
    """Presentation indices of the keyframes, as the demuxer flags them."""
    with av.open(io.BytesIO(data)) as c:
        packets = [(p.pts, p.is_keyframe) for p in c.demux(video=0) if p.size > 0]
    order = {pts: i for i, pts in enumerate(sorted(pts for pts, _ in packets))}
    return sorted(order[pts] for pts, key in packets if key)


def _numbered(count: int, size=(96, 128)) -> list[np.ndarray]:
    """Frame k is flat grey 10 + 7k (with a photo's corner so encoders see texture): its
    brightness says its index."""
    corner = pan_zoom(_photo("coffee"), 1, (16, 16))[0]
    out = []
    for k in range(count):
        f = np.full((*size, 3), 10 + 7 * k, np.uint8)
        f[:16, :16] = corner
        out.append(f)
    return out


def _index_of(frame: np.ndarray) -> float:
    return (float(frame[24:, 24:].mean()) - 10) / 7


@pytest.fixture(scope="module")
def h264():
    return encode_clip(pan_zoom(_photo("astronaut"), 12, (96, 128)), fps=12, codec="libx264", fmt="mp4")


@pytest.mark.parametrize("codec,fmt", [("libvpx-vp9", "webm"), ("mjpeg", "matroska")])
def test_pyav_gives_dali_cpus_frames_on_the_codecs_both_take(codec, fmt, vision, video_decoder):
    """The same planned frames, seeking past a keyframe, from both backends. Both convert with
    swscale's bilinear full-chroma path, so they agree bit for bit here (FFmpeg's default fast
    conversion differs by ~2/255 on average); 1/255 is allowed for builds' rounding."""
    clip = encode_clip(pan_zoom(_photo("astronaut"), 30, (96, 128)), fps=10, codec=codec, fmt=fmt, gop=6)
    assert len(_keyframes(clip)) >= 5
    plan = plan_video(clip, vision, SPEC)
    assert video_decoder.route(plan.header) == "cpu"
    odd = dataclasses.replace(plan, indices=(7, 8, 13, 29))
    for p in (plan, odd):
        (dali,), (ours,) = video_decoder.decode_frames([p]), _PyAVVideo().decode([p])
        assert ours.shape == dali.shape == (len(p.indices), 96, 128, 3) and ours.dtype == np.uint8
        diff = np.abs(ours.astype(int) - dali)
        assert diff.max() <= 1 and diff.mean() <= 0.01, (diff.mean(), diff.max())


@pytest.mark.parametrize("codec,fmt,name", REFUSED_BY_DALI_CPU)
def test_codecs_dali_cpu_refuses_decode_on_cpu_through_pyav(codec, fmt, name, vision, video_decoder):
    if not pyav_decodes(name):
        pytest.skip(f"this FFmpeg build has no {name} decoder")
    clip = encode_clip(pan_zoom(_photo("rocket"), 30, (96, 128)), fps=10, codec=codec, fmt=fmt, gop=8)
    plan = plan_video(clip, vision, SPEC)
    assert plan.header.codec == name and video_decoder.route(plan.header) == "pyav"
    everything = dataclasses.replace(plan, indices=tuple(range(plan.header.frames)))
    sampled, full = video_decoder.decode_frames([plan, everything])
    assert sampled.shape == (len(plan.indices), 96, 128, 3) and full.shape == (30, 96, 128, 3)
    assert np.array_equal(sampled, full[list(plan.indices)])  # seeking lands on the same frames
    with av.open(io.BytesIO(clip)) as c:  # FFmpeg's plain decode, in presentation order
        ref = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert all(np.abs(sampled[k].astype(int) - ref[i]).mean() < 4 for k, i in enumerate(plan.indices))


@pytest.mark.parametrize("codec,fmt", [("libx264", "mp4"), ("libx264", "matroska"), ("libx265", "mp4"),
                                       ("mpeg4", "mp4"), ("libvpx-vp9", "webm"), ("libsvtav1", "mp4")])
def test_the_frames_returned_are_the_planned_ones(codec, fmt, vision):
    """Frame k's brightness is k: planned indices come back in order, whether the decode seeks to a
    keyframe past the first frame or runs from the start (B-frames reorder H.264 and HEVC)."""
    clip = encode_clip(_numbered(30), fps=10, codec=codec, fmt=fmt, gop=5)
    keys = _keyframes(clip)
    assert len(keys) >= 4, keys
    plan = plan_video(clip, vision, SPEC)
    for indices in (plan.indices, (2, 9, 13, 21, 28), (keys[2], keys[2] + 1, 29), (29,), (0, 1)):
        wanted = set(indices)
        seeked, total, moved = _pyav_frames(clip, wanted, from_start=False)
        start, _, _ = _pyav_frames(clip, wanted, from_start=True)
        assert total == 30 and moved == (min(indices) >= keys[1])
        assert sorted(seeked) == sorted(start) == sorted(wanted)
        assert all(np.array_equal(seeked[i], start[i]) for i in wanted)
        (frames,) = _PyAVVideo().decode([dataclasses.replace(plan, indices=tuple(indices))])
        assert [round(_index_of(f)) for f in frames] == list(indices), [_index_of(f) for f in frames]


def test_a_short_or_corrupt_stream_costs_only_its_video(h264, vision, video_decoder):
    good = plan_video(h264, vision, SPEC)
    past_the_end = dataclasses.replace(good, indices=(0, 5, 99))  # the container holds 12 frames
    mdat = h264.find(b"mdat")
    zeroed = bytearray(h264)
    zeroed[mdat + 4:mdat + 4 + 4096] = bytes(4096)  # boxes intact, so the probe passes it
    garbled = plan_video(bytes(zeroed), vision, SPEC)
    out = video_decoder.to_pixel_rows([good, past_the_end, garbled, good], vision)
    assert [type(r).__name__ for r in out] == ["ndarray", "ImageRejected", "ImageRejected", "ndarray"], out
    assert out[1].reason == "video_truncated" and "frame 99" in out[1].detail and "12" in out[1].detail
    assert out[2].reason == "video_corrupt" and len(out[2].detail) <= 200
    assert np.array_equal(out[0], out[3])


def test_tokens_grids_and_pixels_match_the_transformers_processor(vision, qwen3vl, video_decoder):
    """H.264 and HEVC on CPU: the processor, fed every frame of each video (decoded by PyAV), samples
    the frames and grids the pipeline plans, and its pixel values match the pipeline's rows."""
    import torch
    from transformers.video_utils import VideoMetadata

    from datasvc.read.shards import RawSample

    astro, rocket = _photo("astronaut"), _photo("rocket")
    clips = [encode_clip(pan_zoom(astro, 25, (96, 128)), fps=10, codec="libx264", fmt="mp4", gop=6),
             encode_clip(pan_zoom(rocket, 13, (112, 160)), fps=6, codec="libx265", fmt="mp4", gop=4)]
    plans = [plan_video(c, vision, qwen3vl.video) for c in clips]
    assert [video_decoder.route(p.header) for p in plans] == ["pyav", "pyav"]
    full = _PyAVVideo().decode([dataclasses.replace(p, indices=tuple(range(p.header.frames))) for p in plans])
    proc = _hf_processor()
    text = proc.tokenizer.apply_chat_template(CONVERSATION["messages"], chat_template=TEMPLATE, tokenize=False)
    meta = [VideoMetadata(total_num_frames=p.header.frames, fps=p.header.fps, duration=p.header.duration) for p in plans]
    hf = proc(text=[text], videos=[torch.from_numpy(f).permute(0, 3, 1, 2) for f in full], video_metadata=meta,
              do_sample_frames=True, return_tensors="pt", return_metadata=True)
    assert [list(m.frames_indices) for m in hf["video_metadata"]] == [list(p.indices) for p in plans]
    assert hf["video_grid_thw"].tolist() == [list(p.grid) for p in plans]
    ids, _labels = qwen3vl.encode(RawSample("s", "k", [], None, CONVERSATION), [], plans)
    assert ids.tolist() == hf["input_ids"][0].tolist()
    rows = video_decoder.to_pixel_rows(plans, vision)
    ours = to_video_pixel_values(np.concatenate(rows), vision, [p.grid for p in plans])
    theirs = hf["pixel_values_videos"].numpy()
    assert ours.shape == theirs.shape and float(np.abs(ours - theirs).mean()) <= 0.02


def test_h264_samples_reach_a_packed_batch_on_cpu_and_a_corrupt_one_costs_only_itself(tmp_path, h264, qwen3vl,
                                                                                     vision, cpu_decoder):
    from datasvc.pack.packing import PackingConfig, pack

    mdat = h264.find(b"mdat")
    corrupt = h264[:mdat + 4] + bytes(4096) + h264[mdat + 4 + 4096:]
    vp9 = encode_clip(pan_zoom(_photo("coffee"), 20, (96, 128)), fps=10)
    members = [("a.mp4", h264), ("a.txt", b"H.264 on a CPU machine"), ("b.mov", h264), ("b.json", _llava("Where?")),
               ("bad.mp4", corrupt), ("bad.txt", b"packets zeroed"), ("c.webm", vp9), ("c.txt", b"VP9 on DALI"),
               ("cut.mp4", h264[:len(h264) // 2]), ("cut.txt", b"cut in half")]
    res, reasons = _run(write_tar(tmp_path / "h264.tar", members), qwen3vl, cpu_decoder)
    assert reasons == {"bad": "video_corrupt", "cut": "video_truncated"}
    by_key = {s.key: s for s in res.samples}
    assert sorted(by_key) == ["a", "b", "c"]
    assert by_key["a"].video_grid_thw.tolist() == by_key["b"].video_grid_thw.tolist() == [[2, 10, 14]]
    plan = plan_video(h264, vision, qwen3vl.video)
    (batch,), too_long = pack(res.samples, PackingConfig(seq_len=4096, micro_batch_size=1, pad_id=qwen3vl.pad_id),
                              vision.patch_dim)
    grids = sorted(map(tuple, batch.video_grid_thw.tolist()))
    assert not too_long and grids == sorted([plan.grid] * 2 + [plan_video(vp9, vision, qwen3vl.video).grid])
    text = qwen3vl.tokenizer.decode(batch.tokens.reshape(-1).tolist(), skip_special_tokens=False)
    for t in plan.timestamps:  # both H.264 samples carry their temporal groups' timestamps (VP9's differ)
        assert text.count(f"<{t:.1f} seconds><|vision_start|><|video_pad|>") == 2, t
    patches = int(np.prod(batch.video_grid_thw, axis=1).sum())
    assert int((batch.tokens == VIDEO_PAD).sum()) == patches // 4
    assert to_video_pixel_values(batch.video_pixels, vision, batch.video_grid_thw).shape == (patches, 1536)


def _gpu_decoder_here(device_id: int) -> VideoDecoder:
    """A decoder that routes as one on a GPU machine would, its backends never built: the routing
    rule alone, on a machine with no GPU."""
    decoder = object.__new__(VideoDecoder)
    decoder.device_id, decoder.name, decoder._backends, decoder.nvdec_refused = device_id, "gpu", {}, set()
    return decoder


class _NvdecWithout:
    """In place of the mixed backend on a machine with no GPU: it fails on ``codecs`` as DALI's
    NVDEC decoder fails on a codec the GPU lacks (an H200's AV1), and on nothing else is it asked."""

    def __init__(self, *codecs: str):
        self.codecs, self.asked = codecs, []

    def decode(self, plans):
        self.asked += [p.header.codec for p in plans]
        assert all(p.header.codec in self.codecs for p in plans)
        return [ImageRejected("video_corrupt", "video_decoder_base.h:246") for _ in plans]


def test_a_codec_nvdec_lacks_is_decoded_where_a_cpu_machine_would_and_goes_there_after(vision, h264):
    av1 = encode_clip(pan_zoom(_photo("astronaut"), 12, (144, 192)), fps=12, codec="libsvtav1", fmt="mp4")
    gpu, nvdec = _gpu_decoder_here(0), _NvdecWithout("av1", "h264")
    gpu._backends["gpu"] = nvdec
    plan = plan_video(av1, vision, SPEC)
    assert gpu.route(plan.header) == "gpu"
    (frames,) = gpu.decode_frames([plan])
    (want,) = _PyAVVideo().decode([plan])
    assert isinstance(frames, np.ndarray) and np.array_equal(frames, want)
    assert gpu.nvdec_refused == {"av1"} and gpu.route(plan.header) == "pyav"
    gpu.decode_frames([plan])
    assert nvdec.asked == ["av1"]  # asked once, then never again
    # A video that fails on NVDEC and on PyAV is bad in itself: NVDEC's reason stands, its codec stays.
    past_the_end = dataclasses.replace(plan_video(h264, vision, SPEC), indices=(0, 5, 99))
    (res,) = gpu.decode_frames([past_the_end])
    assert isinstance(res, ImageRejected) and res.reason == "video_corrupt"
    assert gpu.nvdec_refused == {"av1"} and gpu.route(past_the_end.header) == "gpu"


def test_routes_dali_first_then_pyav_and_needs_gpu_only_where_neither_decodes(monkeypatch, h264, vision):
    cpu, gpu = VideoDecoder(device_id=None), _gpu_decoder_here(0)
    head = lambda codec, w, h: VideoHeader(codec, w, h, 10, 10.0)  # noqa: E731
    cases = [head("vp9", 128, 96), head("vp9", 640, 360), head("mjpeg", 640, 360), head("h264", 32, 32),
             head("h264", 1280, 720), head("hevc", 128, 128), head("av1", 640, 360), head("mpeg4", 32, 16)]
    assert [cpu.route(h) for h in cases] == ["cpu", "cpu", "cpu", "pyav", "pyav", "pyav", "pyav", "pyav"]
    assert [gpu.route(h) for h in cases] == ["cpu", "gpu", "cpu", "pyav", "gpu", "pyav", "gpu", "pyav"]
    assert not pyav_decodes("no-such-codec")
    import datasvc.media.videodecode as vd

    monkeypatch.setattr(vd, "pyav_decodes", lambda codec: False)  # an FFmpeg build without H.264
    plan = plan_video(h264, vision, SPEC)
    (res,) = cpu.decode_frames([plan])
    assert isinstance(res, ImageRejected) and res.reason == "video_codec_needs_gpu"
    assert gpu.route(plan.header) == "gpu"  # 128x96 is over NVDEC's H.264 minimum
    small = dataclasses.replace(plan, header=dataclasses.replace(plan.header, width=32, height=8))
    (res,) = gpu.decode_frames([small])
    assert isinstance(res, ImageRejected) and res.reason == "video_too_small_for_nvdec"


@pytest.mark.gpu
def test_av1_decodes_on_a_gpu_machine_whatever_its_nvdec_takes(vision):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (pytest -m gpu on a GPU box)")
    av1 = encode_clip(pan_zoom(_photo("astronaut"), 12, (144, 192)), fps=12, codec="libsvtav1", fmt="mp4")
    plan = plan_video(av1, vision, SPEC)
    gpu = VideoDecoder(device_id=0)
    (frames,) = gpu.decode_frames([plan])
    (want,) = _PyAVVideo().decode([plan])
    assert isinstance(frames, np.ndarray) and frames.shape == want.shape
    assert np.abs(frames.astype(int) - want).mean() < 3  # NVDEC's colour conversion, or PyAV's own frames
    assert gpu.route(plan.header) == ("pyav" if "av1" in gpu.nvdec_refused else "gpu")

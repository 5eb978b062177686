"""Video samples: probe, frame choice, DALI decode, tokens and tensors, checked against the
transformers Qwen3-VL processor on the same decoded frames. Clips are real photos panned and zoomed,
encoded by FFmpeg's encoders through PyAV (libvpx-vp9, MJPEG, libx264)."""
from __future__ import annotations

import functools
import io
import json
import tarfile

import numpy as np
import pytest

av = pytest.importorskip("av")

from datasvc.samples import real_photos  # noqa: E402
from datasvc.media.video import (VideoSpec, group_timestamps, plan_video, probe_video,  # noqa: E402
                           sample_frame_indices, to_video_pixel_values, video_target_size)
from datasvc.media.videodecode import VideoDecoder  # noqa: E402
from datasvc.media.vision import ImageRejected  # noqa: E402


@functools.lru_cache(maxsize=1)
def _photos() -> dict[str, np.ndarray]:
    return {n: (i if i.ndim == 3 else np.repeat(i[..., None], 3, axis=2))[..., :3] for n, i, _ in real_photos()}


def _photo(name: str) -> np.ndarray:
    return _photos()[name]


def pan_zoom(photo: np.ndarray, frames: int, size: tuple[int, int]) -> list[np.ndarray]:
    """A camera move over a real photo: the crop pans left to right while zooming in 30%."""
    import cv2

    h, w = photo.shape[:2]
    out = []
    for k in range(frames):
        s = k / max(1, frames - 1)
        ch, cw = int(h * (0.9 - 0.3 * s)), int(w * (0.9 - 0.3 * s))
        y, x = (h - ch) // 2, int((w - cw) * s)
        out.append(cv2.resize(np.ascontiguousarray(photo[y:y + ch, x:x + cw, :3]), size[::-1], interpolation=cv2.INTER_AREA))
    return out


def encode_clip(frames: list[np.ndarray], fps: int, codec: str = "libvpx-vp9", fmt: str = "webm",
                pts: list[int] | None = None, rotation: int = 0, gop: int | None = None) -> bytes:
    """Frames encoded by a real FFmpeg encoder; ``pts`` (in 1/1000 s) for a variable frame rate;
    ``gop``: a keyframe every that many frames (and B-frames where the encoder makes them)."""
    from fractions import Fraction

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.height, s.width = frames[0].shape[:2]
        s.pix_fmt = {"mjpeg": "yuvj420p", "ffv1": "yuv444p"}.get(codec, "yuv420p")
        if codec.startswith("libvpx"):
            s.options = {"deadline": "realtime", "cpu-used": "8"}
        if gop is not None:
            s.codec_context.gop_size = gop
            if codec == "libx265":
                s.options = {"x265-params": f"keyint={gop}:min-keyint={gop}:log-level=error"}
            if codec == "libsvtav1":
                s.options = {"svtav1-params": f"keyint={gop}"}
        if pts is not None:
            s.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            s.set_display_rotation(rotation)  # the display matrix of a phone held upright
        for k, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[k], Fraction(1, 1000)
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def audio_only(seconds: float = 0.5) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as c:
        s = c.add_stream("libopus", rate=48000)
        samples = np.zeros((1, 960), np.float32)
        for _ in range(int(seconds * 50)):
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate = 48000
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


SPEC = VideoSpec(fps=2, min_frames=4, max_frames=768, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768)
VS, VE, VIDEO_PAD, IMAGE_PAD = 151652, 151653, 151656, 151655


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    astro, coffee = _photo("astronaut"), _photo("coffee")
    return {
        "vp9": encode_clip(pan_zoom(astro, 25, (96, 128)), fps=10),  # 2.5 s
        "mjpeg": encode_clip(pan_zoom(coffee, 13, (112, 160)), fps=6, codec="mjpeg", fmt="matroska"),
        "h264": encode_clip(pan_zoom(astro, 12, (96, 128)), fps=12, codec="libx264", fmt="mp4"),
    }


def test_mov_is_read_as_mp4(qwen3vl):
    clip = encode_clip(pan_zoom(_photo("rocket"), 8, (64, 96)), fps=8, codec="libx264", fmt="mov")
    assert probe_video(clip, SPEC).frames == 8


@pytest.fixture(scope="module")
def vision():
    from datasvc.media.vision import VisionSpec

    return VisionSpec()


@pytest.fixture(scope="module")
def video_decoder():
    return VideoDecoder(device_id=None)


def test_the_pipeline_samples_as_the_processor_does(qwen3vl):
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor

    hf = Qwen3VLVideoProcessor()
    assert qwen3vl.video == SPEC
    assert (hf.fps, hf.min_frames, hf.max_frames) == (SPEC.fps, SPEC.min_frames, SPEC.max_frames)
    assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (SPEC.min_pixels, SPEC.max_pixels)


@pytest.mark.parametrize("total,fps", [(25, 10.0), (13, 6.0), (3, 30.0), (7, 30.0), (300, 29.97), (9000, 25.0),
                                       (100000, 60.0), (48, 24.0), (61, 2.0), (5, 1.0)])
def test_frame_choice_and_timestamps_match_transformers(total, fps):
    from transformers.models.qwen3_vl import Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    hf = Qwen3VLVideoProcessor()
    expected = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps))
    ours = sample_frame_indices(total, fps, SPEC)
    assert ours.tolist() == expected.tolist()
    hf_stamps = Qwen3VLProcessor._calculate_timestamps(None, expected, fps, 2)
    assert [f"<{t:.1f} seconds>" for t in group_timestamps(ours, fps, 2)] == [f"<{t:.1f} seconds>" for t in hf_stamps]


@pytest.mark.parametrize("frames", [2, 3, 4, 5, 48, 768])
@pytest.mark.parametrize("hw", [(32, 32), (96, 128), (240, 427), (720, 1280), (1080, 1920), (2160, 3840), (33, 4000)])
def test_smart_resize_over_frames_matches_transformers(frames, hw, vision):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    expected = smart_resize(frames, *hw, temporal_factor=2, factor=32, min_pixels=SPEC.min_pixels,
                            max_pixels=SPEC.max_pixels)
    assert video_target_size(frames, *hw, vision, SPEC) == expected


def test_probe_reads_the_container_alone(clips):
    assert probe_video(clips["vp9"], SPEC) == probe_video(clips["vp9"])
    vp9, mjpeg, h264 = (probe_video(clips[k], SPEC) for k in ("vp9", "mjpeg", "h264"))
    assert (vp9.codec, vp9.width, vp9.height, vp9.frames, vp9.fps) == ("vp9", 128, 96, 25, 10.0)
    assert (mjpeg.codec, mjpeg.width, mjpeg.height, mjpeg.frames, mjpeg.fps) == ("mjpeg", 160, 112, 13, 6.0)
    assert (h264.codec, h264.frames, h264.fps, h264.duration) == ("h264", 12, 12.0, 1.0)


def test_only_the_sampled_frames_are_decoded_and_they_are_the_stream_frames(clips, vision, video_decoder):
    import dataclasses

    plan = plan_video(clips["vp9"], vision, SPEC)
    assert plan.indices == (0, 6, 12, 18, 24) and plan.grid == (3, 10, 12)
    everything = dataclasses.replace(plan, indices=tuple(range(plan.header.frames)))
    sampled, full = video_decoder.decode_frames([plan, everything])
    assert sampled.shape == (5, 96, 128, 3) and full.shape == (25, 96, 128, 3)
    assert np.array_equal(sampled, full[list(plan.indices)])  # seeking lands on the same frames
    with av.open(io.BytesIO(clips["vp9"])) as c:  # FFmpeg's own decode of those frames, to RGB
        ref = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    for k, i in enumerate(plan.indices):
        assert np.abs(sampled[k].astype(int) - ref[i]).mean() < 4  # YUV->RGB conversions differ a little
    rows = video_decoder.to_pixel_rows([plan], vision)[0]
    assert rows.shape == (6 * 10 * 12, 768)  # 5 frames padded to 6 with the last


def test_a_video_the_decoder_fails_on_costs_only_itself(clips, vision, video_decoder):
    import dataclasses

    good = plan_video(clips["vp9"], vision, SPEC)
    past_the_end = dataclasses.replace(good, indices=(0, 10, 99))  # the container holds 25 frames
    out = video_decoder.to_pixel_rows([good, past_the_end, plan_video(clips["mjpeg"], vision, SPEC), good], vision)
    assert [type(r).__name__ for r in out] == ["ndarray", "ImageRejected", "ndarray", "ndarray"]
    assert out[1].reason == "video_corrupt"
    assert np.array_equal(out[0], out[3])  # the decoder, rebuilt after the failure, decodes as before


def _hf_processor():
    import os

    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLProcessor, Qwen3VLVideoProcessor

    from pipelines.qwen3vl.data import bundled_qwen3_tokenizer_dir

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(bundled_qwen3_tokenizer_dir(), "tokenizer.json"))
    image = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, min_pixels=65536, max_pixels=16777216)
    return Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=Qwen3VLVideoProcessor())


# Qwen3-VL-Instruct's chat template for what these samples use (see tests/test_formats.py), with its
# video part: one "<|vision_start|><|video_pad|><|vision_end|>" that the processor expands.
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}")

CONVERSATION = {"messages": [
    {"role": "user", "content": [{"type": "text", "text": "First "}, {"type": "video"},
                                 {"type": "text", "text": " then "}, {"type": "video"},
                                 {"type": "text", "text": "\nWhat moves?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "The camera pans right."}]}]}


@pytest.mark.parametrize("frame_hw,target", [((1080, 1920), (64, 128)), ((1080, 1920), (128, 256)),
                                             ((720, 1280), (64, 128)), ((360, 640), (224, 416))])
def test_frames_far_above_their_target_are_halved_first_and_stay_as_close_to_hf(frame_hw, target):
    """The frame resize (``jpegscale.resize_uint8``) on real photos filmed at video sizes: where a
    frame is 4x its target or more it is halved first, and the result is at least as close to HF's
    resize as OpenCV's area resize of the whole frame; below 4x it is that area resize itself."""
    import cv2
    import torch

    from datasvc.media.jpegscale import resize_uint8
    from datasvc.media.vision import hf_resize

    th, tw = target
    for name in sorted(_photos())[:3]:
        (frame,) = pan_zoom(_photo(name), 1, frame_hw)
        ours = resize_uint8(frame, target)
        area = cv2.resize(frame, (tw, th), interpolation=cv2.INTER_AREA)
        hf = hf_resize(torch.from_numpy(frame), target).numpy().astype(np.float32)
        assert ours.shape == (th, tw, 3)
        if frame_hw[0] < 4 * th or frame_hw[1] < 4 * tw:
            assert np.array_equal(ours, area)
        else:
            assert not np.array_equal(ours, area)
            assert np.abs(ours - hf).mean() <= np.abs(area - hf).mean() + 0.05  # in uint8 levels


def test_odd_sided_frames_are_not_halved():
    """A halving of an odd side would stretch the frame by half a pixel: such a frame goes to the
    area resize whole."""
    import cv2

    from datasvc.media.jpegscale import resize_uint8

    (frame,) = pan_zoom(_photo(sorted(_photos())[0]), 1, (1081, 1920))
    assert np.array_equal(resize_uint8(frame, (64, 128)), cv2.resize(frame, (128, 64), interpolation=cv2.INTER_AREA))


def test_tokens_grids_and_pixels_match_the_transformers_processor(clips, qwen3vl, vision, video_decoder):
    """On the same decoded frames (all of each video's frames, decoded by DALI, for the processor to
    sample itself): identical frame indices, grids, token ids (timestamps and pads), and pixels."""
    import dataclasses

    import torch
    from transformers.video_utils import VideoMetadata

    from datasvc.read.shards import RawSample

    names = ("vp9", "mjpeg")
    plans = [plan_video(clips[k], vision, qwen3vl.video) for k in names]
    full = video_decoder.decode_frames([dataclasses.replace(p, indices=tuple(range(p.header.frames))) for p in plans])
    proc = _hf_processor()
    text = proc.tokenizer.apply_chat_template(CONVERSATION["messages"], chat_template=TEMPLATE, tokenize=False)
    meta = [VideoMetadata(total_num_frames=p.header.frames, fps=p.header.fps, duration=p.header.duration) for p in plans]
    hf = proc(text=[text], videos=[torch.from_numpy(f).permute(0, 3, 1, 2) for f in full], video_metadata=meta,
              do_sample_frames=True, return_tensors="pt", return_metadata=True)
    assert [list(m.frames_indices) for m in hf["video_metadata"]] == [list(p.indices) for p in plans]
    assert hf["video_grid_thw"].tolist() == [list(p.grid) for p in plans]

    ids, labels = qwen3vl.encode(RawSample("s", "k", [], None, CONVERSATION), [], plans)
    assert ids.tolist() == hf["input_ids"][0].tolist()
    assert int((ids == VIDEO_PAD).sum()) == sum(qwen3vl.video_spans.vision_tokens(p.grid) for p in plans)
    decoded = qwen3vl.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert "<|vision_start|><0.3 seconds><|vision_start|><|video_pad|>" in decoded
    assert "<2.4 seconds><|vision_start|>" in decoded and "<|vision_end|><|vision_end|> then " in decoded

    rows = video_decoder.to_pixel_rows(plans, vision)
    ours = to_video_pixel_values(np.concatenate(rows), vision, [p.grid for p in plans])
    theirs = hf["pixel_values_videos"].numpy()
    assert ours.shape == theirs.shape
    assert float(np.abs(ours - theirs).mean()) <= 0.02


def write_tar(path, members) -> str:
    with tarfile.open(str(path), "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _run(path, pipeline, decoder=None):
    from datasvc.media.decode import CpuDecoder
    from datasvc.read.shards import index_shard
    from datasvc.stream.process import process_item
    from datasvc.wire import WorkItem

    idx = index_shard(path)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), pipeline, decoder or CpuDecoder())
    acct = res.accounting
    acct.delivered = len(res.samples)
    assert acct.balanced(), acct.as_dict()
    return res, {r.key: r.reason for r in acct.log}


def _llava(text: str) -> bytes:
    return json.dumps({"conversations": [{"from": "human", "value": f"<video>\n{text}"},
                                         {"from": "gpt", "value": "A slow pan."}]}).encode()


def test_video_shards_become_samples_and_bad_videos_are_counted(tmp_path, clips, qwen3vl, vision, cpu_decoder):
    """Caption, LLaVA <video> and OpenAI video-part samples, one mixed with a photo; and every kind of
    bad video rejected with its reason while the run goes on."""
    from datasvc.samples import encode_image

    astro = _photo("astronaut")
    vfr = encode_clip(pan_zoom(astro, 10, (96, 128)), fps=10, codec="libvpx-vp9", fmt="matroska",
                      pts=[0, 100, 200, 300, 700, 800, 900, 1400, 1500, 1600])
    members = [
        ("cap.webm", clips["vp9"]), ("cap.txt", b"A camera pans across a portrait."),
        ("llava.mkv", clips["mjpeg"]), ("llava.json", _llava("What happens?")),
        ("mixed.jpg", encode_image(_photo("chelsea"))), ("mixed.mkv", clips["mjpeg"]),
        ("mixed.json", json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]},
            {"role": "assistant", "content": "A cat, then a coffee cup."}]}).encode()),
        ("empty.webm", b""), ("empty.txt", b"zero bytes"),
        ("cut.mp4", clips["h264"][: len(clips["h264"]) // 2]), ("cut.txt", b"cut in half"),
        ("cutwebm.webm", clips["vp9"][: len(clips["vp9"]) // 3]), ("cutwebm.txt", b"cut webm"),
        ("junk.mkv", b"\x1aE\xdf\xa3" + bytes(range(256)) * 4), ("junk.txt", b"not a container"),
        ("audio.webm", audio_only()), ("audio.txt", b"sound only"),
        ("ffv1.mkv", encode_clip(pan_zoom(astro, 4, (64, 64)), fps=4, codec="ffv1", fmt="matroska")),
        ("ffv1.txt", b"a codec no decoder here takes"),
        ("h264.mp4", clips["h264"]), ("h264.txt", b"H.264, which DALI decodes on NVDEC only: PyAV here"),
        ("vfr.mkv", vfr), ("vfr.txt", b"frames at irregular times"),
        ("rotated.mp4", encode_clip(pan_zoom(astro, 8, (96, 128)), fps=8, codec="libx264", fmt="mp4", rotation=90)),
        ("rotated.txt", b"a display matrix"),
        ("count.mkv", clips["mjpeg"]), ("count.json", _llava("<video> twice?")),
    ]
    res, reasons = _run(write_tar(tmp_path / "videos.tar", members), qwen3vl, cpu_decoder)
    assert reasons == {"empty": "video_empty", "cut": "video_truncated", "cutwebm": "video_truncated",
                       "junk": "video_corrupt", "audio": "video_no_video_stream",
                       "ffv1": "video_unsupported_codec",
                       "vfr": "video_variable_frame_rate", "count": "video_count_mismatch",
                       "rotated": "video_rotated"}
    by_key = {s.key: s for s in res.samples}
    assert sorted(by_key) == ["cap", "h264", "llava", "mixed"]
    assert by_key["h264"].video_grid_thw.tolist() == [[2, 10, 14]]
    assert by_key["cap"].video_grid_thw.tolist() == [[3, 10, 12]] and by_key["cap"].video_pixels.shape == (720, 768)
    mixed = by_key["mixed"]
    assert len(mixed.image_grid_thw) == 1 and mixed.video_grid_thw.tolist() == [[2, 10, 14]]
    assert mixed.vision_patches == mixed.num_patches + 2 * 10 * 14
    ids = mixed.input_ids
    first_image, first_video = np.flatnonzero(ids == IMAGE_PAD)[0], np.flatnonzero(ids == VIDEO_PAD)[0]
    assert first_image < first_video and int((ids == VIDEO_PAD).sum()) == 2 * 10 * 14 // 4
    assert np.all(mixed.labels[ids == VIDEO_PAD] == -100)
    text = qwen3vl.tokenizer.decode(by_key["llava"].input_ids.tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n<|vision_start|><0.3 seconds><|vision_start|><|video_pad|>")
    assert "<1.7 seconds>" in text and "<|vision_end|><|vision_end|>\nWhat happens?<|im_end|>" in text


def test_caps_on_frames_times_pixels_apply_before_decode(tmp_path, clips):
    from datasvc.registry import get_pipeline

    tight = get_pipeline("qwen3vl", video_max_decode_frame_pixels=4 * 160 * 112)  # one 4-frame mjpeg clip
    members = [("one.mkv", clips["mjpeg"]), ("one.txt", b"four frames"),
               ("two.0.mkv", clips["mjpeg"]), ("two.1.mkv", clips["mjpeg"]), ("two.txt", b"two clips are more")]
    res, reasons = _run(write_tar(tmp_path / "caps.tar", members), tight)
    assert [s.key for s in res.samples] == ["one"] and reasons == {"two": "video_too_large"}


def test_packed_batches_carry_videos_and_balance_their_patches(tmp_path, clips, qwen3vl, vision):
    from datasvc.pack.packing import PackingConfig, pack

    members = [("a.webm", clips["vp9"]), ("a.txt", b"A pan."), ("b.mkv", clips["mjpeg"]), ("b.txt", b"A cup."),
               ("c.webm", clips["vp9"]), ("c.txt", b"A pan again."), ("d.mkv", clips["mjpeg"]), ("d.txt", b"A cup again.")]
    res, reasons = _run(write_tar(tmp_path / "pack.tar", members), qwen3vl)
    assert not reasons
    # One sample a row, two rows a micro-batch: the packer balances the rows by vision patches.
    cfg = PackingConfig(seq_len=max(s.num_tokens for s in res.samples), micro_batch_size=2, pad_id=qwen3vl.pad_id)
    batches, too_long = pack(res.samples, cfg, vision.patch_dim)
    assert not too_long and len(batches) == 2
    grids = np.concatenate([b.video_grid_thw for b in batches])
    assert sorted(map(tuple, grids.tolist())) == [(2, 10, 14)] * 2 + [(3, 10, 12)] * 2
    for b in batches:  # pads in the tokens = the grids' vision tokens; rows = frames' patches
        patches = int(np.prod(b.video_grid_thw, axis=1).sum())
        assert patches == 360 + 280  # one clip of each kind in every micro-batch
        assert int((b.tokens == VIDEO_PAD).sum()) == patches // 4
        assert b.video_pixels.shape[0] == patches * 2
        assert to_video_pixel_values(b.video_pixels, vision, b.video_grid_thw).shape == (patches, 1536)


def test_pixel_values_are_the_same_from_numpy_and_torch(clips, vision, video_decoder):
    import torch

    plans = [plan_video(clips[k], vision, SPEC) for k in ("vp9", "mjpeg")]
    rows = np.concatenate(video_decoder.to_pixel_rows(plans, vision))
    grids = [p.grid for p in plans]
    ours = to_video_pixel_values(rows, vision, grids)
    theirs = to_video_pixel_values(torch.from_numpy(rows), vision, grids, dtype=torch.bfloat16)
    assert theirs.dtype == torch.bfloat16 and theirs.shape == ours.shape
    assert float((theirs.float() - torch.from_numpy(ours)).abs().max()) < 0.01


def test_the_cpu_model_trains_on_packed_image_and_video_samples(tmp_path, clips, qwen3vl, vision, cpu_decoder):
    """Packed rows split back into samples with their own video patches; the tiny real Qwen3-VL
    (transformers) takes each sample's tokens, grids and pixel_values_videos and gives a finite loss."""
    import torch

    from datasvc.pack.packing import PackingConfig, pack
    from datasvc.samples import encode_image
    from datasvc.stream.tensors import batch_tensors
    from pipelines.qwen3vl.cpu_model import CpuModelConfig, build_model
    from trainer.cpu_backend import sample_loss, split_samples

    members = [("a.webm", clips["vp9"]), ("a.txt", b"A pan."), ("b.jpg", encode_image(_photo("coffee"))),
               ("b.mkv", clips["mjpeg"]), ("b.txt", b"A cup, twice."), ("c.jpg", encode_image(_photo("chelsea"))),
               ("c.txt", b"A cat.")]
    res, reasons = _run(write_tar(tmp_path / "train.tar", members), qwen3vl, cpu_decoder)
    assert not reasons
    (b,), _ = pack(res.samples, PackingConfig(seq_len=4096, micro_batch_size=1, pad_id=qwen3vl.pad_id), 768)
    assert b.num_samples.tolist() == [3]
    parts = split_samples(batch_tensors(b, vision), qwen3vl.tokens.image_pad, qwen3vl.video_pad)
    by_key = {f"{s.shard}/{s.key}": s for s in res.samples}
    model = build_model(CpuModelConfig(), seed=0)
    for part, key in zip(parts, b.sample_keys):
        s = by_key[key]
        assert part["input_ids"].tolist() == s.input_ids.tolist()
        assert part.get("video_grid_thw", torch.zeros((0, 3))).tolist() == s.video_grid_thw.tolist()
        if len(s.video_grid_thw):
            expected = to_video_pixel_values(s.video_pixels, vision, s.video_grid_thw)
            assert np.array_equal(part["pixel_values_videos"].numpy(), expected)
        with torch.no_grad():
            loss, n = sample_loss(model, part)
        assert n > 0 and torch.isfinite(loss)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_nvdec_decodes_the_sampled_frames_of_every_codec(clips, vision, video_decoder):
    """The mixed backend takes H.264 (which the CPU decoder refuses) and gives the CPU decoder's
    frames for VP9 and MJPEG up to the YUV->RGB conversion; pixel values on the GPU match."""
    import torch

    gpu = VideoDecoder(device_id=0)
    plans = {k: plan_video(clips[k], vision, SPEC) for k in ("vp9", "mjpeg", "h264")}
    big_vp9 = plan_video(encode_clip(pan_zoom(_photo("astronaut"), 12, (144, 192)), fps=6), vision, SPEC)
    # NVDEC takes H.264 and a VP9 of 192x144; the VP9 of 128x96 (under its 128x128) and MJPEG go to the CPU.
    assert [gpu.route(p.header) for p in (*plans.values(), big_vp9)] == ["cpu", "cpu", "gpu", "gpu"]
    rows = dict(zip(plans, gpu.to_pixel_rows(list(plans.values()), vision)))
    assert all(isinstance(r, np.ndarray) for r in rows.values()), rows
    on_gpu, on_cpu = gpu.to_pixel_rows([big_vp9], vision)[0], video_decoder.to_pixel_rows([big_vp9], vision)[0]
    assert on_gpu.shape == on_cpu.shape and np.abs(on_gpu.astype(int) - on_cpu).mean() < 3
    assert rows["h264"].shape == (2 * 2 * 10 * 14, 768)
    for k in ("vp9", "mjpeg"):
        cpu = video_decoder.to_pixel_rows([plans[k]], vision)[0]
        assert np.abs(cpu.astype(int) - rows[k]).mean() < 3
    values = to_video_pixel_values(torch.from_numpy(rows["h264"]).cuda(), vision, [plans["h264"].grid])
    assert values.is_cuda and values.shape == (2 * 10 * 14, 1536)
    assert np.abs(values.cpu().numpy() - to_video_pixel_values(rows["h264"], vision, [plans["h264"].grid])).max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_a_video_nvdec_fails_on_costs_only_itself(clips, vision):
    import dataclasses

    gpu = VideoDecoder(device_id=0)
    good = plan_video(clips["h264"], vision, SPEC)
    past_the_end = dataclasses.replace(good, indices=(0, 5, 99))  # the container holds 12 frames
    out = gpu.to_pixel_rows([good, past_the_end, good, good], vision)
    assert [type(r).__name__ for r in out] == ["ndarray", "ImageRejected", "ndarray", "ndarray"], out
    assert np.array_equal(out[0], out[2]) and np.array_equal(out[0], out[3])
    assert isinstance(gpu.to_pixel_rows([good], vision)[0], np.ndarray)  # and it goes on decoding


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_h264_samples_go_through_the_gpu_video_decoder(tmp_path, clips, qwen3vl):
    members = [("a.mp4", clips["h264"]), ("a.txt", b"H.264 on NVDEC"), ("b.mov", clips["h264"]), ("b.txt", b"in a mov")]
    path = write_tar(tmp_path / "h264.tar", members)
    from datasvc.read.shards import index_shard
    from datasvc.stream.process import process_item
    from datasvc.wire import WorkItem

    gpu = VideoDecoder(device_id=0)
    res = process_item(WorkItem(path, 0, tuple(index_shard(path).samples)), qwen3vl, None,  # no images here
                       video_decoder=lambda: gpu)
    assert [s.key for s in res.samples] == ["a", "b"] and not res.accounting.log
    assert all(s.video_grid_thw.tolist() == [[2, 10, 14]] for s in res.samples)


def test_the_profiler_counts_video_tokens_and_time_per_frame(tmp_path, clips, qwen3vl, vision):
    from datasvc.media.video import VIDEO_STAGES
    from datasvc.pack.packing import PackingConfig, pack
    from datasvc.tools.profile.measure import _stage_diff, _tally_batch, _video_report

    members = [("a.webm", clips["vp9"]), ("a.txt", b"A pan."), ("b.mkv", clips["mjpeg"]), ("b.txt", b"A cup.")]
    res, _ = _run(write_tar(tmp_path / "profile.tar", members), qwen3vl)
    (b,), _ = pack(res.samples, PackingConfig(seq_len=4096, micro_batch_size=1, pad_id=qwen3vl.pad_id), 768)
    tally = _tally_batch(b, vision)
    assert (tally.videos, tally.video_tokens) == (2, (360 + 280) // 4)
    assert tally.vision_tokens == tally.video_tokens == int((b.tokens == VIDEO_PAD).sum())
    from datasvc.read.shards import index_shard
    from datasvc.stream.process import process_item
    from datasvc.wire import WorkItem

    path = str(tmp_path / "profile.tar")
    times = process_item(WorkItem(path, 0, tuple(index_shard(path).samples)), qwen3vl, None).times.as_dict()
    video = _video_report(tally, _stage_diff({}, times, VIDEO_STAGES))
    assert video["frames_decoded"] == 5 + 4 and video["decode_ms_per_frame"] > 0
    assert times["decode"]["seconds"] >= times["video_decode"]["seconds"]  # the actor's stage holds it too


def test_packed_mrope_of_videos_matches_each_sample_alone_and_the_hf_model(tmp_path, clips, qwen3vl, cpu_decoder):
    """Megatron-Bridge's rope index over a packed row (THD) with video samples: positions restart
    per sample and equal the sample run alone, and equal transformers' Qwen3-VL model's own index."""
    pytest.importorskip("megatron.bridge")
    import torch
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import get_rope_index

    from datasvc.pack.packing import PackingConfig, pack
    from datasvc.samples import encode_image
    from datasvc.stream.tensors import batch_tensors
    from pipelines.qwen3vl.cpu_model import CpuModelConfig, build_model
    from trainer.megatron.thd import mrope_position_ids, pack_thd

    members = [("a.webm", clips["vp9"]), ("a.txt", b"A pan."), ("b.jpg", encode_image(_photo("coffee"))),
               ("b.mkv", clips["mjpeg"]), ("b.txt", b"A cup, twice."), ("c.jpg", encode_image(_photo("chelsea"))),
               ("c.txt", b"A cat.")]
    res, reasons = _run(write_tar(tmp_path / "rope.tar", members), qwen3vl, cpu_decoder)
    assert not reasons
    (b,), _ = pack(res.samples, PackingConfig(seq_len=4096, micro_batch_size=1, pad_id=qwen3vl.pad_id), 768)
    t = batch_tensors(b, qwen3vl.vision)
    packed = pack_thd(t.tokens, t.labels, t.loss_mask, t.cu_seqlens, t.num_samples)
    from test_megatron_config import QWEN3VL_IDS

    pos = mrope_position_ids(packed, QWEN3VL_IDS, t.image_grid_thw, t.video_grid_thw)
    by_key = {f"{s.shard}/{s.key}": s for s in res.samples}
    hf = build_model(CpuModelConfig(), seed=0).model
    for (a, e), key in zip(packed.sample_spans, b.sample_keys):
        s = by_key[key]
        ids = torch.from_numpy(s.input_ids.astype(np.int64))[None]
        images = torch.from_numpy(s.image_grid_thw) if len(s.image_grid_thw) else None
        videos = torch.from_numpy(s.video_grid_thw) if len(s.video_grid_thw) else None
        alone, _ = get_rope_index(2, IMAGE_PAD, VIDEO_PAD, VS, ids, image_grid_thw=images,
                                  video_grid_thw=None if videos is None else videos.clone())
        assert torch.equal(pos[:, 0, a:e], alone[:, 0]), key
        kinds = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
        theirs, _ = hf.get_rope_index(ids, kinds, images, videos)
        assert torch.equal(alone[:, 0], theirs[:, 0]), key


def test_token_rows_from_headers_equal_the_decoded_samples(tmp_path, clips, qwen3vl, cpu_decoder):
    """What packing plans from container headers alone is what decoding delivers."""
    from datasvc.pack.headers import encode_from_headers
    from datasvc.read.shards import ReadLimits, index_shard, read_samples

    path = write_tar(tmp_path / "headers.tar", [("a.webm", clips["vp9"]), ("a.json", _llava("Where to?")),
                                                ("b.mkv", clips["mjpeg"]), ("b.txt", b"A cup.")])
    res, _ = _run(path, qwen3vl, cpu_decoder)
    for raw, sample in zip(read_samples(path, index_shard(path).samples, ReadLimits()), res.samples):
        ids, labels, _grids = encode_from_headers(raw, qwen3vl)
        assert ids.tolist() == sample.input_ids.tolist() and labels.tolist() == sample.labels.tolist()

"""The fused Triton ``pixel_values`` kernel (images and videos) against the paths it replaces on GPUs.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, which must be set
before triton is first imported, so in a child process). The interpreter's multiply-add is not
fused and its bfloat16 cast truncates, so values agree within one float32 step and one bfloat16
step; on a GPU (the ``gpu`` test) float32 agrees to 1e-6 as well.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

CHECK = textwrap.dedent("""
    import json
    import torch
    from datasvc.media.vision import VisionSpec, fused_kernel_usable, fused_pixel_values, torch_pixel_values

    clip = dict(patch_size=14, image_mean=(0.48145466, 0.4578275, 0.40821073),
                image_std=(0.26862954, 0.26130258, 0.27577711))
    cases = {
        "qwen3vl": (VisionSpec(), [(1, 4, 6), (1, 2, 2), (1, 6, 2), (1, 2, 10)]),
        "p14_clip_stats": (VisionSpec(**clip), [(1, 4, 4), (1, 2, 6)]),
        "one_frame": (VisionSpec(temporal_patch_size=1), [(1, 2, 4)]),
        "merge1_three_frames": (VisionSpec(merge_size=1, temporal_patch_size=3), [(1, 3, 5), (1, 1, 1)]),
    }
    out = {"usable": fused_kernel_usable(torch.device("cpu"))}
    gen = torch.Generator().manual_seed(0)
    for name, (spec, grids) in cases.items():
        n = sum(h * w for _, h, w in grids)
        rows = torch.randint(0, 256, (n, spec.patch_dim), generator=gen, dtype=torch.uint8)
        want = torch_pixel_values(rows, spec, grids, torch.float32)
        got32 = fused_pixel_values(rows, spec, grids, torch.float32)
        got16 = fused_pixel_values(rows, spec, grids, torch.bfloat16)
        out[name] = {"shape": list(got32.shape), "want_shape": list(want.shape), "dtype16": str(got16.dtype),
                     "f32_max_diff": (got32 - want).abs().max().item(),
                     "bf16_max_rel_diff": ((got16.float() - want).abs() / want.abs().clamp(min=1)).max().item()}
    from datasvc.media.video import to_video_pixel_values

    for name, (spec, grids) in {"video": (VisionSpec(), [(2, 4, 6), (1, 2, 2)]),
                                "video_p14_three_frames": (VisionSpec(temporal_patch_size=3, **clip), [(2, 2, 4)])}.items():
        n = sum(t * spec.temporal_patch_size * h * w for t, h, w in grids)
        rows = torch.randint(0, 256, (n, spec.patch_dim), generator=gen, dtype=torch.uint8)
        want = torch.from_numpy(to_video_pixel_values(rows.numpy(), spec, grids))
        got32 = fused_pixel_values(rows, spec, grids, torch.float32, video=True)
        got16 = fused_pixel_values(rows, spec, grids, torch.bfloat16, video=True)
        out[name] = {"shape": list(got32.shape), "want_shape": list(want.shape), "dtype16": str(got16.dtype),
                     "f32_max_diff": (got32 - want).abs().max().item(),
                     "bf16_max_rel_diff": ((got16.float() - want).abs() / want.abs().clamp(min=1)).max().item()}
    errors = {}
    spec = VisionSpec()
    rows = torch.zeros((8, spec.patch_dim), dtype=torch.uint8)
    for name, grids in {"short": [(1, 2, 2)], "two_frames": [(2, 2, 2)], "half_window": [(1, 1, 8)]}.items():
        try:
            fused_pixel_values(rows, spec, grids, torch.float32)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    out["empty"] = list(fused_pixel_values(rows[:0], spec, [], torch.bfloat16).shape)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernel_is_usable_where_triton_runs(interpreted):
    assert interpreted["usable"] is True


@pytest.mark.parametrize("case", ["qwen3vl", "p14_clip_stats", "one_frame", "merge1_three_frames", "video",
                                  "video_p14_three_frames"])
def test_kernel_gives_the_torch_paths_pixel_values(interpreted, case):
    """Patch order, per-channel statistics, patch sizes that are not a power of two, any frame
    count and merge size, images of mixed shapes in one launch; videos (each output row's frames
    read from consecutive frames) against ``to_video_pixel_values``' numpy path."""
    r = interpreted[case]
    assert r["shape"] == r["want_shape"]
    assert r["dtype16"] == "torch.bfloat16"
    assert r["f32_max_diff"] <= 2.5e-7  # one float32 step at |x| <= 2.1
    assert r["bf16_max_rel_diff"] <= 2 ** -7  # one bfloat16 step


def test_kernel_rejects_grids_that_do_not_cover_the_rows(interpreted):
    errors = interpreted["errors"]
    assert "covers 4 rows of 8" in errors["short"]
    assert "one frame per image" in errors["two_frames"]
    assert "merge windows" in errors["half_window"]
    assert interpreted["empty"] == [0, 1536]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_kernel_on_cuda_is_what_to_pixel_values_runs():
    """On a GPU ``to_pixel_values`` takes the kernel, and its float32 values are the torch path's;
    a chunk of full-size images with a partial last program per image."""
    from datasvc.media.vision import VisionSpec, fused_kernel_usable, to_pixel_values, torch_pixel_values

    spec = VisionSpec()
    assert fused_kernel_usable(torch.device("cuda:0"))
    rng = np.random.default_rng(2)
    grids = [(1, int(h), int(w)) for h, w in rng.integers(1, 45, (16, 2)) * 2]
    rows = torch.randint(0, 256, (sum(h * w for _, h, w in grids), spec.patch_dim), dtype=torch.uint8, device="cuda")
    want = torch_pixel_values(rows, spec, grids, torch.float32)
    torch.testing.assert_close(to_pixel_values(rows, spec, grids, torch.float32), want, atol=1e-6, rtol=0)
    got16 = to_pixel_values(rows, spec, grids, torch.bfloat16)
    torch.testing.assert_close(got16.float(), want, atol=1 / 64, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_video_pixel_values_on_cuda_take_the_kernel():
    """A rank's ``pixel_values_videos``: the CUDA path (the fused kernel) gives the numpy path's values."""
    from datasvc.media.video import to_video_pixel_values
    from datasvc.media.vision import VisionSpec

    spec = VisionSpec()
    grids = [(3, 18, 32), (1, 2, 2), (5, 12, 8)]
    n = sum(t * spec.temporal_patch_size * h * w for t, h, w in grids)
    rows = torch.randint(0, 256, (n, spec.patch_dim), dtype=torch.uint8)
    want = torch.from_numpy(to_video_pixel_values(rows.numpy(), spec, grids))
    got = to_video_pixel_values(rows.cuda(), spec, grids, torch.float32)
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=0)
    got16 = to_video_pixel_values(rows.cuda(), spec, grids, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float().cpu(), want, atol=1 / 64, rtol=0)

"""Long runs on the CPU path, end to end through ``python -m trainer.run``: checkpoints, exact resume
(also at another data-parallel size), SIGTERM, evaluation, a pretrained start and its export."""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from datasvc.read.shards import index_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer(*argv, wait=True):
    cmd = [sys.executable, "-m", "trainer.run", "qwen3vl", "--seq-len", "512", *map(str, argv)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_ADDRESS=""))
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]
    return out


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny Qwen3-VL MoE saved with transformers' save_pretrained: random weights, real format."""
    from pipelines.qwen3vl.cpu_model import CpuModelConfig, build_model

    path = str(tmp_path_factory.mktemp("tiny-hf"))
    build_model(CpuModelConfig(), seed=3).save_pretrained(path)
    return path


@pytest.mark.slow
def test_stopped_and_resumed_run_trains_what_a_straight_run_trains(tmp_path, photo_shards, tiny_hf):
    """A straight 6-step run from a pretrained start, and a run stopped by SIGTERM then resumed to
    step 6: the same samples in the same order, the same losses; validation and the export work."""
    shards = photo_shards[:4]
    common = ["--train-iters", 6, "--shards", *shards, "--hf-path", tiny_hf, "--valid-shards", photo_shards[-1],
              "--eval-interval", 3, "--eval-iters", 1]
    straight = tmp_path / "straight"
    trainer(*common, "--out", straight, "--export-hf", tmp_path / "export", "--save", tmp_path / "ck-straight",
            "--keep-last", 1, "--export-hf-on-save")
    ref = lines(straight / "metrics.jsonl")
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in ref if "val_loss" in r] == [3, 6]
    assert json.loads((straight / "summary.json").read_text())["val_loss_last"] == ref[-1]["val_loss"]
    assert (straight / "loss.png").stat().st_size > 0
    assert sorted(os.listdir(tmp_path / "ck-straight")) == ["iter_0000006", "latest_checkpointed_iteration.txt"]

    # The export is a Hugging Face checkpoint of the trained weights: transformers loads it, and it
    # equals the model the last checkpoint holds (and no longer the pretrained start).
    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    exported = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "export").state_dict()
    saved = torch.load(tmp_path / "ck-straight" / "iter_0000006" / "model.pt")
    start = Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_hf).state_dict()
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported[name], saved[name]) and not torch.equal(exported[name], start[name])
    at_save = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "ck-straight" / "iter_0000006" / "hf")
    assert torch.equal(at_save.state_dict()[name], saved[name])

    resumed, ck = tmp_path / "resumed", tmp_path / "ck"
    proc = trainer(*common, "--out", resumed, "--save", ck, wait=False)
    metrics = resumed / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (metrics.exists() and len(lines(metrics)) >= 2):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-5000:]
    assert time.monotonic() - t0 < 60  # stops at the next step boundary, not at the end
    stopped = lines(metrics)
    assert 2 <= len(stopped) < 6 and stopped[-1]["exit_reason"] == "SIGTERM"
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == str(stopped[-1]["step"])

    trainer(*common, "--out", resumed, "--save", ck, "--load", ck)
    both = lines(metrics)
    assert [r["step"] for r in both] == [1, 2, 3, 4, 5, 6]
    assert [s["samples"] for s in lines(resumed / "samples.jsonl")] == [
        s["samples"] for s in lines(straight / "samples.jsonl")]
    for a, b in zip(ref, both):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed"]["step"] == stopped[-1]["step"] and not summary["resumed"]["redealt"]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_dp_size_trains_each_sample_of_the_epoch_once(tmp_path, photo_shards, before, after):
    shards = photo_shards[:2]
    want = Counter(f"{s}/{x.key}" for s in shards for x in index_shard(s).samples)
    out, ck = tmp_path / "out", tmp_path / "ck"
    common = ["--shards", *shards, "--out", out, "--save", ck, "--gbs", 2, "--train-iters", 40 // 2]
    trainer(*common, "--world-size", before, "--exit-interval", 2)
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "2"
    # To the end of the run: a sample may wait up to two blocks for a fuller row (``MAX_WAITS``), and
    # this two-shard set's blocks span many epochs, so epoch 0's last samples arrive late in the run.
    log = trainer(*common, "--world-size", after, "--load", ck)
    assert "dealt over the new ranks" in log
    trained = [tuple(s) for step in lines(out / "samples.jsonl") for s in step["samples"]]
    epoch0 = Counter(key for key, epoch in trained if epoch == 0)
    assert epoch0 == want, "every sample of the epoch, exactly once, across the two DP sizes"


def test_relative_outputs_under_a_ray_job_are_refused_or_moved(monkeypatch, tmp_path):
    from trainer.run import parse_args
    from trainer.job import resolve_outputs

    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.setenv("RAY_SUBMISSION_ID", "raysubmit_abc")
    monkeypatch.setenv("HOME", str(tmp_path))
    args = parse_args(["qwen3vl"])
    resolve_outputs(args)
    assert args.out == str(tmp_path / "vlmfeed-runs" / "raysubmit_abc")
    for flag in ("--out", "--save", "--export-hf"):
        with pytest.raises(SystemExit, match="absolute path"):
            resolve_outputs(parse_args(["qwen3vl", flag, "rel/dir"]))
    resolve_outputs(parse_args(["qwen3vl", "--save", "s3://bucket/run", "--out", str(tmp_path)]))

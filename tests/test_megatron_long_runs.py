"""Long runs on Megatron-Bridge (one GPU): a pretrained start from a Hugging Face checkpoint through
AutoBridge and its export, checked against transformers' own model; a SIGTERM saves and resumes."""
import json
import os
import signal
import time

import pytest

from test_long_runs import lines, trainer

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from pipelines.qwen3vl.cpu_model import CpuModelConfig, build_model

    path = str(tmp_path_factory.mktemp("tiny-hf"))
    build_model(CpuModelConfig(), seed=3).save_pretrained(path)
    return path


def first_loss(out):
    return lines(os.path.join(out, "metrics.jsonl"))[0]["loss"]


def test_pretrained_start_and_export_match_transformers(tmp_path, photo_shards, tiny_hf):
    """Megatron's first loss from the HF weights equals transformers' on the same micro-batch; the
    exported weights, loaded by either framework, give the same loss again."""
    data = ["--shards", *photo_shards[:4], "--max-pixels", 65536, "--world-size", 1, "--seq-len", 1024,
            "--fit", "off", "--warmup-iters", 0]
    export = tmp_path / "export"
    trainer(*data, "--backend", "megatron", "--hf-path", tiny_hf, "--train-iters", 3, "--export-hf", export,
            "--out", tmp_path / "mg-start")
    assert (export / "config.json").exists()
    trainer(*data, "--backend", "cpu", "--hf-path", tiny_hf, "--train-iters", 1, "--out", tmp_path / "hf-start")
    trainer(*data, "--backend", "megatron", "--hf-path", export, "--train-iters", 1, "--out", tmp_path / "mg-export")
    trainer(*data, "--backend", "cpu", "--hf-path", export, "--train-iters", 1, "--out", tmp_path / "hf-export")
    start = (first_loss(tmp_path / "mg-start"), first_loss(tmp_path / "hf-start"))
    exported = (first_loss(tmp_path / "mg-export"), first_loss(tmp_path / "hf-export"))
    assert abs(start[0] - start[1]) < 0.02 * start[1], start  # bf16 against fp32
    assert abs(exported[0] - exported[1]) < 0.02 * exported[1], exported
    assert abs(exported[1] - start[1]) > 1e-3 * start[1], "the export holds the trained weights, not the start"


def test_sigterm_saves_and_the_run_resumes(tmp_path, photo_shards, tiny_hf):
    data = ["--shards", *photo_shards[:4], "--max-pixels", 65536, "--world-size", 1, "--seq-len", 1024,
            "--fit", "off", "--backend", "megatron", "--hf-path", tiny_hf, "--train-iters", 400]
    out, ck = tmp_path / "out", tmp_path / "ck"
    proc = trainer(*data, "--out", out, "--save", ck, wait=False)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (metrics.exists() and len(lines(metrics)) >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text[-5000:]
    stopped = lines(metrics)
    step = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= step < 400 and stopped[-1]["step"] == step and stopped[-1]["exit_reason"] == "SIGTERM"
    trainer(*data[:-1], step + 2, "--out", out, "--save", ck, "--load", ck)
    assert [r["step"] for r in lines(metrics)][-2:] == [step + 1, step + 2]
    assert json.loads((out / "summary.json").read_text())["resumed"]["step"] == step

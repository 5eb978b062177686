"""Trainer orchestration: rank layout, packed-row splitting, and the whole job under `ray job submit`."""
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from datasvc.service.cluster import local_auth_env
from trainer.workers import RankLayout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rank_layout_groups_model_parallel_ranks_into_dp_replicas():
    world, tp, cp, pp = 16, 2, 2, 2
    layouts = [RankLayout(r, world, tp, cp, pp) for r in range(world)]
    assert {l.dp_size for l in layouts} == {2}
    replicas = {}
    for l in layouts:
        replicas.setdefault(l.dp_rank, []).append(l.consumer)
    # each replica has tp*cp*pp distinct consumers 0..7
    assert all(sorted(c) == list(range(8)) for c in replicas.values())
    # Megatron order tp -> cp -> dp -> pp: ranks 0..3 are replica 0, 4..7 replica 1
    assert [l.dp_rank for l in layouts[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_split_samples_restores_each_sample(photo_shards, qwen3vl, cpu_decoder):
    from datasvc.media.vision import to_pixel_values
    from datasvc.pack.packing import PackingConfig, pack
    from datasvc.read.shards import index_shard
    from datasvc.stream.process import process_item
    from datasvc.stream.tensors import batch_tensors
    from datasvc.wire import WorkItem
    from trainer.cpu_backend import split_samples

    idx = index_shard(photo_shards[0])
    res = process_item(WorkItem(photo_shards[0], 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
    batches, _ = pack(res.samples, PackingConfig(seq_len=8192, micro_batch_size=2, pad_id=qwen3vl.pad_id), 768)
    by_key = {f"{s.shard}/{s.key}": s for s in res.samples}
    for b in batches:
        parts = split_samples(batch_tensors(b, qwen3vl.vision), qwen3vl.tokens.image_pad, qwen3vl.video_pad)
        assert len(parts) == len(b.sample_keys)
        for part, key in zip(parts, b.sample_keys):
            s = by_key[key]
            assert part["input_ids"].tolist() == s.input_ids.tolist()
            assert np.allclose(part["pixel_values"].numpy(), to_pixel_values(s.pixels, qwen3vl.vision, s.image_grid_thw))
            assert part["image_grid_thw"].tolist() == s.image_grid_thw.tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_job_submit_trains_on_cpu(tmp_path, photo_shards):
    venv_bin = os.path.dirname(sys.executable)
    # Ray 2.60 token auth: the cluster and the job client agree on the mode and hold the same token
    # (given here, not left to whatever an earlier test put in this process's environment).
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ["PATH"], RAY_ADDRESS="", **local_auth_env())
    env.pop("RAY_ADDRESS")
    import ray

    if ray.is_initialized():  # one cluster at a time on a 2-core CI box
        ray.shutdown()
    # Every port of this cluster picked free: the dashboard agent's default listen port (52365) is
    # taken whenever another Ray cluster runs on the machine, and the job server then never finds
    # an agent to submit to.
    port, dash, agent = _free_port(), _free_port(), _free_port()
    ray_bin = os.path.join(venv_bin, "ray")
    temp = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # AF_UNIX socket paths must stay short
    # --block in its own session: the test stops exactly this cluster (not `ray stop`, which would
    # kill every Ray cluster on the machine).
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
                             f"--dashboard-agent-listen-port={agent}",
                             "--num-cpus=6", f"--temp-dir={temp}"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "run"
    try:
        for _attempt in range(40):  # the job server and its agent come up after the head
            job = subprocess.run(
                [ray_bin, "job", "submit", f"--address=http://127.0.0.1:{dash}", f"--working-dir={REPO}", "--",
                 "python", "-m", "trainer.run", "qwen3vl", "--train-iters", "12", "--seq-len", "512",
                 "--out", str(out), "--shards", *photo_shards],
                env=env, capture_output=True, text=True, timeout=900)
            text = job.stderr + job.stdout
            if "No available agent" not in text and "Failed to connect" not in text and "Connection refused" not in text:
                break
            time.sleep(3)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=30)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        shutil.rmtree(temp, ignore_errors=True)  # Ray's session logs, several MB a run
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    assert "CPU development path" in job.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["loss_finite"] and summary["loss_fell"]
    assert summary["tokens_per_s"] > 0 and 0 <= summary["data_wait_share"] <= 1
    assert summary["chain_blocks"] > 1  # trained on blocks packed in chains, trainer.run's default
    trained = summary["trained"]  # what was trained, as the run resolved it
    assert trained["model"]["pipeline"] == "qwen3vl" and trained["train"]["seq_len"] == 512  # as the job asked
    acct = summary["data_accounting"]
    # The job stops mid-stream: the rest of the block a rank's producer is handing out, and the rows
    # its chain holds, are read but neither delivered nor rejected yet: counted as in flight.
    assert acct["delivered"] > 0 and acct["read"] == (acct["delivered"] + sum(acct["quarantined"].values())
                                                      + sum(acct["skipped_by_rule"].values()) + acct["in_flight"]), acct
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and all("data_wait_s" in l and "tokens_per_s" in l for l in lines)
    # Two DP ranks: each step's straggler ratio is max / mean of the ranks' own compute seconds.
    for line in lines:
        compute = line["rank_compute_s"]
        assert len(compute) == 2 and len(line["rank_vision_patches"]) == 2 and min(line["rank_vision_patches"]) > 0
        assert line["straggler_ratio"] == pytest.approx(max(compute) / (sum(compute) / 2), rel=1e-2, abs=2e-3)
    assert summary["straggler_ratio"] >= 1.0
    # The machines that trained it, per host: both ranks here, the CPU and the stack's versions.
    (host,) = summary["machines"]
    assert host["ranks"] == [0, 1] and host["cores"] >= 1 and host["cpu"] and host["software"]["torch"]


@pytest.mark.parametrize("flag", ["--chain-blocks", "--block-micro-batches", "--items-per-block"])
def test_bad_block_options_fail_before_ray_starts(flag, capsys):
    from trainer.run import main

    with pytest.raises(SystemExit):
        main(["qwen3vl", flag, "0", "--address", "ray://nowhere.invalid:1"])
    assert f"argument {flag}: must be >= 1, not 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,why", [("--video-fps", "0", "must be a number > 0, not 0"),
                                            ("--video-fps", "nan", "must be a number > 0, not nan"),
                                            ("--video-max-pixels", "0", "must be >= 1, not 0")])
def test_bad_video_options_fail_before_ray_starts(flag, value, why, capsys):
    from trainer.run import main

    with pytest.raises(SystemExit):
        main(["qwen3vl", flag, value, "--address", "ray://nowhere.invalid:1"])
    assert f"argument {flag}: {why}" in capsys.readouterr().err


def test_video_options_reach_the_pipeline():
    from datasvc.registry import get_pipeline
    from trainer.job import data_config, trainer_config
    from trainer.run import parse_args

    args = parse_args(["qwen3vl", "--video-fps", "1", "--video-max-pixels", str(2 ** 20), "--items-per-block", "2"])
    cfg, world = trainer_config(args, "cpu", 0)
    data_cfg, _ = data_config(args, cfg, "cpu", world, 0.25)
    video = get_pipeline("qwen3vl", **data_cfg.pipeline_options).video
    assert (video.fps, video.max_pixels) == (1.0, 2 ** 20)
    assert data_cfg.pipeline_options["max_pixels"] == 256 * 256  # the CPU trainer's cap


def test_megatron_knobs_on_the_cpu_path_are_refused_not_ignored():
    import pytest

    from trainer.job import trainer_config
    from trainer.run import parse_args

    args = parse_args(["qwen3vl", "--cuda-graph-scope", "moe_router", "--moe-dispatcher", "flex", "--mbs", "2"])
    with pytest.raises(SystemExit) as stop:
        trainer_config(args, "cpu", 0)
    message = str(stop.value)
    assert "--cuda-graph-scope --moe-dispatcher: Megatron-Bridge knobs" in message and "\n" not in message
    assert "--mbs" not in message
    cfg, _ = trainer_config(parse_args(["qwen3vl", "--padded", "--mbs", "2"]), "cpu", 0)  # data-side: kept
    assert cfg.train.padded and cfg.train.mbs == 2


def test_gpu_decode_shares_never_overcommit_a_gpu():
    import pytest

    from trainer.job import gpu_shares

    assert gpu_shares("cpu", "megatron", 8, 8, 4)[0] == 1.0
    for world, dp, max_actors in ((1, 1, 8), (8, 8, 2), (8, 2, 3), (2, 1, 1)):
        rank, actor = gpu_shares("gpu", "megatron", world, dp, max_actors)
        assert rank > 0.5  # two ranks can never be placed on one GPU
        assert abs(world * rank + dp * max_actors * actor - world) < 1e-9  # every actor fits, nothing left over
    with pytest.raises(SystemExit, match="--decode cpu"):
        gpu_shares("gpu", "cpu", 2, 2, 2)


@pytest.mark.parametrize("before, expandable, after", [
    (None, False, None),
    (None, True, "expandable_segments:True"),
    ("garbage_collection_threshold:0.8", True, "garbage_collection_threshold:0.8,expandable_segments:True"),
    ("garbage_collection_threshold:0.8", False, "garbage_collection_threshold:0.8"),  # the driver's passes on
    ("expandable_segments:False", True, "expandable_segments:False"),  # the user's explicit choice stands
])
def test_rank_env_sets_the_allocator_before_cuda_starts(monkeypatch, before, expandable, after):
    from trainer.job import rank_env

    if before is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", before)
    assert rank_env(expandable).get("PYTORCH_CUDA_ALLOC_CONF") == after
    # CUDA graphs under expandable segments: Megatron-Core captures only with NCCL's graph registration off.
    assert rank_env(expandable, cuda_graphs=True).get("NCCL_GRAPH_REGISTER") == (
        "0" if after and "expandable_segments:True" in after else None)


def test_worker_group_starts_ranks_with_its_env(ray_local):
    from trainer.workers import WorkerGroup

    group = WorkerGroup(2, use_gpu=False, cpus_per_rank=0.1, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        assert group.run_all(os.getenv, [("PYTORCH_CUDA_ALLOC_CONF",)] * 2) == ["expandable_segments:True"] * 2
        (host,) = group.machines  # both ranks on this host, recorded once
        assert host["ranks"] == [0, 1] and host["host"] == platform.node() and host["gpus"] == []
    finally:
        group.shutdown()


def test_machines_fold_per_host_with_each_gpu_once():
    from trainer.workers import by_host

    gpu = {"name": "H200", "uuid": "GPU-a"}
    facts = [{"host": "a", "gpus": [gpu]}, {"host": "b", "gpus": []}, {"host": "a", "gpus": [gpu, {"uuid": "GPU-b"}]}]
    a, b = by_host(facts)
    assert (a["ranks"], b["ranks"]) == ([0, 2], [1])
    assert a["gpus"] == [gpu, {"uuid": "GPU-b"}] and b["gpus"] == []


def test_a_stopped_stream_counts_every_sample_read_restored_or_not(photo_shards):
    """read == delivered + quarantined + skipped + in_flight at any micro-batch of a chained stream,
    from the start and from a position restored in the middle of a chain."""
    from datasvc.config import ServiceConfig
    from datasvc.stream.producer import BlockProducer

    cfg = ServiceConfig(shards=tuple(photo_shards), seq_len=128, samples_per_item=4, items_per_block=3,
                        chain_blocks=3, epochs=None, blocks_span_epochs=True,
                        pipeline_options={"min_pixels": 32 * 32, "max_pixels": 64 * 64})

    def balanced(producer):
        s = producer.stats()
        return s.accounting.balanced(s.in_flight)

    producer = BlockProducer(cfg)
    positions, in_flight_seen = [], 0
    for _, pos in zip(range(9), producer.micro_batches()):
        assert balanced(producer), producer.stats().accounting
        in_flight_seen = max(in_flight_seen, producer.stats().in_flight)
        positions.append(producer.position())
    assert in_flight_seen > 0  # stopped mid-stream, with samples read and not handed out
    restored = BlockProducer(cfg, start=positions[4])
    for _ in zip(range(3), restored.micro_batches()):
        assert balanced(restored), restored.stats().accounting


def test_the_cpu_development_preset_yields_to_the_flags_given():
    from trainer.config import CPU_DEVELOPMENT, TrainConfig

    gpu = TrainConfig()
    cpu = gpu.for_cpu_development(set())
    assert (cpu.seq_len, cpu.train_iters, cpu.lr) == (CPU_DEVELOPMENT["seq_len"], CPU_DEVELOPMENT["train_iters"],
                                                      CPU_DEVELOPMENT["lr"])
    assert cpu.seq_len < gpu.seq_len and cpu.mbs == gpu.mbs  # the rest stays as configured
    mine = TrainConfig(seq_len=2048, lr=3e-4).for_cpu_development({"--seq-len", "--lr"})
    assert (mine.seq_len, mine.lr, mine.train_iters) == (2048, 3e-4, CPU_DEVELOPMENT["train_iters"])

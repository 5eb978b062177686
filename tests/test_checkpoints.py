"""Checkpoint files and what the driver decides from them, without Ray: the CPU path's save and load
on a real S3-compatible server (moto's, on 127.0.0.1), pruning, and the resume decisions (exact,
dealt anew at another DP size, refused on changed data)."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from datasvc.config import ServiceConfig
from datasvc.pack.epoch import dataset_fingerprint
from trainer.checkpoint import commit, iter_name, latest_step, load_cpu, read_saved_run, save_cpu
from trainer.config import TrainerConfig
from trainer.lifecycle import resume_from


def _parts(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _save_and_load(root: str):
    model, opt, sched = _parts(0)
    for step in (2, 4, 6):
        save_cpu(root, step, rank=0, dp_rank=0, model=model, optimizer=opt, scheduler=sched,
                 loader_state={"step": step, "epoch": 0})
        commit(root, step, keep_last=2)
    assert latest_step(root) == 6
    saved = read_saved_run(root)
    assert saved.step == 6 and saved.dp_size == 1 and saved.loader[0]["step"] == 6
    other, opt2, sched2 = _parts(1)
    load_cpu(root, 6, rank=0, model=other, optimizer=opt2, scheduler=sched2)
    assert torch.equal(other.weight, model.weight)
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_cpu_checkpoints_save_load_and_keep_the_newest(tmp_path):
    root = str(tmp_path / "ck")
    _save_and_load(root)
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_cpu_checkpoints_on_s3(tmp_path):
    moto_server = pytest.importorskip("moto.server")
    import boto3
    import s3fs

    from test_storage import free_port

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server._port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="runs")
        _save_and_load("s3://runs/job1/ck")
        keys = {o["Key"] for o in boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).list_objects_v2(
            Bucket="runs")["Contents"]}
        assert not any(iter_name(2) in k for k in keys) and any(iter_name(6) in k for k in keys)
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _checkpoint(root, data_cfg: ServiceConfig, paths, dp: int):
    d = os.path.join(root, iter_name(3), "loader")
    os.makedirs(d)
    for r in range(dp):
        state = {"fingerprint": data_cfg.fingerprint(), "dp_rank": r, "epoch": 0, "block": 1, "batch": 0,
                 "step": 3, "dataset": dataset_fingerprint(paths), "trained": {}}
        with open(os.path.join(d, f"dp{r:03d}.json"), "w") as f:
            json.dump(state, f)
    commit(root, 3, None)


def test_resume_decisions(tmp_path, photo_shards):
    paths = [shutil.copy(p, tmp_path) for p in photo_shards[:2]]
    data_cfg = ServiceConfig(shards=tuple(paths), dp_size=2, seq_len=512, blocks_span_epochs=True, epochs=None)
    root = str(tmp_path / "ck")
    _checkpoint(root, data_cfg, paths, dp=2)
    cfg = TrainerConfig()
    cfg.checkpoint.load = root
    cfg.train.train_iters = 10

    same, resume = resume_from(cfg, data_cfg)
    assert resume.step == 3 and not resume.redealt and sorted(resume.loader) == [0, 1]
    fewer, resume = resume_from(cfg, dataclasses.replace(data_cfg, dp_size=1))
    assert resume.redealt and not resume.loader and fewer.remainder["first_epoch"] == 0
    with pytest.raises(SystemExit, match="other data settings"):
        resume_from(cfg, dataclasses.replace(data_cfg, seq_len=1024))
    cfg.train.train_iters = 3
    with pytest.raises(SystemExit, match="raise --train-iters"):
        resume_from(cfg, data_cfg)
    cfg.train.train_iters = 10
    with open(paths[1], "ab") as f:
        f.write(b"\0" * 1024)
    with pytest.raises(SystemExit, match="rewritten"):
        resume_from(cfg, data_cfg)
    cfg.checkpoint.load = str(tmp_path / "empty")
    assert resume_from(cfg, data_cfg) == (data_cfg, None)

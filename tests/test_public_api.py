"""The public Python API as the README shows it: its code blocks run as written, the torchrun recipe
gives every rank its own stream of one service, and a rank with no feeder fails saying why."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_python_blocks(section: str) -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    body = text.split(f"### {section}\n", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_importing_the_package_loads_neither_ray_nor_torch():
    code = ("import sys, datasvc; assert callable(datasvc.for_training); "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unknown_names_are_attribute_errors():
    import datasvc

    with pytest.raises(AttributeError, match="no attribute 'EpochPlan'"):
        datasvc.EpochPlan


@pytest.mark.parametrize("block", range(2))
def test_the_readme_python_examples_run_as_written(block):
    code = readme_python_blocks("Use it from Python")[block]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp")})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [int(line.split()[0]) for line in lines] == [0, 1, 2], out.stdout
    assert all("(2, 1024)" in line for line in lines)  # MBS 2 rows of the CPU trainer's sequence length


def test_a_client_without_a_feeder_fails_naming_what_to_check(photo_shards, ray_local):
    from datasvc import DataClient, DataServiceError, attach, for_training

    cfg = for_training(photo_shards, items_per_block=2)
    with pytest.raises(DataServiceError, match="no feeder for dp_rank 0 of run 'nobody'.*namespace 'vlmfeed'"):
        attach(cfg, 0, run="nobody", wait_s=1)
    client = DataClient(cfg, 0, run="nobody", output="numpy")
    with pytest.raises(DataServiceError, match="no feeder for dp_rank 0 of run 'nobody'"):
        next(client)
    client.close()


def test_torchrun_ranks_each_take_their_own_stream_of_one_service(photo_shards):
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    temp_dir = tempfile.mkdtemp(prefix="vtr", dir="/tmp")  # short: raylet socket paths are limited
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False,
                                                         "temp_dir": temp_dir})
    try:
        env = {**os.environ, "RAY_ADDRESS": head.address, "STEPS": "3"}
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               os.path.join(ROOT, "docs", "examples", "torchrun_ranks.py"), *photo_shards]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    finally:
        head.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    # two ranks print to one pipe, so a record may share a line with the other rank's
    decoder = json.JSONDecoder()
    records = [decoder.raw_decode(out.stdout, m.start())[0] for m in re.finditer(r'\{"rank": ', out.stdout)]
    by_rank = {r: [x for x in records if x["rank"] == r] for r in (0, 1)}
    assert [len(by_rank[r]) for r in (0, 1)] == [3, 3]
    drawn = [{(e, k) for x in by_rank[r] for e, k in zip(x["epochs"], x["keys"])} for r in (0, 1)]
    assert drawn[0] and drawn[1] and not drawn[0] & drawn[1]  # no sample of an epoch on both ranks

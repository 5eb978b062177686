"""The embedded job listens on loopback only, and starts whatever ~/.ray/auth_token holds.

A fresh process (as ``python -m trainer.run`` would be) with a HOME whose ~/.ray/auth_token is
junk from another cluster starts the embedded cluster and a short data service, then lists the
listening sockets of itself and every process under it (GCS, raylet, agents, workers, the feeder
and its preprocessing actor): each must be on 127.0.0.0/8 or ::1.
"""
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = r"""
import json, os, sys, uuid
import psutil, ray
from datasvc.config import PoolConfig, ServiceConfig
from datasvc.service.client import DataService
from datasvc.service.cluster import connect

shards, temp = sys.argv[1:-1], sys.argv[-1]
connect(num_cpus=2, object_store_memory=200 * 2**20, temp_dir=temp)
cfg = ServiceConfig(shards=tuple(shards), seq_len=256, samples_per_item=4, items_per_block=2, epochs=None,
                    pipeline_options={"min_pixels": 32 * 32, "max_pixels": 128 * 128}, pool=PoolConfig(max_actors=1))
svc = DataService(cfg, run=f"l{uuid.uuid4().hex[:6]}")
client = svc.client(0, output="numpy")
batches = sum(1 for _ in zip(range(4), client))
me = psutil.Process()
listening = []
for p in [me] + me.children(recursive=True):
    try:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.append([c.laddr.ip, c.laddr.port, p.name(), " ".join(p.cmdline())[:80]])
    except psutil.Error:
        pass
print("RESULT " + json.dumps({"batches": batches, "listening": listening, "processes": len(me.children(recursive=True)),
                              "node_ip": ray.util.get_node_ip_address()}))
client.close()
svc.shutdown()
ray.shutdown()
"""


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if getattr(addr, "ipv4_mapped", None) is not None:  # ::ffff:127.0.0.1, a dual-stack socket's view
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_embedded_job_listens_on_loopback_only_whatever_the_token_file_holds(tmp_path, photo_shards):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token_file = home / ".ray" / "auth_token"
    token_file.write_text("junk-token-left-by-another-cluster\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "VLMFEED_RAY_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX"))}
    env.update(HOME=str(home), PYTHONPATH=REPO)
    temp = tempfile.mkdtemp(prefix="vl", dir="/tmp")  # AF_UNIX socket paths must stay short
    try:
        proc = subprocess.run([sys.executable, "-c", JOB, *photo_shards, temp], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["batches"] == 4 and result["node_ip"] == "127.0.0.1"
    listening = result["listening"]
    names = {name for _, _, name, _ in listening}
    assert len(listening) >= 5 and {"gcs_server", "raylet"} <= names, listening  # the sockets were seen
    beyond = [s for s in listening if not is_loopback(s[0])]
    assert not beyond, f"listening beyond loopback: {beyond}"
    assert token_file.read_text() == "junk-token-left-by-another-cluster\n"  # neither used nor replaced


def test_loopback_check_itself():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not any(is_loopback(ip) for ip in ("0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1"))


JOIN = r"""
import os, sys
import ray
from datasvc.service.cluster import connect

connect(sys.argv[1])
print("RESULT", ray.get(ray.remote(lambda: os.getpid()).remote()) > 0)
ray.shutdown()
"""


def test_a_driver_joins_a_cluster_that_ray_start_gave_the_token_file(tmp_path):
    """``ray start`` with a token in ~/.ray/auth_token (here junk, left by another run) starts a
    cluster that wants it; a driver joining with connect(address) agrees with it."""
    import signal
    import socket
    import time

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("junk-token-left-by-another-cluster\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "VLMFEED_RAY_TOKEN"))}
    env.update(HOME=str(home), PYTHONPATH=REPO, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="vj", dir="/tmp")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--include-dashboard=false", "--num-cpus=1", f"--temp-dir={temp}"], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(60):  # the GCS comes up after a few seconds
            proc = subprocess.run([sys.executable, "-c", JOIN, f"127.0.0.1:{port}"], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=300)
            if "RESULT" in proc.stdout or "Authentication" in proc.stderr:
                break
            time.sleep(2)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=30)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        shutil.rmtree(temp, ignore_errors=True)
    assert "RESULT True" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def _listening_tree(pid: int, seen: dict) -> None:
    """Add the listening sockets of ``pid`` and every process under it to ``seen``."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    seen.setdefault((c.laddr.ip, c.laddr.port), [p.name(), " ".join(p.cmdline())[:100]])
        except psutil.Error:
            pass


def test_embedded_training_job_listens_on_loopback_only(tmp_path, photo_shards):
    """``python -m trainer.run qwen3vl`` on CPU with the embedded cluster: every socket that any of
    its processes (the driver, Ray's GCS, raylet, agents and workers, the trainer ranks with their
    torch rendezvous and Gloo, the data service) listens on while it trains is on loopback."""
    import time

    from trainer.workers import PORT_RANGE

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("junk-token-left-by-another-cluster\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "VLMFEED_RAY_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX"))}
    temp = tempfile.mkdtemp(prefix="vt", dir="/tmp")  # the cluster's temp dir under it: AF_UNIX paths stay short
    env.update(HOME=str(home), PYTHONPATH=REPO, TMPDIR=temp)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.run", "qwen3vl", "--train-iters", "3", "--seq-len", "512",
           "--out", str(out), "--shards", *photo_shards]
    seen: dict = {}
    log = open(tmp_path / "job.log", "w+")
    job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while job.poll() is None and time.time() < deadline:
            _listening_tree(job.pid, seen)
            time.sleep(0.5)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
        job.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
    log.seek(0)
    text = log.read()
    assert job.returncode == 0, text[-4000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    names = {name for name, _ in seen.values()}
    assert {"gcs_server", "raylet"} <= names, seen  # Ray's processes were sampled
    rendezvous = [s for s in seen if PORT_RANGE[0] <= s[1] < PORT_RANGE[1]]
    assert rendezvous, seen  # and the ranks' rendezvous store while they trained
    beyond = {s: p for s, p in seen.items() if not is_loopback(s[0])}
    assert not beyond, f"listening beyond loopback: {beyond}"

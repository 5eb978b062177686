"""The deployment files of docs/deploy.md: the Slurm script parses and its ``ray start`` lines make a
cluster of two nodes here; the KubeRay manifest has the fields the ray.io/v1 RayJob CRD defines."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "docs" / "deploy" / "slurm.sbatch"
RAYJOB = ROOT / "docs" / "deploy" / "rayjob.yaml"
DEPLOY_MD = ROOT / "docs" / "deploy.md"

# The ray.io/v1 RayJob CRD (KubeRay 1.1-1.4, ray-operator/config/crd/bases/ray.io_rayjobs.yaml), the
# fields a manifest sets: type, then for objects the known fields (others are an error) and the required.
STR, INT, BOOL, MAP_STR = "string", "integer", "boolean", "map of strings"
POD_TEMPLATE = {"type": "object", "fields": {"metadata": {"type": "object"}, "spec": {
    "type": "object", "required": ["containers"], "open": True, "fields": {
        "containers": {"type": "array", "items": {"type": "object", "required": ["name", "image"], "open": True}},
        "volumes": {"type": "array"}, "restartPolicy": {"type": STR}}}}}
GROUP_COMMON = {"rayStartParams": {"type": MAP_STR}, "template": POD_TEMPLATE}
HEAD_GROUP = {"type": "object", "required": ["template"], "fields": {
    **GROUP_COMMON, "serviceType": {"type": STR, "enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "headService": {"type": "object"}, "enableIngress": {"type": BOOL}}}
WORKER_GROUP = {"type": "object", "required": ["groupName", "template"], "fields": {
    **GROUP_COMMON, "groupName": {"type": STR}, "replicas": {"type": INT}, "minReplicas": {"type": INT},
    "maxReplicas": {"type": INT}, "numOfHosts": {"type": INT}, "idleTimeoutSeconds": {"type": INT},
    "suspend": {"type": BOOL}, "scaleStrategy": {"type": "object"}}}
CLUSTER_SPEC = {"type": "object", "required": ["headGroupSpec"], "fields": {
    "rayVersion": {"type": STR}, "enableInTreeAutoscaling": {"type": BOOL}, "autoscalerOptions": {"type": "object"},
    "headServiceAnnotations": {"type": MAP_STR}, "headGroupSpec": HEAD_GROUP, "suspend": {"type": BOOL},
    "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP}, "gcsFaultToleranceOptions": {"type": "object"},
    "managedBy": {"type": STR}}}
RAYJOB_SCHEMA = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "fields": {
    "apiVersion": {"type": STR, "enum": ["ray.io/v1"]}, "kind": {"type": STR, "enum": ["RayJob"]},
    "metadata": {"type": "object", "required": ["name"], "open": True},
    "spec": {"type": "object", "required": ["entrypoint"], "fields": {
        "entrypoint": {"type": STR}, "runtimeEnvYAML": {"type": STR}, "jobId": {"type": STR},
        "metadata": {"type": MAP_STR}, "shutdownAfterJobFinishes": {"type": BOOL},
        "ttlSecondsAfterFinished": {"type": INT}, "activeDeadlineSeconds": {"type": INT},
        "backoffLimit": {"type": INT}, "rayClusterSpec": CLUSTER_SPEC, "clusterSelector": {"type": MAP_STR},
        "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": {"type": "object"},
        "submissionMode": {"type": STR, "enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
        "entrypointNumCpus": {"type": "number"}, "entrypointNumGpus": {"type": "number"},
        "entrypointResources": {"type": STR}, "suspend": {"type": BOOL}, "managedBy": {"type": STR},
        "deletionStrategy": {"type": "object"}}}}}
PY_TYPES = {STR: str, INT: int, BOOL: bool, "number": (int, float), "object": dict, "array": list, MAP_STR: dict}


def problems(value, schema, path="") -> list[str]:
    """What in ``value`` does not match ``schema`` (empty: it matches)."""
    kind = schema["type"]
    if not isinstance(value, PY_TYPES[kind]) or (kind == INT and isinstance(value, bool)):
        return [f"{path or '.'}: expected {kind}, got {type(value).__name__}"]
    out = []
    if kind == MAP_STR:
        out += [f"{path}.{k}: values must be strings (quote them)" for k, v in value.items() if not isinstance(v, str)]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not one of {schema['enum']}")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            out += problems(item, schema["items"], f"{path}[{i}]")
    if kind == "object":
        fields = schema.get("fields", {})
        out += [f"{path}.{k}: required" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in fields:
                out += problems(v, fields[k], f"{path}.{k}")
            elif fields and not schema.get("open"):
                out.append(f"{path}.{k}: not a field of the CRD")
    return out


def test_the_rayjob_manifest_has_the_crd_fields():
    docs = list(yaml.safe_load_all(RAYJOB.read_text()))
    job = next(d for d in docs if d.get("kind") == "RayJob")
    assert problems(job, RAYJOB_SCHEMA) == []
    spec = job["spec"]
    assert spec["entrypoint"].startswith("python -m trainer.run qwen3vl")
    assert "s3://" in spec["entrypoint"]
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["rayStartParams"]["num-gpus"] == "8" and "object-store-memory" in workers["rayStartParams"]
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    for template in (spec["rayClusterSpec"]["headGroupSpec"]["template"], workers["template"],
                     spec["submitterPodTemplate"]):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"]
    assert any(d.get("kind") == "NetworkPolicy" for d in docs)


def test_the_schema_check_catches_what_the_crd_rejects():
    job = yaml.safe_load(RAYJOB.read_text().split("\n---")[0])
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 8
    job["spec"]["entrypont"] = "typo"
    del job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    found = problems(job, RAYJOB_SCHEMA)
    assert any("num-gpus: values must be strings" in p for p in found)
    assert any("entrypont: not a field" in p for p in found)
    assert any("headGroupSpec.template: required" in p for p in found)


def test_the_slurm_script_parses():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for needed in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN_PATH", "--object-store-memory", "--num-gpus",
                   "--node-ip-address", "ray job submit", "python -m trainer.run qwen3vl"):
        assert needed in text, needed


def test_the_doc_shows_the_submit_line_and_both_files():
    text = DEPLOY_MD.read_text()
    assert "ray job submit --working-dir . -- python -m trainer.run qwen3vl" in text
    assert "docs/deploy/rayjob.yaml" in text and "docs/deploy/slurm.sbatch" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports() -> dict[str, str]:
    names = ("NODE_MANAGER_PORT", "OBJECT_MANAGER_PORT", "METRICS_PORT", "AGENT_GRPC_PORT", "AGENT_HTTP_PORT",
             "RUNTIME_ENV_AGENT_PORT")
    return {n: str(_free_port()) for n in names}


def _pids_using(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_the_scripts_ray_start_lines_make_a_two_node_cluster():
    """Source the script (defines start_head/start_worker, runs nothing), start a head and a worker with
    its flags on this machine (own temp dir, free ports, token auth), count the nodes with the token,
    see a wrong token refused, then end only the processes of this cluster (by pid: ``ray stop``
    would stop every Ray on the machine)."""
    tmp = tempfile.mkdtemp(prefix="vdp", dir="/tmp")
    token = Path(tmp, "token")
    token.write_text(os.urandom(32).hex())
    bindir = os.path.dirname(sys.executable)
    # An embedded cluster started earlier in this process (conftest's ``ray_local``) leaves its
    # single-machine mode and token in the environment; the script's cluster is a cluster of its own.
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "VLMFEED_RAY_TOKEN", "RAY_ADDRESS")
                 and not k.startswith("RAY_AUTH")}
    env = {**inherited, "PATH": bindir + os.pathsep + os.environ["PATH"], "RAY_TMP": tmp, "GPUS_PER_NODE": "0",
           "CPUS_PER_NODE": "1", "OBJECT_STORE_BYTES": str(80 << 20), "TOKEN_FILE": str(token),
           "RAY_PORT": str(_free_port()), "DASHBOARD_PORT": str(_free_port()), "RAY_USAGE_STATS_ENABLED": "0"}
    head = {**_node_ports(), "MIN_WORKER_PORT": "21000", "MAX_WORKER_PORT": "21099"}
    worker = {**_node_ports(), "MIN_WORKER_PORT": "21100", "MAX_WORKER_PORT": "21199"}
    sh = (f"source {SBATCH} && "
          + " ".join(f"{k}={v}" for k, v in head.items()) + " start_head 127.0.0.1 --include-dashboard=false && "
          + " ".join(f"{k}={v}" for k, v in worker.items()) + " start_worker 127.0.0.1 127.0.0.1")
    try:
        started = subprocess.run(["bash", "-c", sh], env=env, capture_output=True, text=True, timeout=240)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        count = subprocess.run(
            [sys.executable, "-c", "import ray; ray.init(address='127.0.0.1:%s', _node_ip_address='127.0.0.1', "
             "logging_level='ERROR'); print('NODES', sum(n['Alive'] for n in ray.nodes()))" % env["RAY_PORT"]],
            env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)},
            capture_output=True, text=True, timeout=120)
        assert re.search(r"^NODES 2$", count.stdout, re.M), count.stdout[-2000:] + count.stderr[-2000:]
        no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        try:
            refused = subprocess.run(count.args, env={**no_token, "RAY_AUTH_MODE": "token",
                                                      "RAY_AUTH_TOKEN": "0" * 64}, capture_output=True,
                                     text=True, timeout=60)
            assert "NODES" not in refused.stdout, "a client with a wrong token was let in"
            assert "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
        except subprocess.TimeoutExpired:
            pass  # still refused: the client waits for a connection it never gets
    finally:
        for _ in range(3):
            for pid in _pids_using(tmp):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        shutil.rmtree(tmp, ignore_errors=True)
    assert _pids_using(tmp) == []


def documented_command_lines(program: str) -> list[tuple[str, str]]:
    """(where, the arguments after ``program``) for each command line the docs show in a code block,
    the Slurm script runs, or the manifest's entrypoint holds; shell variables take the script's
    defaults (and its header's example for TRAIN_ARGS)."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("    ") and program in line:
                text = line
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                found.append((f"{doc.name}:{i + 1}", text.split(program, 1)[1]))
    entry = next(d for d in yaml.safe_load_all(RAYJOB.read_text()) if d["kind"] == "RayJob")["spec"]["entrypoint"]
    if program in entry:
        found.append(("rayjob.yaml entrypoint", entry.split(program, 1)[1]))
    script = SBATCH.read_text()
    call = re.search(re.escape(program) + r"(.*?)(?<!\\)\n", script, re.S).group(1).replace("\\\n", " ")
    defaults = dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', script))
    example = re.search(r'TRAIN_ARGS="([^"]*)"', script).group(1)
    for name, train_args in (("default", defaults["TRAIN_ARGS"]), ("header example", example)):
        text = re.sub(r'"?\$\{?(\w+)\}?"?', lambda m: train_args if m.group(1) == "TRAIN_ARGS" else
                      defaults.get(m.group(1), "/x"), call)
        found.append((f"slurm.sbatch ({name} TRAIN_ARGS)", text))
    return found


def test_every_documented_trainer_command_line_parses():
    import shlex

    from trainer.run import parse_args

    lines = documented_command_lines("python -m trainer.run ")
    assert len(lines) >= 5
    for where, text in lines:
        argv = shlex.split(text.split(" &")[0])
        try:
            parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{where}: python -m trainer.run {text!r} does not parse") from exc


def test_extras_the_docs_install_exist():
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for doc in [ROOT / "README.md", DEPLOY_MD, RAYJOB, SBATCH]:
        named |= set(re.findall(r"\.\[(\w+)\]", doc.read_text()))
    assert named and named <= extras, named - extras


def test_the_manifest_header_lists_what_it_mounts():
    manifest = list(yaml.safe_load_all(RAYJOB.read_text()))
    header = RAYJOB.read_text().split("apiVersion:", 1)[0]
    text = str(manifest)
    for claim in re.findall(r"'claimName': '([\w-]+)'", text):
        assert claim in header, f"the PVC {claim} is mounted but the header does not say to create it"
    secrets = set(re.findall(r"'secretName': '([\w-]+)'|'secretKeyRef': \{'name': '([\w-]+)'", text))
    for secret in {name for pair in secrets for name in pair if name}:
        assert secret in header, f"{secret} is used but the header does not say to create it"

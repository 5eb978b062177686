"""GPU evidence runs: each case is a real ``python -m trainer.run`` job against one Ray head, its
results read back from the job's summary.json (``trainer.bench.cases`` lists the groups).

    python -m trainer.bench --groups strategies sources-small --out $OUT
    python -m trainer.bench --gpu-decode-only --out $OUT      # decode paths alone (trainer.bench.decode)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from datasvc.usage import HelpFormatter
from trainer.bench.cases import DEFAULT_GROUPS, GROUPS, PROXY


def prepare_sources(root: str, wanted: set[str]) -> dict[str, list[str]]:
    """Shards for the wanted sources; synthetic and mock are written once per root and reused."""
    from datasvc.read.shards import index_shard
    from datasvc.samples import default_shards, large_shards
    from datasvc.tools.synth import PROFILES, calibrate, write_shards

    out = {}
    if "video-mix" in wanted:
        out["video-mix"] = _written(os.path.join(root, "video-mix"), lambda target: write_shards(
            target, 96, PROFILES["image-video-mix"], seed=0, samples_per_shard=16, progress=True,
            processes=os.cpu_count() or 1))
    for suffix, real in (("", default_shards), ("-large", large_shards)):
        if not wanted & {f"real{suffix}", f"synthetic{suffix}", f"mock{suffix}"}:
            continue
        out[f"real{suffix}"] = paths = real()
        n = sum(len(index_shard(p).samples) for p in paths)
        profile = calibrate(paths)
        for kind in ("synthetic", "mock"):
            name = f"{kind}{suffix}"
            if name in wanted:
                out[name] = _written(os.path.join(root, name), lambda target: write_shards(
                    target, n, profile, seed=0, samples_per_shard=32, mock=kind == "mock", progress=False))
    return out


def _written(target: str, write) -> list[str]:
    """The shards in ``target``, written by ``write(target)`` unless a finished set is there."""
    done = os.path.join(target, ".complete")
    if not os.path.exists(done):
        write(target)
        open(done, "w").close()
    return sorted(os.path.join(target, f) for f in os.listdir(target) if f.endswith(".tar"))


def partial_summary(metrics_path: str, wall_s: float) -> dict:
    """The steady-state summary of the steps a case finished before it was cut short, marked partial."""
    from trainer.summary import summarize

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return {}
    s = summarize(records, None, "megatron", 0, wall_s)
    for key in ("data", "world_size", "backend", "data_accounting", "autoscale_decisions"):
        s.pop(key)
    return {**s, "partial": True}


def run_case(name: str, shards: list[str], extra: list[str], address: str, out: str, timeout: int) -> dict:
    case_out = os.path.join(out, name)
    world = [] if "--world-size" in extra else ["--world-size", "1"]
    cmd = [sys.executable, "-m", "trainer.run", "qwen3vl", "--address", address, "--out", case_out,
           "--shards", *shards, "--data-actors", "2", "8", *PROXY, *world, *extra]
    t0 = time.time()
    print(f"[bench] {name}: {len(shards)} shards, {' '.join(extra)}", flush=True)
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"case": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "args": extra}
    summary = os.path.join(case_out, "summary.json")
    if os.path.exists(summary):
        s = json.load(open(summary))
        s.pop("data", None)
        result.update(s)
    metrics = os.path.join(case_out, "metrics.jsonl")
    if os.path.exists(metrics):
        shutil.copy(metrics, os.path.join(out, f"{name}.metrics.jsonl"))
        if "steps" not in result:  # cut short (deadline, crash): summarize the steps it did finish
            result.update(partial_summary(metrics, result["wall_s"]))
    print(f"[bench] {name}: rc={rc} " + json.dumps({k: result.get(k) for k in (
        "steps", "step_time_s", "tokens_per_s", "tflops_per_gpu", "data_wait_share", "peak_mem_gib",
        "loss_first", "loss_last")}), flush=True)
    return result


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--groups", nargs="+", default=DEFAULT_GROUPS, choices=list(GROUPS))
    ap.add_argument("--only", nargs="+", default=None, metavar="CASE",
                    help="run only these cases of the chosen groups (names as printed, e.g. 3d-real-mbs2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    ap.add_argument("--shards-dir", default=None, help="where synthetic/mock shards are written and reused "
                                                       "(default: OUT/shards)")
    ap.add_argument("--case-timeout", type=int, default=200)
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no case starts and a running one is cut short")
    ap.add_argument("--gpu-decode", action="store_true", help="also compare DALI GPU decode (needs DALI + CUDA)")
    ap.add_argument("--gpu-decode-only", action="store_true", help="only the GPU decode comparison")
    return ap


def _selected_cases(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple]:
    cases = [c for g in args.groups for c in GROUPS[g]]
    if args.only:
        unknown = set(args.only) - {name for name, _, _ in cases}
        if unknown:
            ap.error(f"--only {' '.join(sorted(unknown))}: not a case of --groups {' '.join(args.groups)}; "
                     f"choose from {', '.join(name for name, _, _ in cases)}")
        cases = [c for c in cases if c[0] in args.only]
    return cases


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    if args.gpu_decode or args.gpu_decode_only:
        from trainer.bench.decode import gpu_decode_check

        try:
            gpu_decode_check(args.out)
        except Exception as exc:  # report and go on to the training cases
            print(f"[bench] gpu decode check failed: {type(exc).__name__}: {exc}", flush=True)
    if args.gpu_decode_only:
        return 0
    cases = _selected_cases(ap, args)
    sources = prepare_sources(args.shards_dir or os.path.join(args.out, "shards"), {src for _, src, _ in cases})
    _run_cases(cases, sources, args, start)
    return 0


def _run_cases(cases: list[tuple], sources: dict[str, list[str]], args: argparse.Namespace, start: float) -> None:
    """Every case against one Ray head started here (and stopped after), bench.json rewritten after
    each case so a cut-short run keeps what finished."""
    address = "127.0.0.1:6390"
    head, temp = _start_head(address)
    results = []
    try:
        for name, source, extra in cases:
            timeout = args.case_timeout
            if args.deadline is not None:
                timeout = min(timeout, int(args.deadline - (time.time() - start)))
                if timeout < 60:
                    print(f"[bench] {name}: skipped, {timeout} s left before the deadline", flush=True)
                    results.append({"case": name, "rc": "skipped (deadline)", "args": extra})
                    continue
            results.append(run_case(name, sources[source], extra, address, args.out, timeout))
            with open(os.path.join(args.out, "bench.json"), "w") as f:
                json.dump(results, f, indent=1)
    finally:
        _stop_head(head, temp)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)


def _start_head(address: str) -> tuple[subprocess.Popen, str]:
    """A head like the embedded cluster (``datasvc.service.cluster.connect``): node address 127.0.0.1 kept by
    Ray's single-machine mode, so its services listen on loopback; a token of its own in the
    environment of the head and of every case (``local_auth_env``), so whatever ~/.ray/auth_token
    holds is neither used nor needed; a temp dir of its own. It runs in its own session, and
    ``_stop_head`` stops exactly it (``ray stop`` would stop every Ray cluster of this host)."""
    from datasvc.service.cluster import local_auth_env

    os.environ.update(local_auth_env(), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # inherited by the cases
    temp = tempfile.mkdtemp(prefix="vlmfeed-bench-ray-", dir="/tmp")
    host, port = address.rsplit(":", 1)
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--node-ip-address={host}", f"--port={port}",
                             "--include-dashboard=false", f"--temp-dir={temp}"], start_new_session=True)
    for _ in range(60):
        if subprocess.run(["ray", "status", f"--address={address}"], capture_output=True).returncode == 0:
            return head, temp
        if head.poll() is not None:
            break
        time.sleep(2)
    _stop_head(head, temp)
    raise SystemExit(f"the Ray head at {address} did not come up (rc {head.poll()})")


def _stop_head(head: subprocess.Popen, temp: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(head.pid, sig)
            head.wait(timeout=30)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

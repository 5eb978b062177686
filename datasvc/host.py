"""Where a process runs: the host, its CPU, its GPUs and the versions of the stack, and the commit
of the checkout it runs from. Two runs of one command can differ by any of these; a run's summary and
a bench's result record them."""
from __future__ import annotations

import os
import platform
import subprocess


def commit() -> str | None:
    """The short commit of this checkout, ``-dirty`` after it where files differ from it (the
    result is then of that commit plus changes), or None outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    """The host CPU's model name, as /proc/cpuinfo gives it where there is one."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return model


GPU_QUERY = ("name", "uuid", "driver_version", "memory.total", "clocks.max.sm", "clocks.applications.graphics",
             "clocks.sm", "power.limit", "power.default_limit", "pstate", "temperature.gpu")
SOFTWARE = ("torch", "transformer-engine", "megatron-core", "megatron-bridge", "transformers", "ray",
            "nvidia-dali-cuda130", "nvidia-dali-cuda120")


def gpus(indices: str | None = None) -> list[dict]:
    """``nvidia-smi``'s view of the GPUs at ``indices`` (its ``-i`` form; all when None): model,
    driver, clocks and power limit, the facts two runs of one model on one GPU kind can differ by.
    Empty where there is no ``nvidia-smi``."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"]
    if indices:
        cmd.append(f"--id={indices}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [dict(zip(GPU_QUERY, (v.strip() for v in line.split(",")))) for line in out.splitlines() if line.strip()]


def machine() -> dict:
    """Where this process runs: host, CPU, cores it may use, memory, its GPUs (``CUDA_VISIBLE_DEVICES``
    where set) and the versions of the stack that trains."""
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        memory_gib = None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "memory_gib": memory_gib,
            "gpus": gpus(visible) if visible != "" else [], "software": versions}

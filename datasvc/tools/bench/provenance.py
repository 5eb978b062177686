"""What a bench result records of where it came from: the question it answers, the command, the
checkout's commit, the date and the hardware."""
from __future__ import annotations

import os
import platform
import subprocess
import time


def commit() -> str | None:
    """The short commit of this checkout, ``-dirty`` after it where files differ from it (the
    result is then of that commit plus changes), or None outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def hardware() -> str:
    """The CPU model and core count, and the GPU where torch sees one."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    desc = f"{model}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return desc


def stamp(rep: dict, question: str, command: str) -> dict:
    """``rep`` led by its provenance."""
    return {"question": question, "command": command, "commit": commit(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "hardware": hardware(), **rep}

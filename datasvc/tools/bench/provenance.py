"""What a bench result records of where it came from: the checkout's commit."""
from __future__ import annotations

import os
import subprocess


def commit() -> str | None:
    """The short commit of this checkout, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None

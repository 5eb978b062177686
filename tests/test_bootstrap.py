"""`.ci/bootstrap` fails fast, naming the space it needs, on a disk too small for a fresh install."""
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bootstrap_stops_before_pip_when_the_disk_is_too_small(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "bootstrap", tmp_path / ".ci" / "bootstrap")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    env = dict(os.environ, VLMFEED_BOOTSTRAP_NEED_GIB="1000000", TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "bootstrap")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert "the install needs about 1000000 GiB" in proc.stderr and str(tmp_path) in proc.stderr
    assert not (tmp_path / ".venv" / ".vlmfeed-installed").exists()
    assert not list((tmp_path / ".venv").glob("lib/python3.12/site-packages/torch"))

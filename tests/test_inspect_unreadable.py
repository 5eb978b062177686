"""``vlmfeed inspect`` on a shard it may not read: the shard is counted as the service counts it (its
item raises, is redone, and its sample is quarantined ``worker_error`` naming the error), the other
shards are inspected, and no traceback is printed."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from datasvc.samples import write_photo_shards


def without_read_permission(argv: list[str]) -> list[str]:
    """A command that cannot read a file its mode forbids: as root, one run without the capabilities
    that let root read any file."""
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: every file is readable here")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *argv]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "no_pack"])
def test_a_shard_that_may_not_be_read_is_counted_not_a_traceback(tmp_path, packed):
    shards = write_photo_shards(str(tmp_path / "shards"), samples_per_shard=4, copies=1)[:3]
    locked = shards[1]
    os.chmod(locked, 0)
    out = tmp_path / "inspect"
    argv = [sys.executable, "-m", "datasvc.tools.inspect", *shards, "--out", str(out), "--all", "--device", "cpu"]
    proc = subprocess.run(without_read_permission(argv + ([] if packed else ["--no-pack"])),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    acct = summary["accounting"]
    assert acct["quarantined"] == {"worker_error": 1} and summary["balanced"]
    assert acct["delivered"] == acct["read"] - 1 > 0
    (rejected,) = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert rejected["shard"] == locked and rejected["reason"] == "worker_error"
    assert "PermissionError" in rejected["detail"]
    assert "worker_error (PermissionError" in proc.stdout

"""A one-minute soak: good and hostile shards (every class of datasvc.tools.bench.hostile) streamed
from real Ray actors while actors and the feeder are killed; nothing crashes, nothing is lost,
duplicated or uncounted, and memory stays under the budget."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_short_soak_over_hostile_shards(tmp_path):
    temp = tempfile.mkdtemp(prefix="vs", dir="/tmp")  # the cluster's temp dir under it: AF_UNIX paths stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "VLMFEED_RAY_TOKEN"))}
    env.update(PYTHONPATH=REPO, TMPDIR=temp, VLMFEED_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "soak.json"
    try:
        proc = subprocess.run([sys.executable, "-m", "datasvc.tools.bench", "soak", "--minutes", "1",
                               "--kill-every", "6", "--out", str(out)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["crashes"] == 0, rep["crash"]
    assert rep["epochs_completed"] >= 1 and rep["samples_lost"] == 0 and rep["samples_duplicated"] == 0, \
        json.dumps(rep, indent=1) + proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rep["uncounted_samples"] == 0, rep["accounting_current_feeder"]
    assert rep["rss_under_budget"], {k: v for k, v in rep.items() if "rss" in k}
    assert proc.returncode == 0 and rep["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rep["faults_total"] >= 1
    reasons = set(rep["quarantine_reasons_every_feeder"])
    assert {"bad_json", "duplicate_member", "corrupt_tar_header", "truncated_image", "sample_too_large",
            "symlink_member"} <= reasons, reasons

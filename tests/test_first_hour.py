"""A newcomer's mistakes, through every command: each is answered in one line naming what to change,
with a non-zero exit and no traceback, before Ray starts where it can be; every ``python -m`` form
works; the benches listed in help and README agree."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLMFEED = [sys.executable, "-m", "datasvc.tools.cli"]
TRAIN = [sys.executable, "-m", "trainer.run", "qwen3vl"]


def run(cmd, cwd, timeout=300):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT})


# (command after the program, what stderr's last line must say)
MISTAKES = [
    (VLMFEED + ["inspect", "/nope/x.tar", "--out", "o"], "no shard files match /nope/x.tar (no such file)"),
    (VLMFEED + ["sizes", "/nope/x.tar", "--out", "o"], "no shard files match /nope/x.tar"),
    (VLMFEED + ["profile", "/nope/x.tar"], "no shard files match /nope/x.tar"),
    (VLMFEED + ["info", "/nope/x.tar"], "no shard files match /nope/x.tar"),
    (VLMFEED + ["synth", "--calibrate-from", "/nope", "--out", "o", "--samples", "2"], "no shard files match /nope"),
    (VLMFEED + ["convert", "data.csv", "--out", "o"], "data.csv"),
    (VLMFEED + ["inspect", "pipe:cat x.tar", "--out", "o"], "pipe: URLs (webdataset's shell commands) are not run"),
    (VLMFEED + ["profile", "nosuchfs://bucket/x.tar"], "cannot read nosuchfs:// URLs"),
    (VLMFEED + ["inspect", "empty", "--out", "o"], "empty (a directory with no .tar, .tar.gz, .tgz files)"),
    (VLMFEED + ["plan", "qwen3vl", "--mbs", "2", "--tpyo"], "unrecognized arguments: --tpyo"),
    (VLMFEED + ["plan", "qwen3vl", "--gpus", "0"], "vlmfeed plan: error: argument --gpus: must be >= 1, not 0"),
    (VLMFEED + ["plan", "qwen3vl", "--gpu-memory-gib", "0"], "argument --gpu-memory-gib: must be a number > 0, not 0"),
    (VLMFEED + ["synth", "--out", "o", "--samples", "0"], "--samples, --samples-per-shard and --processes must be >= 1"),
    (VLMFEED + ["bench", "nosuch"], "invalid choice: 'nosuch'"),
    (VLMFEED + ["bench", "decode", "--images", "0"], "at least one photo in all"),
    (VLMFEED + ["bench", "service", "--max-actors", "0"], "argument --max-actors: must be >= 1, not 0"),
    (VLMFEED + ["profile", "x.tar", "--mbs", "1,0"], "argument --mbs: must be >= 1, not 0"),
    (VLMFEED + ["profile", "x.tar", "--dp", "0"], "argument --dp: must be >= 1, not 0"),
    ([sys.executable, "-m", "trainer.scale", "--gpus", "8,0"], "argument --gpus: must be >= 1, not 0"),
    (VLMFEED + ["samples", "--out", "data.csv"], "is a file; give a directory"),
    (VLMFEED + ["inpsect"], "unknown subcommand 'inpsect'; did you mean 'inspect'?"),
    (TRAIN + ["--mbs", "0"], "argument --mbs: must be >= 1, not 0"),
    (TRAIN + ["--seed", "0"], "argument --seed: must be >= 1, not 0"),  # Megatron asserts deep in a rank
    (TRAIN + ["--data-actors", "0", "2"], "argument --data-actors: must be >= 1, not 0"),
    (TRAIN + ["--train-iters", "-1"], "argument --train-iters: must be >= 1, not -1"),
    (TRAIN + ["--world-size", "0"], "argument --world-size: must be >= 1, not 0"),
    (TRAIN + ["--decode-threads", "0"], "argument --decode-threads: must be >= 1, not 0"),
    (TRAIN + ["--gbs", "0"], "argument --gbs: must be >= 1, not 0"),
    (TRAIN + ["--model-preset", "qwen3vl-30b-a3b-depth-proxy"], "is now named 'qwen3vl-30b-a3b-48layers-16experts'"),
    (TRAIN + ["--filter", "similarity>=nan"], "'nan' is not a finite number"),
    (TRAIN + ["--filter", "similarity=>0.3"], "is not FIELD OP VALUE"),
    (TRAIN + ["--video-fps", "nan"], "argument --video-fps: must be a number > 0, not nan"),
    (TRAIN + ["--shards", "/nope/x.tar"], "--shards: no shard files match /nope/x.tar"),
    (TRAIN + ["--lr", "nan"], "argument --lr: must be a number > 0, not nan"),
    (TRAIN + ["--tp", "0"], "argument --tp: must be >= 1, not 0"),
    (TRAIN + ["--save-interval", "0"], "argument --save-interval: must be >= 1, not 0"),
    (TRAIN + ["--out", "data.csv"], "--out data.csv: cannot make this directory"),
    (TRAIN + ["--save", "data.csv/ckpt"], "--save data.csv/ckpt: cannot make this directory"),
    (TRAIN + ["--shards", "empty"], "a directory with no .tar"),
    (TRAIN + ["--valid-shards", "/nope/v.tar"], "--valid-shards: no shard files match /nope/v.tar"),
]


@pytest.mark.parametrize("cmd,says", MISTAKES, ids=[" ".join(c[2:5]) for c, _ in MISTAKES])
def test_a_mistake_is_one_line_that_names_the_fix(tmp_path, cmd, says):
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "empty").mkdir()
    proc = run(cmd, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert says in last, proc.stderr[-3000:]
    assert "Ray instance" not in proc.stderr + proc.stdout, "Ray started before the mistake was found"


def test_megatron_on_a_cluster_without_gpus_is_one_line(tmp_path):
    proc = run(TRAIN + ["--backend", "megatron", "--world-size", "1", "--out", str(tmp_path / "run")],
               cwd=tmp_path, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--backend megatron needs GPUs and this Ray cluster has none" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["datasvc.tools.inspect", "datasvc.tools.profile", "datasvc.tools.synth",
                                    "datasvc.tools.bench", "datasvc.tools.convert", "datasvc.tools.sizes",
                                    "datasvc.tools.info", "datasvc.tools.samples", "trainer.plan", "trainer.run"])
def test_every_python_m_form_runs_and_its_help_shows_defaults(tmp_path, module):
    proc = run([sys.executable, "-m", module, "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ")
    if module not in ("datasvc.tools.bench",):
        assert "(default: " in proc.stdout


def test_every_subcommand_has_its_python_m_form():
    from datasvc.tools.cli import SUBCOMMANDS

    forms = {module for module, _ in SUBCOMMANDS.values()}
    tested = set(test_every_python_m_form_runs_and_its_help_shows_defaults.pytestmark[0].args[1])
    assert {f.removesuffix(".cli") for f in forms} <= tested


def test_the_readme_and_bench_help_list_the_same_benches():
    from datasvc.tools.bench.cli import _parser

    choices = set(_parser()._subparsers._group_actions[0].choices)
    text = open(os.path.join(ROOT, "README.md")).read()
    row = next(line for line in text.splitlines() if line.startswith("| `vlmfeed bench NAME`"))
    assert set(re.findall(r"`([a-z]+)` \(", row)) == choices


def test_the_version_is_the_package_version():
    from importlib.metadata import version

    proc = run(VLMFEED + ["--version"], cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == f"vlmfeed {version('vlmfeed')}"


def test_samples_writes_the_bundled_photos_where_asked(tmp_path):
    proc = run(VLMFEED + ["samples", "--out", str(tmp_path / "photos"), "--copies", "1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tars = sorted(os.listdir(tmp_path / "photos"))
    assert tars and all(t.endswith(".tar") for t in tars)
    assert str(tmp_path / "photos") in proc.stdout

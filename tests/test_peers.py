"""The peer data paths of ``vlmfeed bench peers`` (Megatron-Bridge's own loader, Ray Data, vlmfeed)
each yield micro-batches in the rank's contract on CPU, on real shards with real Ray, so the GPU
benchmark cannot rot between GPU runs; and the meter counts the CPU of a process tree."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datasvc.samples import default_shards
from pipelines.qwen3vl.data import TOKENS
from trainer.bench.peers_data import PATHS, PeerSetting, check_contract, shard_samples

# Two bundled shards: single-image captions and two-image conversations (000003 holds the pairs).
SHARDS = tuple(default_shards()[2:4])
PATCH_DIM = 3 * 2 * 16 * 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def own_ray(tmp_path_factory):
    """A Ray cluster of this module's own (its temp dir given, so a cluster another process
    started on this host is never joined)."""
    import ray

    from datasvc.service.cluster import connect

    connect(num_cpus=2, object_store_memory=400 * 1024 * 1024, temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


SETTING = PeerSetting(shards=SHARDS, seq_len=4096, mbs=2)


@pytest.fixture(scope="module")
def setting():
    return SETTING


def check(batch, setting):
    v = setting.vision()
    counts = check_contract(batch, TOKENS.image_pad, v.merge_size, PATCH_DIM, setting.seq_len)
    assert batch.pixel_values.dtype == torch.float32
    return counts


def test_the_peers_train_vlmfeeds_own_conversations():
    samples = shard_samples(SHARDS)
    assert len(samples) == 12
    pairs = [s for s in samples if len(s["images"]) == 2]
    assert len(pairs) == 3 and all(sum(not isinstance(p, str) for p in s["messages"][0]["content"]) == 2
                                   for s in pairs)


# Run in a fresh interpreter, as a Bridge job runs: the loader forks its DataLoader worker, and a
# fork from this long-lived test process (threads of earlier tests' Ray, DALI and OpenCV pools) can
# deadlock in the child.
STOCK_PROBE = """
import json, sys
from tests.test_peers import SETTING, check
from trainer.bench.peers_stock import StockPath
from trainer.megatron.step import to_stock_batch

path = StockPath(SETTING, sys.argv[1], samples=12, num_workers=1)
config = path.config
try:
    batches = [next(path) for _ in range(6)]
finally:
    path.close()
stock = to_stock_batch(batches[0])
print(json.dumps({"dataloader_type": config.dataloader_type,
                  "deferred_packing": config.defer_in_batch_packing_to_step,
                  "counts": [check(b, SETTING) for b in batches],
                  "stock_grid_columns": stock["visual_inputs"].image_grid_thw.shape[1]}))
"""


def test_megatron_bridge_loader_yields_the_rank_contract(tmp_path):
    pytest.importorskip("megatron.bridge")
    pytest.importorskip("qwen_vl_utils")
    done = subprocess.run([sys.executable, "-c", STOCK_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["dataloader_type"] == "cyclic" and probe["deferred_packing"]
    counts = probe["counts"]  # one real DataLoader worker process made these
    assert all(c["rows"] == SETTING.mbs for c in counts)  # padded rows, one sample each
    assert sum(c["images"] for c in counts) == 15  # all 12 samples once: 9 single, 3 pairs
    assert all(c["width"] % 128 == 0 for c in counts)  # Bridge's collate pads to a multiple of 128
    assert all(c["real_token_fraction"] < 1 for c in counts)
    assert probe["stock_grid_columns"] == 3  # the adapter to the stock qwen3_vl_step takes it as it is


def test_ray_data_path_yields_the_rank_contract(setting, own_ray):
    from trainer.bench.peers_raydata import RayDataPath, split_for_ranks

    (it,) = split_for_ranks(setting, ranks=1, actors=1)
    path = RayDataPath(setting, it, pad_id=TOKENS.pad, epochs=1)
    batches = list(path)
    counts = [check(b, setting) for b in batches]
    assert sum(c["rows"] for c in counts) == 12 and sum(c["images"] for c in counts) == 15
    assert len(path.worker_pids) == 1  # the one actor of the pool
    keys = [k for b in batches for k in b.sample_keys]
    assert len(set(keys)) == 12


def test_vlmfeed_path_yields_the_rank_contract(setting, own_ray):
    from trainer.bench.peers import VlmfeedPath

    path = VlmfeedPath(setting, decode="cpu", actors=1)
    try:
        batches = [next(path) for _ in range(3)]
    finally:
        path.close()
    counts = [check(b, setting) for b in batches]
    assert all(c["rows"] == setting.mbs for c in counts)
    assert max(int(b.num_samples.max()) for b in batches) > 1  # packed rows
    assert sum(c["real_token_fraction"] for c in counts) / len(counts) > 0.8


def test_process_tree_meter_counts_children_and_their_kind():
    from trainer.bench.peers_measure import ProcessTreeMeter

    meter = ProcessTreeMeter(interval_s=0.05).start()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.4: pass\ntime.sleep(0.2)"], check=True)
    cpu = meter.cpu_s()
    meter.stop()
    assert 0.25 <= cpu["data_workers"] <= 1.5, cpu
    assert cpu["total"] >= cpu["data_workers"] and meter.peak_rss_gib > 0


def test_ratios_carry_two_standard_errors():
    from trainer.bench.peers_measure import mean_se, ratio

    m, se = mean_se([1.0, 1.2, 0.8, 1.1, 0.9])
    assert m == pytest.approx(1.0) and se == pytest.approx(0.0707, abs=1e-3)
    r = ratio((2.0, 0.1), (1.0, 0.05))
    assert r["ratio"] == 2.0 and r["pm_2se"] == pytest.approx(2 * 2 * (0.05 ** 2 + 0.05 ** 2) ** 0.5, abs=1e-3)


def test_stock_preprocessing_repeats_on_every_model_parallel_rank():
    from trainer.bench.peers import duplication

    rows = duplication({"megatron-bridge": {"cpu_s_per_sample": 0.1}, "vlmfeed-cpu": {"cpu_s_per_sample": 0.03}})
    by_layout = {r["layout"].split(":")[0]: r for r in rows}
    tp4 = by_layout["235b-a22b sft recipe"]
    assert tp4["stock_preprocessing_per_sample"] == 4 and tp4["vlmfeed_preprocessing_per_sample"] == 1
    assert tp4["megatron-bridge_cpu_s_per_trained_sample"] == pytest.approx(0.4)
    assert tp4["stock_dataloader_workers"] == 64  # 2 per rank on 32 ranks
    assert by_layout["64 GPUs, TP2 PP4 CP2"]["stock_preprocessing_per_sample"] == 16


def test_peers_command_parses_every_subcommand():
    from trainer.bench.peers import _parser

    ap = _parser()
    for argv in (["data", "--cores", "2"], ["train", "--mbs-list", "2", "4", "--profile", "llava-sft"], ["all"],
                 ["duplication"],
                 ["train-one", "--path", "ray-data", "--json", "x.json"]):
        assert ap.parse_args(argv).cmd == argv[0]


@pytest.mark.parametrize("path", PATHS)
def test_each_training_case_is_a_valid_trainer_job(path, setting):
    """The GPU cases' trainer options parse and validate as ``trainer.run``'s, with the stock step
    (padded rows) for the padded peers and packed rows for Energon's packing and vlmfeed; nothing
    recomputed unless asked, the data path's workers as many as its cores."""
    from trainer.bench.peers import _parser
    from trainer.bench.peers_train import trainer_argv
    from trainer.config import from_args
    from trainer.run import parse_args

    args = _parser().parse_args(["train-one", "--path", path, "--json", "x.json", "--mbs", "4", "--cores", "6"])
    setting = dataclasses.replace(setting, mbs=4)
    targs = parse_args(trainer_argv(args, setting, path, "out"))
    cfg = from_args(targs)
    cfg.validate(1)
    assert cfg.train.padded == (path in ("megatron-bridge", "ray-data"))
    assert (targs.decode == "gpu") == (path == "vlmfeed-gpu")
    assert targs.max_pixels == setting.max_pixels and cfg.train.seq_len == setting.seq_len
    assert cfg.recompute.granularity == "none" and targs.num_layers is None  # the depth proxy, as it fits
    assert targs.data_actors == [6, 6]
    args = _parser().parse_args(["train-one", "--path", path, "--json", "x.json", "--cores", "6",
                                 "--vlmfeed-actors", "1", "6"])
    assert parse_args(trainer_argv(args, setting, path, "out")).data_actors == [1, 6]  # autoscaled between


ENERGON_PROBE = """
import json, sys
from tests.test_peers import SETTING, check
from pipelines.qwen3vl.data import TOKENS
from trainer.bench.peers_energon import EnergonPackedPath

path = EnergonPackedPath(SETTING, sys.argv[1], pad_id=TOKENS.pad, num_workers=1, packing_buffer_size=12)
try:
    batches = [next(path) for _ in range(4)]
finally:
    path.close()
print(json.dumps({"counts": [check(b, SETTING) for b in batches],
                  "samples": [b.num_samples.tolist() for b in batches],
                  "keys": [k for b in batches for k in b.sample_keys]}))
"""


def test_energon_packing_yields_packed_rows_in_the_rank_contract(tmp_path):
    """Energon's own loader (``energon prepare``d shards, one real worker process, its packing
    buffer calling our first-fit-decreasing) makes packed rows the THD step takes."""
    pytest.importorskip("megatron.energon")
    done = subprocess.run([sys.executable, "-c", ENERGON_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(c["rows"] == SETTING.mbs and c["width"] == SETTING.seq_len for c in probe["counts"])
    assert all(n > 1 for row in probe["samples"] for n in row)  # several samples a row
    # A buffer of 12 holds the whole dataset, and its packs fill one micro-batch: every sample once.
    assert sorted(probe["keys"][:12]) == sorted({s["key"].split("/")[-1] for s in shard_samples(SHARDS)})
    assert probe["counts"][0]["images"] == 15


def test_first_fit_decreasing_fills_bins_longest_first():
    from trainer.bench.peers_energon import first_fit_decreasing

    bins = first_fit_decreasing(list("abcdef"), [700, 300, 500, 200, 400, 900], 1000)
    lengths = dict(zip("abcdef", [700, 300, 500, 200, 400, 900]))
    assert all(sum(lengths[x] for x in b) <= 1000 for b in bins)
    assert sorted(x for b in bins for x in b) == list("abcdef")
    assert bins == [["f"], ["a", "b"], ["c", "e"], ["d"]]  # 200 fits none of the first three


def test_the_data_path_gets_its_cores_and_the_ranks_the_rest():
    from trainer.bench.peers_measure import split_cores

    cores = sorted(os.sched_getaffinity(0))
    data, ranks = split_cores(1)
    if len(cores) > 1:
        assert data == {cores[0]} and ranks == set(cores[1:])
    assert split_cores(None) == (set(cores), set(cores)) == split_cores(len(cores) + 4)


def test_pinning_moves_every_thread_of_a_child():
    from trainer.bench.peers_measure import pin_children

    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\ntime.sleep(30)"])
    try:
        import time

        time.sleep(1.0)
        one = {sorted(os.sched_getaffinity(0))[0]}
        assert pin_children(os.getpid(), one) >= 1
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) >= 2 and all(os.sched_getaffinity(int(t)) == one for t in tids)
    finally:
        child.kill()
        child.wait()


def test_repeats_pool_as_totals_over_totals():
    from trainer.bench.peers_report import pooled

    fast = {"path": "p", "steady_blocks": {"tokens": [100.0, 100.0], "seconds": [1.0, 1.0]},
            "samples_trained": 10, "data_cpu_s": 5.0, "data_wait_share": 0.0}
    slow = {"path": "p", "steady_blocks": {"tokens": [100.0, 100.0], "seconds": [3.0, 3.0]},
            "samples_trained": 30, "data_cpu_s": 5.0, "data_wait_share": 0.02}
    out = pooled([fast, slow, {"path": "p", "rc": "timeout"}])
    assert out["repeats"] == 2 and out["tokens_per_s"] == pytest.approx(400 / 8)  # not the mean of 100 and 33
    assert out["tokens_per_s_pm_2se"] > 0 and out["cpu_s_per_trained_sample"] == pytest.approx(0.25)
    assert len(out["runs"]) == 3
    from trainer.bench.peers_report import table

    text = table({"mbs2": {"p": out, "q": pooled([{"path": "q", "rc": "timeout"}])}})
    assert "| 50 +- " in text and "did not finish: ['timeout']" in text


def test_the_train_report_holds_the_cases_and_the_command_as_typed(tmp_path, monkeypatch, capsys):
    """The printed table has a row per path and MBS, none for the provenance stamp's sections."""
    from trainer.bench import peers, peers_train
    from trainer.bench.peers_report import pooled

    case = {"path": "vlmfeed-cpu", "mbs": 2, "steady_blocks": {"tokens": [100.0, 100.0], "seconds": [1.0, 1.0]}}
    monkeypatch.setattr(peers_train, "train_all", lambda *a: {"mbs2": {"vlmfeed-cpu": pooled([case])}})
    argv = ["train", "--paths", "vlmfeed-cpu", "--out", str(tmp_path)]
    assert peers.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[:2] for row in rows[1:]] == [["| 2", "vlmfeed-cpu"]]
    rep = json.loads((tmp_path / "bench-peers-train.json").read_text())
    assert rep["command"] == "vlmfeed bench peers " + " ".join(argv) and "defaults" in rep


def test_the_side_by_side_figure_draws_from_the_recorded_h200_runs(tmp_path):
    from trainer.bench import peers_plot

    runs = Path(__file__).resolve().parent / "data" / "recorded" / "h200" / "peers-train-mbs2-mbs4"
    train = peers_plot.load_train([str(runs / "bench-peers-train-mbs2.json"), str(runs / "bench-peers-train-mbs4.json")])
    assert sorted(train) == [2, 4] and "vlmfeed-gpu" not in train[4]  # cut by the deadline: left out, not zero
    out = tmp_path / "peers.png"
    assert peers_plot.main([str(runs / "bench-peers-train-mbs2.json"), "--data", str(runs / "peers-data-16-cores.json"),
                            "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_steady_cpu_leaves_start_up_out():
    """The data path's CPU from the first steady step on, over the samples trained from then on."""
    from trainer.bench.peers_measure import steady_count, steady_cpu, steady_start
    from trainer.bench.peers_report import pooled

    assert steady_start(200) == 40 and steady_start(5) == 2
    marks = [3, 7, 10, 14, 17, 21]  # running samples after each micro-batch
    assert steady_count(marks, 2) == 21 - 7 and steady_count(marks, 0) == 21 and steady_count(marks, 6) == 0
    start = {"data_workers": 50.0, "ray_system": 5.0, "driver": 3.0, "rank": 99.0}
    end = {"data_workers": 57.0, "ray_system": 5.5, "driver": 3.5, "rank": 150.0}
    out = steady_cpu(end, start, 10)
    assert out["steady_data_cpu_s"] == 8.0 and out["steady_cpu_s_per_trained_sample"] == 0.8  # the rank's left out
    assert out["steady_cpu_s_by_kind"] == {"data_workers": 7.0, "ray_system": 0.5, "driver": 0.5}
    assert steady_cpu(end, None, 10)["steady_cpu_s_per_trained_sample"] is None
    run = {"path": "p", "steady_blocks": {"tokens": [1.0], "seconds": [1.0]}, **out}
    assert pooled([run, run])["steady_cpu_s_per_trained_sample"] == 0.8
    assert pooled([run, run])["steady_worker_cpu_s_per_trained_sample"] == 0.7  # Ray's and the driver's left out
    older = {k: v for k, v in run.items() if k != "steady_cpu_s_by_kind"}
    assert pooled([run, older])["steady_worker_cpu_s_per_trained_sample"] is None  # not from a part of the repeats


def test_a_case_that_cannot_finish_before_the_deadline_is_left_for_the_next_command(tmp_path, monkeypatch, capsys):
    """Once a case has taken 150 s, the next one does not start with 140 s left: it would be cut short
    and run again whole by the next command."""
    import argparse

    from trainer.bench import peers_grid

    clock = [1000.0]
    monkeypatch.setattr(peers_grid.time, "time", lambda: clock[0])

    def run_case(cmd, timeout):
        clock[0] += 150
        done = cmd[cmd.index("--json") + 1]
        Path(done).write_text(json.dumps({"path": cmd[cmd.index("--path") + 1], "wall_s": 150}))
        return 0

    monkeypatch.setattr(peers_grid, "run_case", run_case)
    args = argparse.Namespace(out=str(tmp_path), mbs_list=[2], repeats=1, paths=["vlmfeed-cpu", "energon-packed"],
                              padded_mbs=None, case_timeout=600, deadline=290, min_case_s=120, strategy="3d",
                              iters=200, world_size=1, tp=1, proxy="depth", recompute="none", workers=None,
                              cores=8, vlmfeed_actors=None)
    peers_grid.train_grid(args, ["--mbs", "2"], clock[0])
    assert (tmp_path / "vlmfeed-cpu-mbs2-r0.json").exists()
    assert not (tmp_path / "energon-packed-mbs2-r0.json").exists()
    assert "energon-packed-mbs2-r0: not started (140 s to the deadline" in capsys.readouterr().out
    assert peers_grid.time_needed(120, []) == 120 and peers_grid.time_needed(120, [150]) == pytest.approx(172.5)


def test_a_rate_holds_a_path_to_it_and_counts_its_cpu_per_second(tmp_path):
    """``--rate``: the path is taken at that many samples a second, not faster, so its CPU per sample
    counts what it spends per second as well as per sample."""
    pytest.importorskip("megatron.energon")
    out = tmp_path / "energon.json"
    done = subprocess.run([sys.executable, "-m", "trainer.bench.peers", "data-one", "--path", "energon-packed",
                           "--cores", "2", "--samples", "24", "--rate", "8", "--json", str(out),
                           "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["rate_samples_per_s"] == 8
    assert rep["samples"] >= 24
    assert 4 < rep["samples_per_s"] <= 8 * 1.02  # Energon delivers far faster on two cores
    assert rep["cpu_s_per_sample"] > 0

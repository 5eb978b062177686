"""``vlmfeed bench`` subcommands at tiny sizes: the JSON has its fields and sane numbers.
No timing targets are asserted here: the benchmark is not a timed test."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(args, tmp_path, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT, VLMFEED_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "datasvc.tools.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def positive(x):
    return isinstance(x, (int, float)) and np.isfinite(x) and x > 0


def test_bench_decode_tiny(tmp_path):
    out = tmp_path / "decode.json"
    proc = run_bench(["decode", "--images", "4", "--repeats", "1", "--mp-range", "0.1", "0.4",
                      "--pack-synth", "4", "--pack-copies", "1", "--out", str(out)], tmp_path)
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("vlmfeed bench decode --images 4") and rep["question"].endswith("?")
    assert rep["date"] and "cores" in rep["hardware"]
    assert rep["photos"]["count"] == 4 and positive(rep["photos"]["megapixels_total"])
    expected = {"torchvision_decode_jpeg": "a", "pil_decode": "a", "dali_cpu_decode": "a",
                "libjpeg_turbo_decode_opencv_resize": "a+",
                "hf_qwen2vl_torchvision": "b", "hf_qwen2vl_pil": "b",
                "ours_pixel_values": "c", "ours_uint8_pixel_rows": "c", "baseline_uint8_patch_order": "c-"}
    for name, group in expected.items():
        r = rep["results"][name]
        assert r["group"] == group
        assert positive(r["images_per_s"]) and positive(r["mp_per_s"]) and positive(r["seconds"])
    assert rep["results"][rep["fastest_decode"]]["group"] == "a"
    assert rep["results"][rep["fastest_hf"]]["group"] == "b"
    for c in ("ours_pixel_values", "ours_uint8_pixel_rows", "baseline_uint8_patch_order"):
        assert positive(rep["ratios"][c]["vs_fastest_decode"]) and positive(rep["ratios"][c]["vs_fastest_hf"])
        assert positive(rep["ratios"][c]["vs_decode_and_resize"])
    for key in ("actors_cpu_over_decode_and_resize", "actors_copying_rows_cpu_over_default",
                "dali_decode_cpu_over_torchvision", "dali_decode_cpu_over_torchvision_and_copy"):
        paired = rep[key]
        assert paired["ratio_min"] <= paired["ratio_median"] <= paired["ratio_max"] and paired["rounds"] == 7
    assert set(rep["goals"]) >= {"vs_fastest_decode", "vs_fastest_hf", "met_vs_decode", "met_vs_hf"}
    for key in ("vs_fastest_decode_by_round", "vs_fastest_hf_by_round"):
        rounds = rep["goals"][key]
        assert rounds["rounds"] >= 1 and rounds["ratio_min"] <= rounds["ratio_median"] <= rounds["ratio_max"]
    for r in rep["results"].values():
        assert r["seconds"] <= r["seconds_median"]
    prof = rep["profile_ours"]
    assert set(prof) == {"probe", "decode", "resize", "to_pixel_values"}
    assert abs(sum(v["share"] for v in prof.values()) - 1.0) < 0.01
    actors = rep["actors_patch_order_over_pixel_rows"]
    assert actors["rounds"] == 7 and actors["ratio_min"] <= actors["ratio_median"] <= actors["ratio_max"]
    assert positive(actors["fast_cpu_s_median"]) and positive(actors["slow_cpu_s_median"])
    for seq_len in ("4096", "8192"):
        pk = rep["packing"][seq_len]
        assert 0 < pk["padding_efficiency"] < pk["packing_efficiency"] <= 1
        assert pk["rows_packed"] <= pk["rows_padded"]
    assert "ours_pixel_values" in proc.stdout and "packing" in proc.stdout
    assert (tmp_path / "decode.png").stat().st_size > 10_000


def test_bench_service_tiny(tmp_path, ray_local, monkeypatch, capsys):
    # In this process, on the test run's local Ray (2 CPUs), through the command-line entry point.
    from datasvc.tools.bench.cli import main

    monkeypatch.setenv("VLMFEED_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "service.json"
    assert main(["service", "--max-actors", "1", "--samples", "8", "--samples-per-item", "4",
                 "--seq-len", "512", "--max-pixels", str(256 * 256), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    rep = json.loads(out.read_text())
    ip = rep["in_process"]
    assert ip["samples"] > 0 and positive(ip["samples_per_s"]) and positive(ip["images_per_s"]) and positive(ip["mp_per_s"])
    r1 = rep["ray"]["1"]
    assert r1["samples"] == 2 * ip["samples"]  # 2 epochs of the same shards, every sample once per epoch
    for k in ("samples_per_s", "images_per_s", "mp_per_s", "steady_samples_per_s", "scaling_efficiency"):
        assert positive(r1[k]), k
    assert positive(rep["ray_vs_in_process_1_actor"]) and rep["goal_ray_vs_in_process"] == 0.9
    assert r1["micro_batches"] > 1
    acct = r1["accounting"]
    assert acct["read"] == acct["delivered"] + sum(acct["quarantined"].values()) + sum(acct["skipped_by_rule"].values())
    assert "in-process" in stdout and "ray 1 actor" in stdout


def test_cut_short_case_keeps_its_finished_steps(tmp_path):
    from trainer.bench.training import partial_summary

    path = tmp_path / "metrics.jsonl"
    steps = [{"step": i + 1, "step_time_s": t, "data_wait_frac": 0.0, "tokens_per_s": 1000 / t,
              "real_token_fraction": 0.8, "tflops_per_gpu": 100.0, "peak_mem_gib": 90.0 + i, "loss": 12.0 - i}
             for i, t in enumerate([70.0, 3.0, 2.0, 2.0, 2.5])]
    path.write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    s = partial_summary(str(path), wall_s=140.0)
    assert s["partial"] and s["steps"] == 5 and s["steady_steps"] == 3  # warm-up steps 1-2 left out
    assert s["step_time_s"] == round((2.0 + 2.0 + 2.5) / 3, 4) and s["peak_mem_gib"] == 94.0
    assert s["loss_fell"] and "data" not in s
    (tmp_path / "empty.jsonl").write_text("")
    assert partial_summary(str(tmp_path / "empty.jsonl"), wall_s=1.0) == {}


def test_unknown_only_case_fails_fast_naming_the_choices(capsys):
    from trainer.bench import training as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--groups", "two-gpus", "--only", "3d-real-large-mbs2-1gpu", "3d-mbs99"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--only 3d-mbs99" in err and "fsdp-real-large-mbs2-2gpu" in err


def test_sizing_bench_measures_the_probe_against_the_whole_set(photo_shards, tmp_path, capsys):
    """A probe that reads every sample has no error; a small one reads only its share and strays."""
    from datasvc.tools.bench.cli import main

    out = tmp_path / "sizing.json"
    assert main(["sizing", *photo_shards, "--probe-samples", "8", "48", "--seeds", "3", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["samples"] == 48 and rep["shards"] == 8
    small, whole = rep["rows"]
    assert small["probed"] == 8 and whole["probed"] == 48
    assert whole["rel_sd"] == 0.0 and whole["worst_rel_error"] < 1e-3  # the mean, up to its rounding
    assert whole["items_per_block"][0] == whole["items_per_block"][1]
    assert small["worst_rel_error"] > 0.0
    assert "block sizing probe: 48 samples in 8 shards" in capsys.readouterr().out


def test_bench_allocator_pairs_processes_with_and_without_the_actors_tunables(tmp_path):
    """One round of each case: a process under the actors' GLIBC_TUNABLES and one under glibc's
    defaults, each timing the actors' work and torchvision's decode."""
    from datasvc.config import ACTOR_MALLOC_TUNABLES

    run_bench(["allocator", "--rounds", "1", "--images", "2", "--out", str(tmp_path)], tmp_path, timeout=600)
    rep = json.loads((tmp_path / "allocator.json").read_text())
    assert rep["tunables"] == ACTOR_MALLOC_TUNABLES and rep["command"].startswith("python -m datasvc.tools.bench.allocator")
    assert set(rep["cases"]) == {"0.3-4 MP", "8-16 MP"}
    for row in rep["cases"].values():
        assert row["glibc_tunables_seen"] == {"defaults": [""], "actors": [ACTOR_MALLOC_TUNABLES]}
        for r in (row["actors"], row["torchvision"]):
            assert positive(r["cpu_ms_per_image_median"]["defaults"]) and positive(r["cpu_ms_per_image_median"]["actors"])
            assert r["range"][0] <= r["defaults_over_actors_median"] <= r["range"][1]


def test_the_results_index_lists_each_question_with_its_page_hardware_and_stamps(tmp_path):
    from datasvc.tools.bench.results_index import main

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "how-fast.md").write_text("# How fast is it?\n\nAnswer.\n")
    run = tmp_path / "results" / "how-fast" / "h200"
    run.mkdir(parents=True)
    (run / "a.json").write_text(json.dumps({"date": "2026-12-01T10:00", "commit": "abcdef123 (a note)"}))
    (run / "b.json").write_text(json.dumps({"date": "2026-12-03", "commit": "1234567"}))
    (run / "log.txt").write_text("not json")
    (tmp_path / "results" / "orphan" / "cpu").mkdir(parents=True)
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "results" / "README.md").read_text()
    assert ("| [How fast is it?](how-fast/) | [page](../benchmarks/how-fast.md) | h200 | 3 | 2026-12-01 to 2026-12-03 | "
            "1234567, abcdef1 |") in text
    assert "| [orphan](orphan/) |  | cpu | 0 |  |  |" in text


def test_a_stamped_result_records_the_defaults_it_holds_for():
    from datasvc.tools.bench.provenance import stamp
    from datasvc.training import DEVICE_DEFAULTS
    from trainer.bench import trainer_defaults

    rep = json.loads(json.dumps(stamp({"tokens_per_s": 1.0}, "How fast?", "vlmfeed bench x", trainer_defaults())))
    assert rep["question"] == "How fast?" and rep["tokens_per_s"] == 1.0
    held = rep["defaults"]
    assert held["training_geometry"]["devices"]["gpu"] == {"seq_len": DEVICE_DEFAULTS["gpu"].seq_len,
                                                          "max_pixels": DEVICE_DEFAULTS["gpu"].max_pixels}
    assert held["service"]["decode"]["device"] == "cpu" and held["service"]["decode"]["resize_on"] == "rank"
    assert held["trainer"]["train"]["mbs"] == 1 and held["trainer"]["parallel"]["strategy"] in ("fsdp", "3d")
    assert "defaults" in stamp({}, "q", "c") and "trainer" not in stamp({}, "q", "c")["defaults"]


def test_two_checkouts_compare_by_round_and_by_totals():
    """The structure bench's answer: head over base per alternated round, its mean with +-2 standard
    errors, and the totals over totals."""
    from datasvc.tools.bench.checkouts import summarize

    s = summarize([10.0, 12.0, 11.0], [10.0, 13.2, 9.9], "images/s")
    assert s["ratio_per_round"] == [1.0, 1.1, 0.9]
    assert s["ratio_mean"] == 1.0 and s["ratio_2se"] == round(2 * 0.1 / 3 ** 0.5, 4)
    assert s["ratio_of_totals"] == round(33.1 / 33.0, 4)


def test_the_train_bench_reads_the_main_commands_tokens_per_s_from_a_checkout(tmp_path):
    """``checkouts --benches train`` runs ``trainer.run qwen3vl`` in a checkout's tree, with the extra
    options given, and reads the run's steady tokens/s (here the CPU path, on this tree)."""
    from datasvc.tools.bench.checkouts import run_bench

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    value = run_bench(root, "train", str(tmp_path), "base-round1", ["--train-iters", "3", "--seq-len", "512"])
    summary = json.loads((tmp_path / "train-base-round1" / "summary.json").read_text())
    assert summary["steps"] == 3 and value == summary["tokens_per_s"] > 0

import json
import math

import pytest

from trainer.bench.plots import load, main


def test_case_names_parse_and_plot_is_written(tmp_path):
    rows = [{"case": "fsdp-real-large-mbs1", "rc": 0, "tokens_per_s": 3600.0, "data_wait_share": 0.0, "step_time_s": 1.0},
            {"case": "3d-real-large-mbs4-recompute", "rc": 0, "tokens_per_s": 7900.0, "data_wait_share": 0.001,
             "step_time_s": 1.5},
            {"case": "3d-real-large-mbs8-recompute", "rc": 1},
            {"case": "3d-mock-large-mbs2", "rc": 0, "tokens_per_s": 2900.0, "data_wait_share": 0.0, "step_time_s": 0.4},
            {"case": "not-a-bench-case", "rc": 0}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    parsed = load([str(path)])
    assert [(r["strategy"], r["source"], r["mbs"], r["label"]) for r in parsed] == [
        ("fsdp", "real-large", 1, ""), ("3d", "real-large", 4, "recompute"), ("3d", "real-large", 8, "recompute"),
        ("3d", "mock-large", 2, "")]
    out = tmp_path / "plot.png"
    assert main([str(path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_second_row_with_two_gpus_chunks_and_decode(tmp_path):
    rows = [{"case": "3d-real-large-mbs2-1gpu", "rc": 0, "tokens_per_s": 7500.0, "data_wait_share": 0.0},
            {"case": "3d-real-large-mbs2-ep2-2gpu", "rc": 0, "tokens_per_s": 16000.0, "data_wait_share": 0.0},
            {"case": "3d-real-large-mbs8-recompute-vchunk32k-expseg", "rc": "timeout", "partial": True,
             "tokens_per_s": 9100.0, "data_wait_share": 0.0}]
    decode = {"images": 256, "dali_gpu_resident_pixel_values": {"img_s": 3700.0, "mp_s": 5400.0},
              "torchvision_nvjpeg_decode_only": {"img_s": 5800.0, "mp_s": 8400.0}, "some_ratio": 1.4}
    (tmp_path / "bench.json").write_text(json.dumps(rows))
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    out = tmp_path / "plot.png"
    assert main([str(tmp_path / "bench.json"), "--decode", str(tmp_path / "decode.json"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_gpu_tokens_averages_repeated_baselines(tmp_path):
    from trainer.bench.plots import per_gpu_tokens

    rows = [{"case": c, "rc": 0, "tokens_per_s": t} for c, t in (
        ("3d-real-large-mbs2-1gpu", 7000.0), ("3d-real-large-mbs2-1gpu", 8000.0),
        ("3d-real-large-mbs2-ep2-2gpu", 16000.0), ("3d-real-large-mbs2-ep4-4gpu", 30000.0),
        ("fsdp-real-large-mbs2-4gpu", 20000.0))]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    parsed = load([str(tmp_path / "b.json")])
    assert per_gpu_tokens(parsed, "3d", 1) == 7500.0
    assert per_gpu_tokens(parsed, "3d", 2) == 8000.0
    assert per_gpu_tokens(parsed, "3d", 4) == 7500.0
    assert per_gpu_tokens(parsed, "fsdp", 4) == 5000.0
    assert per_gpu_tokens(parsed, "fsdp", 1) == 0.0  # no 1-GPU fsdp case: missing, not a crash
    assert per_gpu_tokens(parsed, "3d", 14) == 0.0  # "14gpu" must not match "4gpu"


def test_source_ratios_pair_runs_with_the_same_options_by_tokens_per_s(tmp_path):
    from trainer.bench.plots import source_ratios

    rows = [{"case": c, "rc": rc, "tokens_per_s": t, "step_time_s": 1.0} for c, rc, t in (
        ("3d-real-large-mbs2", 0, 8000.0), ("3d-mock-large-mbs2", 0, 16000.0), ("3d-synthetic-large-mbs2", 0, 7200.0),
        ("3d-real-large-mbs8-vchunk", 0, 10000.0), ("3d-mock-large-mbs8-vchunk", 0, 23000.0),
        ("3d-synthetic-large-mbs8", 0, 99.0),  # other options than the real MBS 8 case: not a pair
        ("3d-real-large-mbs8", 0, 5000.0),  # its partner, but MBS 8 already has its real run: not mixed in
        ("fsdp-real-large-mbs2", 0, 7000.0), ("fsdp-mock-large-mbs2", 1, None))]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    assert source_ratios(load([str(tmp_path / "b.json")]), "-large") == {
        "3d MBS 2": {"synthetic": 0.9, "mock": 2.0}, "3d MBS 8": {"mock": 2.3}}


def test_rows_less_full_do_not_look_faster(tmp_path):
    """Shorter steps from emptier rows are not throughput: the ratio follows tokens/s."""
    from trainer.bench.plots import source_ratios

    rows = [{"case": "3d-real-large-mbs8", "rc": 0, "tokens_per_s": 9600.0, "step_time_s": 2.7},
            {"case": "3d-mock-large-mbs8", "rc": 0, "tokens_per_s": 5300.0, "step_time_s": 0.62}]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    assert source_ratios(load([str(tmp_path / "b.json")]), "-large")["3d MBS 8"]["mock"] < 1.0


def test_by_source_plot_is_written(tmp_path):
    rows = [{"case": f"{st}-{src}-large-mbs{m}{lab}", "rc": 0, "tokens_per_s": t * m, "data_wait_share": 0.0,
             "real_token_fraction": 0.95, "step_time_s": 1.0}
            for st, lab in (("3d", ""), ("fsdp", "-recompute")) for src, t in (("real", 1000.0), ("mock", 2000.0))
            for m in (1, 8)]
    rows.append({"case": "3d-real-large-mbs8-frozen-vision", "rc": 0, "tokens_per_s": 1.0, "data_wait_share": 0.0})
    (tmp_path / "b.json").write_text(json.dumps(rows))
    out = tmp_path / "sources.png"
    assert main([str(tmp_path / "b.json"), "--by-source", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _metrics(path, tokens_per_s):
    path.write_text("".join(json.dumps({"step": i + 1, "tokens_per_s": t}) + "\n" for i, t in enumerate(tokens_per_s)))


def test_step_spread_beside_the_json_gives_standard_errors_and_a_table(tmp_path, capsys):
    """Per-step metrics beside a bench JSON (both layouts trainer.bench and docs/results use) give
    each case a standard error over the same steady window as its mean; the ratio's error and the
    table's +/- follow from both cases' errors."""
    from trainer.bench.plots import ratio_error, source_table

    warm_up = [100.0, 5000.0]  # left out, as trainer.summary.summarize leaves them out
    _metrics(tmp_path / "h200_x_3d-real-large-mbs2.metrics.jsonl", warm_up + [900.0, 1000.0, 1100.0])
    _metrics(tmp_path / "h200_x_3d-mock-large-mbs2.metrics.jsonl", warm_up + [1800.0, 2000.0, 2200.0])
    _metrics(tmp_path / "h200_x_3d-synthetic-large-mbs2.metrics.jsonl", warm_up + [1.0, 2.0, 3.0])  # another run
    (tmp_path / "h200_x_bench_mbs2.json").write_text(json.dumps([
        {"case": "3d-real-large-mbs2", "rc": 0, "tokens_per_s": 1000.0, "real_token_fraction": 0.98},
        {"case": "3d-mock-large-mbs2", "rc": 0, "tokens_per_s": 2000.0, "real_token_fraction": 0.97},
        {"case": "3d-synthetic-large-mbs2", "rc": 0, "tokens_per_s": 950.0, "real_token_fraction": 0.96},
        {"case": "fsdp-real-large-mbs1", "rc": 0, "tokens_per_s": 500.0}]))
    (tmp_path / "run").mkdir()
    _metrics(tmp_path / "run" / "fsdp-real-large-mbs1.metrics.jsonl", warm_up + [400.0, 500.0, 600.0])
    (tmp_path / "run" / "bench.json").write_text(json.dumps([
        {"case": "fsdp-real-large-mbs1", "rc": 0, "tokens_per_s": 500.0}]))

    rows = load([str(tmp_path / "h200_x_bench_mbs2.json"), str(tmp_path / "run" / "bench.json")])
    sem = {(r["case"], i): r.get("tokens_per_s_sem") for i, r in enumerate(rows)}
    assert math.isclose(sem[("3d-real-large-mbs2", 0)], 100.0 / math.sqrt(3))
    assert math.isclose(sem[("3d-mock-large-mbs2", 1)], 200.0 / math.sqrt(3))
    assert sem[("3d-synthetic-large-mbs2", 2)] is None  # its metrics' mean is not its own: not paired
    assert sem[("fsdp-real-large-mbs1", 3)] is None  # no file beside the first JSON
    assert math.isclose(sem[("fsdp-real-large-mbs1", 4)], 100.0 / math.sqrt(3))

    real, mock = rows[0], rows[1]
    assert math.isclose(ratio_error(real, mock), 2.0 * math.hypot(0.1, 0.1) / math.sqrt(3))
    assert ratio_error(real, rows[2]) is None
    table = source_table(rows, "-large")
    assert "| 3d MBS 2 | 1,000 ± 115 | 0.98 | 0.95x | 0.96 | 2.00x ± 0.33x | 0.97 |" in table
    assert "fsdp MBS 1" not in table  # real alone: nothing to compare

    assert main([str(tmp_path / "h200_x_bench_mbs2.json"), "--table"]) == 0
    assert "2.00x ± 0.33x" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "h200_x_bench_mbs2.json")])
    assert "--out PNG is required" in capsys.readouterr().err


def test_older_results_with_former_metric_names_read_as_current(tmp_path, capsys):
    """Results written before the backends shared one name for the data-wait share (``data_wait_frac``)
    read as ``data_wait_share``; a row carrying both keeps the current value."""
    rows = [{"case": "3d-real-large-mbs2", "rc": 0, "tokens_per_s": 7500.0, "data_wait_frac": 0.002},
            {"case": "3d-mock-large-mbs2", "rc": 0, "tokens_per_s": 9000.0, "data_wait_frac": 0.5,
             "data_wait_share": 0.001}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    parsed = load([str(path)])
    assert [r["data_wait_share"] for r in parsed] == [0.002, 0.001]
    assert all("data_wait_frac" not in r for r in parsed)
    out = tmp_path / "by_source.png"
    assert main([str(path), "--by-source", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_groups_name_what_they_measure():
    """Every case is in a group, names are unique and parse as plots expects; group names carry no
    dates or run labels, only what they measure."""
    import re

    from trainer.bench.cases import DEFAULT_GROUPS, GROUPS
    from trainer.bench.plots import CASE

    names = [name for cases in GROUPS.values() for name, _, _ in cases]
    assert all(CASE.match(n) for n in names), [n for n in names if not CASE.match(n)]
    for cases in GROUPS.values():
        assert len({name for name, _, _ in cases}) == len(cases)
    assert set(DEFAULT_GROUPS) <= set(GROUPS)
    assert not [g for g in GROUPS if re.search(r"session|\bs\d|try|round|old|new", g, re.I)]

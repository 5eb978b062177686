"""Vision-balanced global batches: the cost model, the assignment of a step's micro-batches to DP
ranks (deterministic, disjoint, complete, equal counts), the straggler ratio it removes on shards
with mixed image sizes, and the Qwen3-VL calibration's provenance."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from datasvc.config import BalanceConfig, PoolConfig
from datasvc.pack import balance
from datasvc.pack.balance import CostModel, MicroBatchShape

ROOT = Path(__file__).resolve().parents[1]
MODEL = CostModel(decoder_per_token=1e-5, decoder_per_token_sq=1e-9, vision_per_patch=1e-5,
                  vision_per_patch_sq=5e-9, step_overhead=0.1, name="test")


def check_partition(ranks, dp, per_rank):
    assert len(ranks) == dp
    assert all(len(r) == per_rank for r in ranks)
    flat = [i for r in ranks for i in r]
    assert sorted(flat) == list(range(dp * per_rank))  # disjoint and complete


# ---- assignment ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dp,per_rank", [(2, 1), (3, 4), (8, 2), (4, 16), (64, 2)])
def test_every_rank_gets_its_count_of_disjoint_micro_batches(dp, per_rank):
    costs = np.random.default_rng(dp * 100 + per_rank).lognormal(0, 0.8, dp * per_rank)
    ranks = balance.assign(costs, dp, per_rank)
    check_partition(ranks, dp, per_rank)
    assert balance.straggler_ratio(balance.rank_costs(costs, ranks)) <= \
        balance.straggler_ratio(balance.rank_costs(costs, balance.unbalanced(dp, per_rank))) + 1e-12


def test_assignment_is_identical_when_recomputed_and_ties_follow_keys():
    costs = np.random.default_rng(1).lognormal(0, 1, 48)
    keys = [f"k{i:03d}" for i in range(48)]
    assert balance.assign(costs, 6, 8, keys) == balance.assign(costs.copy(), 6, 8, list(keys))
    flat = np.ones(8)
    a = balance.assign(flat, 4, 2, [f"{c}" for c in "hgfedcba"])
    b = balance.assign(flat, 4, 2, [f"{c}" for c in "hgfedcba"])
    assert a == b
    # Equal costs go out in key order, so keys (not positions or hashing) decide.
    assert a[0] == sorted([7, 3]) and a[3] == sorted([4, 0])


def test_wrong_micro_batch_count_fails_with_what_to_change():
    with pytest.raises(ValueError, match="every rank must pack the same global step"):
        balance.assign(np.ones(7), 2, 4)
    with pytest.raises(ValueError, match="split evenly"):
        balance.balance_step([MicroBatchShape(8, (8,), ())] * 3, 2, MODEL)


def test_lpt_with_swaps_reaches_the_optimum_on_small_steps():
    rng = np.random.default_rng(7)
    for _ in range(20):
        costs = np.round(rng.lognormal(0, 1, 6) * 100)
        best = min(max(costs[list(c)].sum(), costs.sum() - costs[list(c)].sum())
                   for c in itertools.combinations(range(6), 3))
        ranks = balance.assign(costs, 2, 3)
        assert balance.rank_costs(costs, ranks).max() <= best * (1 + 1e-3)  # refine stops within 0.1% of the mean


def test_refine_only_swaps_and_never_raises_the_costliest_rank():
    costs = np.random.default_rng(3).lognormal(0, 1.2, 40)
    start = balance.unbalanced(5, 8)
    after = balance.refine(costs, start)
    check_partition(after, 5, 8)
    assert balance.rank_costs(costs, after).max() <= balance.rank_costs(costs, start).max()


# ---- cost model ---------------------------------------------------------------------------------
def test_cost_model_separates_decoder_and_vision_and_charges_big_images_quadratically():
    one_big = MicroBatchShape(4096, (1000, 1000), (4096,))
    two_small = MicroBatchShape(4096, (1000, 1000), (2048, 2048))
    assert MODEL.decoder(one_big) == MODEL.decoder(two_small)
    assert MODEL.vision(one_big) > MODEL.vision(two_small)
    assert MODEL.vision(one_big) - MODEL.vision(two_small) == pytest.approx(5e-9 * (4096**2 - 2 * 2048**2))
    assert MODEL.cost(one_big) == pytest.approx(MODEL.decoder(one_big) + MODEL.vision(one_big))
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(decoder_per_token=-1.0)


# ---- real shards with mixed image sizes -----------------------------------------------------------
def write_mixed_shards(out: Path, n: int = 96, seed: int = 0) -> list[str]:
    """Real JPEG tars: captions over images from 64 px to 1.3k px a side (1-3 images a sample)."""
    import webdataset as wds

    from datasvc.samples import encode_image

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(n // 16):
        path = out / f"mixed-{shard:04d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for j in range(16):
                i = shard * 16 + j
                k = int(rng.choice([1, 1, 2, 3]))
                sample = {"__key__": f"s{i:05d}"}
                for m in range(k):
                    side = int(rng.choice([64, 160, 320, 640, 1280]))
                    h, w = side, int(side * rng.choice([0.75, 1.0, 1.33]))
                    img = np.full((h, w, 3), int(rng.integers(0, 255)), np.uint8)
                    sample[f"{m}.jpg" if k > 1 else "jpg"] = encode_image(img)
                if k > 1:
                    sample["json"] = json.dumps({"messages": [
                        {"role": "user", "content": "<image>\n" * k + "Describe."},
                        {"role": "assistant", "content": "words " * int(rng.integers(5, 200))}]}).encode()
                else:
                    sample["txt"] = "a caption " * int(rng.integers(3, 120))
                sink.write(sample)
        paths.append(str(path))
    return paths


def header_samples(paths: list[str], seq_len: int) -> list[tuple[int, tuple[int, ...]]]:
    from datasvc.pack.headers import encode_from_headers
    from datasvc.read.shards import ReadLimits, index_shard, read_samples
    from datasvc.registry import get_pipeline

    pipeline = get_pipeline("qwen3vl", max_pixels=1024 * 1024)
    out = []
    for path in paths:
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            ids, _, grids = encode_from_headers(raw, pipeline)
            if len(ids) <= seq_len:
                out.append((len(ids), tuple(int(t * h * w) for t, h, w in grids)))
    return out


def global_step(samples, dp: int, per_rank: int, seq_len: int, mbs: int, step: int):
    """Every rank's micro-batches of one step, rank 0's first: each rank packs its own share."""
    shapes = []
    share = len(samples) // dp
    for r in range(dp):
        mine = samples[r * share:(r + 1) * share]
        packed = balance.pack_shapes(mine, seq_len, mbs, key=f"{step}/{r}/")
        assert len(packed) >= per_rank, "the test's shards hold too few samples for this step"
        shapes.extend(s for s, _ in packed[:per_rank])
    return shapes


def rotated(items: list, by: int) -> list:
    """The plan's order of samples from a position on (a stand-in for a seeded epoch order)."""
    by %= len(items)
    return items[by:] + items[:by]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    paths = write_mixed_shards(tmp_path_factory.mktemp("mixed"))
    return header_samples(paths, 2048)


@pytest.mark.parametrize("dp", [2, 4])
def test_balanced_straggler_ratio_is_lower_on_mixed_image_sizes(mixed, dp):
    model = balance.cost_model("qwen3vl")
    shapes = global_step(mixed, dp, 4, 2048, 1, 0)
    out = balance.balance_step(shapes, dp, model)
    check_partition([list(r) for r in out.ranks], dp, 4)
    assert out.straggler_ratio_unbalanced > 1.01  # the shards do give the ranks unequal vision work
    assert out.straggler_ratio < out.straggler_ratio_unbalanced
    assert out.straggler_ratio <= 1.05
    assert out.step_s <= out.step_s_unbalanced


def test_same_assignment_after_a_restart_from_a_saved_position(mixed, tmp_path):
    """A fresh process recomputes step 3's plan from the same shards and position and deals the
    same micro-batches to the same ranks."""
    dp, per_rank = 4, 3
    steps = [balance.balance_step(global_step(rotated(mixed, 7 * s), dp, per_rank, 2048, 1, s), dp,
                                  balance.cost_model("qwen3vl")) for s in range(4)]
    saved = {"step": 3}
    (tmp_path / "position.json").write_text(json.dumps(saved))
    code = f"""
import json, numpy as np, sys
sys.path.insert(0, {str(ROOT / 'tests')!r}); sys.path.insert(0, {str(ROOT)!r})
from test_balance import global_step, header_samples, rotated, write_mixed_shards
from datasvc.pack import balance
from pathlib import Path
step = json.loads(Path({str(tmp_path / 'position.json')!r}).read_text())["step"]
mixed = header_samples(write_mixed_shards(Path({str(tmp_path / 'again')!r})), 2048)
shapes = global_step(rotated(mixed, 7 * step), {dp}, {per_rank}, 2048, 1, step)
print(json.dumps([list(r) for r in balance.balance_step(shapes, {dp}, balance.cost_model("qwen3vl")).ranks]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [list(r) for r in steps[3].ranks]


def test_predicted_straggler_over_a_stream(mixed):
    model = balance.cost_model("qwen3vl")
    shapes = [s for s, _ in balance.pack_shapes(mixed, 2048, 1)]
    n = len(shapes) // 8 * 8
    on = balance.predicted_straggler(shapes[:n], 4, 2, model, balance=True)
    off = balance.predicted_straggler(shapes[:n], 4, 2, model, balance=False)
    assert on["steps"] == off["steps"] == n // 8
    assert on["straggler_ratio"] <= off["straggler_ratio"]
    assert balance.predicted_straggler(shapes[:3], 4, 2, model, True)["straggler_ratio"] is None


def test_shape_of_a_packed_micro_batch_matches_its_plan(mixed):
    from datasvc.batch import EncodedSample
    from datasvc.pack.packing import PackingConfig, pack

    samples = [EncodedSample(f"k{i}", "s", np.ones(n, np.int64), np.ones(n, np.int64),
                             np.zeros((sum(p), 0), np.uint8), np.asarray([(1, q, 1) for q in p], np.int64).reshape(-1, 3))
               for i, (n, p) in enumerate(mixed[:40])]
    batches, _ = pack(samples, PackingConfig(seq_len=2048, micro_batch_size=2), 0)
    planned = balance.pack_shapes(mixed[:40], 2048, 2)
    assert len(batches) == len(planned)
    for b, (shape, _) in zip(batches, planned):
        got = balance.shape_of(b)
        assert got.slot_tokens == shape.slot_tokens
        assert sorted(got.sample_lengths) == sorted(shape.sample_lengths)
        assert sorted(got.image_patches) == sorted(shape.image_patches)


# ---- the Qwen3-VL calibration -------------------------------------------------------------------
def test_qwen3vl_calibrations_say_where_they_came_from():
    from pipelines.qwen3vl.cost import CALIBRATIONS

    assert {"h200-3d", "h200-3d-recompute", "h200-fsdp", "h200-depth-proxy-fsdp"} <= set(CALIBRATIONS)
    for c in CALIBRATIONS.values():
        assert "H200" in c.hardware and c.commit and c.steps > 20
        assert all((ROOT / "tests" / "data" / "recorded" / f).exists() for f in c.files)
        assert 0 < c.rms_rel_error < 0.2
        assert all(abs(e) < 0.25 for e in c.case_rel_errors.values())  # fsdp MBS 1 mock: +24%
        assert 0 < c.text_tflops < 989 and 0 < c.vision_tflops < 989  # below the H200's dense bf16 peak
    model = balance.cost_model("qwen3vl", None, "h200-3d")
    assert "h200-3d" in model.source and "fitted" in model.source
    assert "derived" in balance.cost_model("qwen3vl", "qwen3vl-235b-a22b").source


def test_refitting_the_recorded_steps_reproduces_the_stored_rates():
    from pipelines.qwen3vl import cost

    from datasvc.tools.bench.balance import photo_stats

    stats = photo_stats("qwen3vl", 1024 * 1024)
    inputs = cost.calibration_inputs(str(ROOT / "tests" / "data" / "recorded"))
    for name, stored in cost.CALIBRATIONS.items():
        files, kw = inputs[name]
        again = cost.fit(name, files, stats, **kw)
        assert again.text_tflops == pytest.approx(stored.text_tflops, rel=1e-3)
        assert again.vision_tflops == pytest.approx(stored.vision_tflops, rel=1e-3)
        assert again.step_overhead_s == pytest.approx(stored.step_overhead_s, abs=1e-3)


def test_unknown_calibration_or_pipeline_fails_fast():
    with pytest.raises(ValueError, match="unknown calibration"):
        balance.cost_model("qwen3vl", None, "nope")
    with pytest.raises(ValueError, match="unknown pipeline"):
        balance.cost_model("nope")


def test_feeders_that_derive_the_same_plan_train_disjoint_micro_batches(mixed):
    """Each of 3 feeders derives every rank's planned micro-batches (payload: the sample indices)
    and keeps its own share: the shares are disjoint, complete, per_rank each, identical across
    feeders, and a feeder started at a later step agrees with the others from there."""
    dp, per_rank = 3, 2
    share = len(mixed) // dp

    def streams():
        return [[(shape, (r, tuple(members))) for shape, members in
                 balance.pack_shapes(mixed[r * share:(r + 1) * share], 2048, 1, key=f"{r}/")] for r in range(dp)]

    model = balance.cost_model("qwen3vl")
    views = [list(balance.balance_streams(streams(), per_rank, model)) for _ in range(dp)]
    assert views[0] == views[1] == views[2] and len(views[0]) >= 2
    for step in views[0]:
        assert all(len(mine) == per_rank for mine in step)
        flat = [p for mine in step for p in mine]
        assert len(set(flat)) == len(flat) == dp * per_rank
    later = list(balance.balance_streams([s[per_rank:] for s in streams()], per_rank, model))
    assert later == views[0][1:]


# ---- the balanced stream ----------------------------------------------------------------------------
def stream_config(shards, **kw):
    from datasvc.config import ServiceConfig

    base = dict(shards=tuple(shards), seq_len=1024, micro_batch_size=1, samples_per_item=4, items_per_block=3,
                pipeline_options={"max_pixels": 512 * 512}, epochs=1, dp_size=2,
                balance=BalanceConfig(enabled=True, micro_batches_per_step=2))
    base.update(kw)
    return ServiceConfig(**base)


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory):
    return write_mixed_shards(tmp_path_factory.mktemp("mixed-stream"), n=64, seed=1)


def test_balanced_streams_of_all_ranks_are_disjoint_and_fill_every_step(mixed_shards):
    from datasvc.stream.balanced import BalancedProducer
    from datasvc.stream.producer import BlockProducer

    cfg = stream_config(mixed_shards)
    got = {r: list(BalancedProducer(cfg, r).micro_batches()) for r in range(2)}
    steps = min(len(g) for g in got.values()) // 2
    assert steps >= 2 and len(got[0]) == len(got[1]) == 2 * steps
    keys = {r: [k for b, _ in got[r] for k in b.sample_keys] for r in range(2)}
    assert not set(keys[0]) & set(keys[1])
    assert [p.step for _, p in got[0]] == list(range(2 * steps))
    # Each step holds exactly the micro-batches the ranks would have trained unbalanced, dealt anew.
    plain = unbalanced_config(cfg)
    own = {r: list(BlockProducer(plain, r).micro_batches()) for r in range(2)}
    for s in range(steps):
        balanced = sorted(k for r in range(2) for b, _ in got[r][2 * s:2 * s + 2] for k in b.sample_keys)
        unbalanced = sorted(k for r in range(2) for b, _ in own[r][2 * s:2 * s + 2] for k in b.sample_keys)
        assert balanced == unbalanced
    # Pixels came through: the merged micro-batches carry the decoded rows of their images.
    from datasvc.media.vision import finish_resize
    from datasvc.registry import get_pipeline

    b = got[0][0][0]
    spec = get_pipeline(cfg.pipeline).vision
    rows = finish_resize(b.pixels, spec, b.image_grid_thw, b.image_frame_hw)
    assert rows.shape[0] == int(b.image_grid_thw.prod(axis=1).sum()) and b.pixels.shape[1] > 0


def unbalanced_config(cfg):
    import dataclasses

    return dataclasses.replace(cfg, balance=BalanceConfig())


def test_balanced_stream_resumes_exactly_and_reports_its_straggler_ratio(mixed_shards):
    from datasvc.stream.balanced import BalancedProducer

    cfg = stream_config(mixed_shards)
    full = BalancedProducer(cfg, 1)
    reference = [b.sample_keys for b, _ in full.micro_batches()]
    stats = full.stats().balance
    assert stats.steps == len(reference) // 2
    assert stats.straggler_ratio <= stats.straggler_ratio_unbalanced
    for cut in (2, 3):  # a step boundary and the middle of a step
        again = BalancedProducer(cfg, 1, start={"step": cut})
        assert [b.sample_keys for b, _ in again.micro_batches()] == reference[cut:]


def test_balance_dp_without_a_step_size_fails_fast(mixed_shards):
    with pytest.raises(ValueError, match="micro_batches_per_step"):
        stream_config(mixed_shards, balance=BalanceConfig(enabled=True, micro_batches_per_step=1))


def test_balanced_service_on_ray_matches_the_plan_and_resumes(mixed_shards, ray_local):
    """Two DP ranks through the real service (feeders, actor pools, object store): each rank gets
    the balanced stream its in-process plan says, both consumers of a replica get the same one, the
    ranks' samples are disjoint, and a client restored from a saved state continues exactly."""
    import uuid

    from datasvc.service.client import DataService
    from datasvc.service.feeder import EndOfData
    from datasvc.stream.balanced import BalancedProducer

    import dataclasses
    import threading

    cfg = stream_config(mixed_shards, pool=PoolConfig(max_actors=1, autoscale_interval_s=60.0))
    expected = {r: [b.sample_keys for b, _ in BalancedProducer(cfg, r).micro_batches()] for r in range(2)}

    def drain(client):
        out = []
        try:
            while True:
                out.append(next(client).sample_keys)
        except EndOfData:
            return out

    # Two consumers a replica (its TP/PP/CP ranks): both must see the identical balanced stream.
    svc = DataService(dataclasses.replace(cfg, consumers_per_replica=2), run=f"bal{uuid.uuid4().hex[:8]}")
    try:
        clients = {(r, c): svc.client(r, c, output="numpy") for r in range(2) for c in range(2)}
        seen: dict = {}
        threads = [threading.Thread(target=lambda k=k: seen.__setitem__(k, drain(clients[k]))) for k in clients]
        [t.start() for t in threads]
        [t.join(timeout=300) for t in threads]
        ranks = svc.stats().ranks
    finally:
        svc.shutdown()
    for rank in ranks:
        b = rank.stream.balance
        assert b.steps >= 2 and b.straggler_ratio <= b.straggler_ratio_unbalanced
        assert rank.stream.accounting.delivered == sum(len(k) for k in expected[rank.stream.rank])
    got = {r: seen[(r, 0)] for r in range(2)}
    assert all(seen[(r, 1)] == got[r] for r in range(2))
    assert got == expected and all(len(v) >= 4 for v in got.values())
    assert not {k for b in got[0] for k in b} & {k for b in got[1] for k in b}

    svc = DataService(cfg, run=f"bal{uuid.uuid4().hex[:8]}")
    try:
        c = svc.client(1, output="numpy")
        first = [next(c).sample_keys for _ in range(3)]
        state = c.save_state()
    finally:
        svc.shutdown()
    svc = DataService(cfg, run=f"bal{uuid.uuid4().hex[:8]}")
    try:
        c2 = svc.client(1, output="numpy")
        c2.restore_state(state)
        assert first + drain(c2) == expected[1]
    finally:
        svc.shutdown()


def test_profile_prediction_for_many_ranks_from_one_ranks_micro_batches(mixed):
    model = balance.cost_model("qwen3vl")
    shapes = [s for s, _ in balance.pack_shapes(mixed, 2048, 1)]
    on = balance.profile_straggler(shapes, 64, 4, model, True)
    off = balance.profile_straggler(shapes, 64, 4, model, False)
    assert on["steps"] == off["steps"] == 16 and on["dp"] == 64 and on["micro_batches_per_rank"] == 4
    assert on["straggler_ratio"] < off["straggler_ratio"] and on["straggler_ratio"] <= 1.05
    assert on == balance.profile_straggler(shapes, 64, 4, model, True)  # seeded: the same every time
    assert balance.profile_straggler([], 8, 2, model, True)["straggler_ratio"] is None


# ---- the profiler's prediction ------------------------------------------------------------------
def test_profile_writes_the_predicted_straggler_ratio_with_and_without_balancing(tmp_path):
    """``vlmfeed profile SHARDS --dp N --balance on|off --out DIR`` writes DIR/profile.json with
    ``straggler_ratio`` per setting: lower balanced than not, and within 1.05 balanced."""
    import shutil
    import tempfile

    shards = write_mixed_shards(tmp_path / "shards", n=64, seed=2)
    ray_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths have a length limit
    out = {}
    try:
        for b in ("on", "off"):
            cmd = [sys.executable, "-m", "datasvc.tools.profile", *shards, "--dp", "4", "--balance", b,
                   "--out", str(tmp_path / b), "--mbs", "1", "--actors", "1", "--samples", "48", "--num-cpus", "1",
                   "--no-progress", "--max-pixels", str(512 * 512), "--seq-len", "2048"]
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "RAY_TMPDIR": ray_dir}, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            out[b] = json.loads((tmp_path / b / "profile.json").read_text())
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    on, off = out["on"]["straggler_ratio"], out["off"]["straggler_ratio"]
    assert on.keys() == off.keys() == {"MBS 1, 1 actor(s)"}
    for setting in on:
        assert on[setting] < off[setting] and on[setting] <= 1.05
    run = out["on"]["runs"][0]["straggler"]
    assert run["dp"] == 4 and run["balance"] is True and run["measured_micro_batches"] > 0


def test_a_calibration_prices_its_own_model_as_fitted_and_others_as_derived():
    from pipelines.qwen3vl import cost

    own = cost.cost_model(calibration="h200-depth-proxy-fsdp")
    assert own.name == "qwen3vl-30b-a3b-48layers-16experts" and own.source.endswith("fitted on this model")
    other = cost.cost_model(cost.MEASURED_PRESET, calibration="h200-depth-proxy-fsdp")
    assert other.name == cost.MEASURED_PRESET and "rates fitted on qwen3vl-30b-a3b-48layers-16experts" in other.source
    assert own.decoder_per_token > 4 * other.decoder_per_token  # 48 decoder layers against 4, same embeddings
    # The trainer's 4-layer proxy, spelled as the preset with its override, is the model the 3d runs fitted.
    assert cost.cost_model("qwen3vl-30b-a3b", "h200-3d", num_layers=4) == cost.cost_model(calibration="h200-3d")


@pytest.mark.parametrize("strategy,recompute,calibration", [("3d", False, "h200-3d"), ("3d", True, "h200-3d-recompute"),
                                                            ("fsdp", False, "h200-fsdp"),
                                                            ("fsdp", True, "h200-depth-proxy-fsdp")])
def test_trainer_balances_with_the_calibration_of_its_setting_at_its_models_flops(strategy, recompute, calibration):
    from trainer.config import from_args
    from trainer.job import balance_cost
    from trainer.run import parse_args

    flags = ["qwen3vl", "--strategy", strategy, "--model-preset", "qwen3vl-30b-a3b-48layers-16experts", "--balance-dp"]
    options = balance_cost(from_args(parse_args(flags + (["--recompute", "full"] if recompute else []))))
    assert options["calibration"] == calibration and options["preset"] == "qwen3vl-30b-a3b-48layers-16experts"
    model = balance.cost_model("qwen3vl", **options)  # what every feeder builds from the config
    assert model.name == "qwen3vl-30b-a3b-48layers-16experts"
    assert ("fitted on this model" in model.source) == (calibration == "h200-depth-proxy-fsdp")
    frozen = balance.cost_model("qwen3vl", **{**options, "vision_trainable": False})
    assert frozen.vision_per_patch == pytest.approx(model.vision_per_patch / 3)  # forward only: 2 of 6 FLOPs
    assert frozen.decoder_per_token == model.decoder_per_token


def test_the_cost_model_is_checked_against_recorded_steps_it_was_not_fitted_on():
    """Packed rows of a later H200 run (their own recorded inputs) are predicted within 15%; a run
    recorded before steps carried their inputs is reported as such, not guessed."""
    from datasvc.tools.bench.balance import check_recorded

    runs = ROOT / "tests" / "data" / "recorded" / "h200"
    held_out = str(runs / "peers-train-mbs2-mbs4" / "vlmfeed-cpu-mbs4.metrics.jsonl")
    older = str(runs / "train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4" / "3d-real-large-mbs2.metrics.jsonl")
    new, old = check_recorded([held_out, older], "qwen3vl", "h200-3d-recompute")
    assert new["steps"] >= 10 and abs(new["mean_rel_error"]) < 0.15 and new["rms_rel_error"] < 0.2
    assert old["steps"] == 0 and "cost inputs" in old["why"]

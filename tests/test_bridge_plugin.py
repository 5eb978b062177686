"""Bring your own trainer: any Megatron-Bridge ConfigContainer fed by vlmfeed (trainer/megatron/provider.py),
Bridge's own Qwen3-VL-8B LoRA recipe built that way without network (docs/examples/bridge_recipe.py),
and Bridge-style KEY=VALUE overrides for ``python -m trainer.run``, refused on the CPU path and checked
before Ray starts on the Megatron one. Tests that train need CUDA and are marked ``gpu``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from test_megatron_config import _OK, _WHY, needs_bridge, proxy
from trainer.config import TrainConfig

HAS_CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "bridge_recipe.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))


@pytest.fixture(scope="module")
def mb():
    if not _OK:
        pytest.skip(_WHY)
    from trainer.megatron import container, overrides, provider
    return container, provider, overrides


def small_container(mb, **train):
    container, _, _ = mb
    return container.build_config_container(proxy(train=TrainConfig(**{"mbs": 1, "gbs": 1, "seq_len": 1024,
                                                                        **train})), 1)


# ------------------------------------------------------------------------------------------------
# The plug-in
# ------------------------------------------------------------------------------------------------
@needs_bridge
def test_geometry_comes_from_the_container(mb, photo_shards):
    _, provider, _ = mb
    c = small_container(mb, mbs=2, gbs=16, seq_len=2048)
    c.model.tensor_model_parallel_size, c.model.pipeline_model_parallel_size = 2, 2
    feed = provider.feed_from_vlmfeed(c, photo_shards, world_size=16, items_per_block=2)
    d = feed.data_cfg
    assert (d.seq_len, d.micro_batch_size, d.dp_size, d.consumers_per_replica) == (2048, 2, 4, 4)
    assert d.balance.micro_batches_per_step == 2 and d.pack and d.epochs is None  # for_training's stream
    assert type(c.dataset).__name__ == "VlmfeedDataProvider" and c.dataset.dataloader_type == "external"
    assert c.model.calculate_per_token_loss and not c.ddp.average_in_collective
    assert c.model.variable_seq_lengths  # PP stages exchange the flat THD stream's shape
    assert type(feed.forward_step().inner).__name__ == "PackedForwardStep"
    layout = provider.rank_layout(c, 5, 16)  # Megatron's order: tp fastest, then cp, dp, pp
    assert (layout.dp_rank, layout.consumer) == (2, 1)

    c.train.micro_batch_size = 4  # changed after feeding: the service would make other rows
    with pytest.raises(ValueError, match=r"rows per micro-batch \(train.micro_batch_size\): container 4, data "
                                         r"service 2"):
        provider.check_geometry(c, d, 16)


@needs_bridge
def test_rank_zero_owns_the_service_and_bridge_gets_the_stream(mb, photo_shards, ray_local, monkeypatch):
    """The recipe's path end to end on CPU: the provider starts the service when Bridge builds the
    datasets, the stream yields the container's rows, its state is what Bridge checkpoints, and the
    end of training shuts the service down."""
    import ray
    import torch.distributed as dist
    from megatron.bridge.data.utils import get_dataset_provider

    from datasvc.config import PoolConfig
    from datasvc.service.feeder import feeder_name

    _, provider, _ = mb
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    c = small_container(mb, mbs=2, gbs=2)
    feed = provider.feed_from_vlmfeed(c, photo_shards, world_size=1, run="plugin-test", max_pixels=64 * 64,
                                      pool=PoolConfig(min_actors=1, max_actors=1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train_ds, valid_ds, _ = get_dataset_provider(c.dataset)([2, 0, 0], c.dataset)
        assert train_ds is feed.iterator and valid_ds is None
        batch = next(train_ds)
        assert tuple(batch.tokens.shape) == (2, 1024) and batch.pixel_values.shape[0] > 0
        state = train_ds.save_state()
        assert state["dp_rank"] == 0 and state["step"] == 1
        ray.get_actor(feeder_name("plugin-test", 0))  # started by rank 0, named for the run
        release = [cb for cb in feed.callbacks() if type(cb).__name__ == "ReleaseService"]
        release[0].on_train_end(None)
        assert feed.provider.owner.service is None and feed.provider.owner.data_stats.accounting.delivered > 0
        with pytest.raises(ValueError):
            ray.get_actor(feeder_name("plugin-test", 0))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Bridge's own recipe, offline
# ------------------------------------------------------------------------------------------------
BUILD_RECIPE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import bridge_recipe
    from megatron.bridge.training.config import runtime_config_update
    from trainer.megatron.overrides import BridgeOverrides

    cfg, feed = bridge_recipe.build_config(sys.argv[2], recipe=sys.argv[4], overrides=BridgeOverrides(
        items=("train.global_batch_size=8", "model.seq_length=2048")), out=sys.argv[3], items_per_block=2)
    runtime_config_update(cfg)  # Bridge's own checks of the finished container, on CPU
    m, d = cfg.model, feed.data_cfg
    print(json.dumps({
        "dataset": type(cfg.dataset).__name__, "loader": cfg.dataset.dataloader_type,
        "step": type(feed.forward_step().inner).__name__, "peft": type(cfg.peft).__name__,
        "model": type(m).__name__, "ep": m.expert_model_parallel_size, "experts": m.num_moe_experts,
        "pretrained": cfg.checkpoint.pretrained_checkpoint, "gbs": cfg.train.global_batch_size,
        "model_seq": m.seq_length, "model_mbs": cfg.train.micro_batch_size, "dataset_seq": cfg.dataset.seq_length,
        "data_seq": d.seq_len, "data_mbs": d.micro_batch_size, "data_dp": d.dp_size,
        "per_step": d.balance.micro_batches_per_step,
        "dims": [m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
                 m.kv_channels, m.vision_config.depth, m.vision_config.out_hidden_size]}))
""")


@needs_bridge
@pytest.mark.parametrize("recipe, model, peft, dims", [
    ("peft-8b", "Qwen3VLModelProvider", "LoRA", [36, 4096, 12288, 32, 8, 128, 27, 4096]),
    pytest.param("sft-30b-a3b", "Qwen3VLMoEModelProvider", "NoneType", [4, 2048, 6144, 32, 4, 128, 27, 2048],
                 marks=pytest.mark.skipif(not HAS_CUDA, reason="Bridge 0.6.2's MoE recipe asks the GPU's properties "
                                          "(apply_flex_dispatcher_backend), so it builds only where CUDA is")),
])
def test_bridges_recipe_builds_offline_fed_by_vlmfeed(tmp_path, recipe, model, peft, dims):
    """A separate process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported."""
    import bridge_recipe

    snapshot = bridge_recipe.write_hf_cache(str(tmp_path / "hf"))
    assert json.load(open(os.path.join(snapshot, "config.json")))["text_config"]["num_hidden_layers"] == 36
    bridge_recipe.write_hf_cache(str(tmp_path / "hf"), bridge_recipe.qwen3_vl_30b_a3b_config(),
                                 repo=bridge_recipe.MOE_HF_REPO)
    base = tmp_path / "base"
    base.mkdir()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "WORLD_SIZE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", BUILD_RECIPE, os.path.dirname(EXAMPLE), str(base), str(tmp_path),
                           recipe], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["dataset"], got["loader"], got["step"], got["model"], got["peft"]) == (
        "VlmfeedDataProvider", "external", "PackedForwardStep", model, peft)
    assert got["pretrained"] == str(base) and got["gbs"] == 8 and got["ep"] == 1
    assert got["model_seq"] == got["dataset_seq"] == got["data_seq"] == 2048  # the override, read by vlmfeed
    assert got["model_mbs"] == got["data_mbs"] == 2 and got["data_dp"] == 1 and got["per_step"] == 4
    assert got["dims"] == dims and got["experts"] == (128 if recipe == "sft-30b-a3b" else None)


def test_lora_without_a_base_is_refused_before_anything_is_built(tmp_path):
    import bridge_recipe

    with pytest.raises(SystemExit, match="LoRA adapts a base model: give --pretrained DIR"):
        bridge_recipe.main(["train", "--out", str(tmp_path)])


def test_a_downloaded_model_in_the_cache_is_left_alone(tmp_path):
    import bridge_recipe

    entry = tmp_path / "hub" / "models--Qwen--Qwen3-VL-8B-Instruct"
    (entry / "snapshots" / "abc123").mkdir(parents=True)
    (entry / "snapshots" / "abc123" / "config.json").write_text('{"real": true}')
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")
    assert bridge_recipe.write_hf_cache(str(tmp_path)) == str(entry / "snapshots" / "abc123")
    assert json.loads((entry / "snapshots" / "abc123" / "config.json").read_text()) == {"real": True}


def tiny_qwen3_vl_config():
    """A dense Qwen3-VL small enough to build in seconds, with the real patch geometry and vocabulary."""
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(
        text_config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128, rope_parameters={
                             "rope_type": "default", "rope_theta": 5_000_000, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
                           deepstack_visual_indexes=[0, 1]),
        tie_word_embeddings=False)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


@needs_bridge
def test_random_base_is_a_checkpoint_bridge_can_start_peft_from(tmp_path):
    import bridge_recipe
    from megatron.bridge.training.utils.checkpoint_utils import is_hf_checkpoint_dir

    out = bridge_recipe.write_random_base(str(tmp_path / "base"), tiny_qwen3_vl_config())
    assert is_hf_checkpoint_dir(out)


# ------------------------------------------------------------------------------------------------
# KEY=VALUE overrides
# ------------------------------------------------------------------------------------------------
def test_overrides_parse_anywhere_after_the_pipeline():
    from trainer.run import parse_args

    args = parse_args(["qwen3vl", "optimizer.adam_beta2=0.95", "--mbs", "2", "logger.log_interval=5",
                       "--config-file", "opt.yaml"])
    assert args.overrides == ["optimizer.adam_beta2=0.95", "logger.log_interval=5"] and args.mbs == 2
    assert args.config_file == "opt.yaml" and parse_args(["qwen3vl"]).overrides == []


@pytest.mark.parametrize("argv, needle", [
    (["qwen3vl", "extra"], "'extra': after the pipeline come only Megatron-Bridge overrides, KEY=VALUE"),
    (["qwen3vl", "--shards", "a.tar", "optimizer.lr=1e-4"],
     "--shards took 'optimizer.lr=1e-4', which reads as a Megatron-Bridge override"),
])
def test_misplaced_overrides_are_named(argv, needle, capsys):
    from trainer.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_cpu_path_refuses_overrides_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer.run", "qwen3vl", "--backend", "cpu", "--out",
                           str(tmp_path), "optimizer.adam_beta2=0.95"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and "apply to the Megatron-Bridge backend" in last[0], proc.stderr
    assert "Traceback" not in proc.stderr


@needs_bridge
def test_an_unknown_key_fails_in_the_driver_before_ray_starts(tmp_path):
    import ray

    from trainer.job import build_job
    from trainer.megatron.overrides import OverrideError
    from trainer.run import parse_args

    was_running = ray.is_initialized()
    args = parse_args(["qwen3vl", "--backend", "megatron", "--fit", "off", "--out", str(tmp_path),
                       "optimizer.adam_beta3=0.9"])
    with pytest.raises(OverrideError) as err:
        build_job(args)
    msg = str(err.value)
    assert "\n" not in msg and "Could not override 'optimizer.adam_beta3'" in msg  # Bridge's words
    assert msg.endswith("(did you mean optimizer.adam_beta2, optimizer.adam_beta1, optimizer.adam_eps?)")
    assert "+optimizer" not in msg  # Hydra's advice to append a key: the dataclasses take none
    assert ray.is_initialized() == was_running  # nothing was started


@needs_bridge
def test_overrides_apply_yaml_then_items_and_keep_the_stream(mb):
    _, provider, overrides = mb
    from trainer.megatron.metrics import TimedIterator

    it = TimedIterator(iter([]))
    c = small_container(mb)
    provider.feed_from_stream(c, it)
    o = overrides.BridgeOverrides(items=("optimizer.adam_beta2=0.9", "logger.log_interval=5"), config_file="x.yaml",
                                  config_text="optimizer:\n  lr: 0.002\n  adam_beta2: 0.5\n")
    overrides.apply_overrides(c, o, keeps=overrides.TRAINER_RUN_KEEPS)
    assert (c.optimizer.lr, c.optimizer.adam_beta2, c.logger.log_interval) == (0.002, 0.9, 5)
    assert c.dataset.iterator is it and type(c.model).__name__ == "Qwen3VLMoEModelProvider"


@needs_bridge
@pytest.mark.parametrize("o, needle", [
    (dict(items=("train.micro_batch_size=4",)),
     "train.micro_batch_size comes from trainer.run's --mbs; set that instead"),
    (dict(items=("dataset.num_workers=4",)), "dataset.num_workers comes from trainer.run's data flags"),
    (dict(items=("optimizer.adam_beta2=abc",)), "optimizer.adam_beta2='abc': Bridge's field holds a float"),
    (dict(items=("+optimizer.adam_beta3=0.9",)), "take no new keys"),
    (dict(config_file="o.yaml", config_text="optimizer:\n  adam_beta3: 0.9\n"),
     "--config-file o.yaml: Key 'adam_beta3'"),
])
def test_overrides_that_cannot_work_are_refused_in_one_line(mb, o, needle):
    _, _, overrides = mb
    with pytest.raises(overrides.OverrideError) as err:
        overrides.apply_overrides(small_container(mb), overrides.BridgeOverrides(**o),
                                  keeps=overrides.TRAINER_RUN_KEEPS)
    assert needle in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------
@needs_bridge
@pytest.mark.gpu
def test_the_example_trains_and_resumes_a_tiny_qwen3_vl_with_lora(tmp_path, photo_shards):
    """The example's whole path on one GPU, on a tiny dense Qwen3-VL put in the HF cache: LoRA from a
    random-init HF base, the service started by the provider, the loader state saved in Bridge's
    checkpoint and taken up by a second run."""
    import bridge_recipe

    bridge_recipe.write_hf_cache(str(tmp_path / "hf"), tiny_qwen3_vl_config())
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    run = [sys.executable, EXAMPLE]
    subprocess.run(run + ["random-base", str(tmp_path / "base")], env=env, check=True, timeout=600)
    common = ["train", "--pretrained", str(tmp_path / "base"), "--out", str(tmp_path / "out"), "--shards",
              *photo_shards, "--data-actors", "1", "2", "model.seq_length=1024", "train.global_batch_size=4",
              "checkpoint.save_interval=2"]

    def summary(*extra):
        proc = subprocess.run(run + common + list(extra), env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"steps"')][-1])

    first = summary("train.train_iters=2")
    assert first["steps"] == 2 and first["tokens_per_s"] > 0 and first["peak_mem_gib"] > 0
    assert os.path.exists(tmp_path / "out" / "checkpoints" / "energon" / "iter_0000002" /
                          "train_dataloader_dprank000.pt")
    resumed = summary("train.train_iters=4")
    assert (resumed["first_step"], resumed["last_step"]) == (3, 4)


@needs_bridge
@pytest.mark.gpu
def test_trainer_run_applies_overrides_on_the_ranks(tmp_path, photo_shards):
    """With the scheduler made constant by overrides, every step trains at --lr (the flags alone warm up)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.run", "qwen3vl", "--backend", "megatron", "--world-size", "1",
           "--fit", "off", "--num-layers", "4", "--seq-len", "1024", "--train-iters", "3", "--out", str(out),
           "--shards", *photo_shards, "--", "scheduler.lr_warmup_iters=0", "scheduler.lr_decay_style=constant"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["lr"] for r in records] == [pytest.approx(1e-4)] * 3
    assert json.load(open(out / "summary.json"))["bridge_overrides"]["items"] == [
        "scheduler.lr_warmup_iters=0", "scheduler.lr_decay_style=constant"]


@needs_bridge
def test_the_readme_recipe_names_what_bridge_and_the_plugin_have():
    """The README's plug-in example: the recipe it imports exists in Bridge, and the plug-in's calls
    exist with the arguments the example passes."""
    import ast
    import importlib
    import inspect

    from test_public_api import readme_python_blocks

    (code,) = readme_python_blocks("Use it from your own Megatron-Bridge recipe")
    tree = ast.parse(code)
    import bridge_recipe

    for node in (n for n in tree.body if isinstance(n, ast.ImportFrom)):
        # Bridge's recipes package imports every family's recipes; the example loads the one it needs
        module = (bridge_recipe.qwen3_vl_recipes() if node.module == bridge_recipe.RECIPE_MODULE
                  else importlib.import_module(node.module))
        for alias in node.names:
            assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
    from trainer.megatron.provider import VlmfeedFeed, feed_from_vlmfeed
    from datasvc.training import training_config

    assert "max_pixels" in inspect.signature(training_config).parameters
    assert "shards" in inspect.signature(feed_from_vlmfeed).parameters
    assert callable(VlmfeedFeed.forward_step) and callable(VlmfeedFeed.callbacks)

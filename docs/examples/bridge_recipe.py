"""Megatron-Bridge's own Qwen3-VL recipes, trained on vlmfeed's data service.

The recipe is Bridge 0.6.2's ``qwen3_vl_8b_peft_1gpu_h100_bf16_config()`` (LoRA on Qwen3-VL-8B-Instruct,
one GPU), or with ``--recipe sft-30b-a3b`` its ``qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config()`` (full SFT
of Qwen3-VL-30B-A3B) made to fit one GPU (no expert parallelism, 4 of its 48 decoder layers).
``trainer.megatron.provider.feed_from_vlmfeed`` swaps the recipe's dataset for vlmfeed's stream (the
sequence length, rows per micro-batch and DP size are read from the container) and supplies the packed
forward step; Bridge's ``pretrain`` trains it::

    python docs/examples/bridge_recipe.py train --pretrained DIR [--shards 'shards/*.tar'] [KEY=VALUE ...]

KEY=VALUE items are Bridge overrides of the recipe (``train.train_iters=20 train.global_batch_size=8``),
applied before vlmfeed reads the geometry. With several GPUs, start Ray first and use torchrun:
``ray start --head --node-ip-address 127.0.0.1``, then ``RAY_ADDRESS=127.0.0.1:6379 torchrun
--nproc-per-node 8 docs/examples/bridge_recipe.py train ...``.

What the recipe needs from Hugging Face, and how to give it without network:
  - ``AutoBridge.from_hf_pretrained("Qwen/Qwen3-VL-8B-Instruct")`` reads the model's config.json only
    (the recipe builds the model with ``load_weights=False``). ``hf-cache`` writes that file into the
    Hugging Face cache (``$HF_HOME/hub/models--Qwen--Qwen3-VL-8B-Instruct/snapshots/<rev>/``) from
    transformers' ``Qwen3VLConfig`` with the published dimensions, and Qwen3-VL-30B-A3B-Instruct's from
    the repository's own preset (``pipelines.qwen3vl``); run with ``HF_HUB_OFFLINE=1``.
  - LoRA adapts a base model, so Bridge requires ``checkpoint.pretrained_checkpoint`` (its config check
    asserts it, and the PEFT hook loads it before wrapping): a Megatron checkpoint (Bridge's
    ``convert_checkpoints.py import``) or a Hugging Face model directory. ``--pretrained`` names it.
    Without the real weights, ``random-base DIR`` writes a randomly initialised Hugging Face checkpoint
    of that config: the model trains at its real size and shape, so tokens/s, data wait and memory are
    real, but the loss means nothing. The SFT recipe trains from random weights without a base.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import socket
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trainer.megatron.overrides import BridgeOverrides, add_override_args, apply_overrides  # noqa: E402

HF_REPO = "Qwen/Qwen3-VL-8B-Instruct"
MOE_HF_REPO = "Qwen/Qwen3-VL-30B-A3B-Instruct"
RECIPE_MODULE = "megatron.bridge.recipes.qwen_vl.h100.qwen3_vl"
# name -> (Bridge's recipe function, whether it adapts a base model (LoRA), the overrides that fit it to
# one GPU, applied before the user's)
RECIPES = {
    "peft-8b": ("qwen3_vl_8b_peft_1gpu_h100_bf16_config", True, ()),
    # Full SFT keeps fp32 main weights and Adam moments: all 48 layers need about 586 GiB on one GPU
    # (python -m trainer.plan, README), 4 layers with all 128 experts each fit one.
    "sft-30b-a3b": ("qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config", False,
                    ("model.expert_model_parallel_size=1", "model.num_layers=4")),
}

# Qwen3-VL-8B-Instruct's published dimensions. Sources: torchtitan's Qwen3-VL "8B" flavour
# (pytorch/torchtitan, torchtitan/experiments/qwen3_vl/__init__.py: dim 4096, 36 layers, FFN 12288,
# 32 heads, 8 KV heads, head dim 128, RoPE theta 5e6, MRoPE sections [24, 20, 20]; vision 27 layers
# of width 1152, FFN 4304, 16 heads, patch 16, output width 4096, DeepStack taps [8, 16, 24]; untied
# embeddings, unlike its 2B), which Qwen3-VL-8B-based configs on GitHub repeat with max_position_
# embeddings 262144 and interleaved MRoPE. Token ids and vocabulary are transformers' Qwen3VLConfig
# defaults, which are the published ones (Megatron-Bridge's Qwen3VLModelProvider cites the same
# config.json for them).
TEXT_CONFIG = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                   hidden_act="silu", attention_bias=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 5_000_000,
                                    "mrope_section": [24, 20, 20], "mrope_interleaved": True})
VISION_CONFIG = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                     temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=4096,
                     num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                     hidden_act="gelu_pytorch_tanh")


# ------------------------------------------------------------------------------------------------
# Offline: what AutoBridge reads, and a base for LoRA
# ------------------------------------------------------------------------------------------------
def qwen3_vl_8b_config():
    """transformers' ``Qwen3VLConfig`` at Qwen3-VL-8B-Instruct's dimensions."""
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, tie_word_embeddings=False)
    config.architectures = ["Qwen3VLForConditionalGeneration"]  # what AutoBridge dispatches on
    return config


def qwen3_vl_30b_a3b_config():
    """Qwen3-VL-30B-A3B-Instruct's config, from the repository's preset (the same one trainer.run uses)."""
    from pipelines.qwen3vl.arch import arch
    from pipelines.qwen3vl.megatron import hf_config

    return hf_config(arch("qwen3vl-30b-a3b"))


def write_hf_cache(hf_home: str, config=None, repo: str = HF_REPO) -> str:
    """Writes ``config.json`` as the Hugging Face cache holds a downloaded one, so that with
    ``HF_HUB_OFFLINE=1`` and this ``HF_HOME`` ``from_pretrained(repo)`` finds it. A cache that
    already holds the model is left alone. Returns the snapshot directory."""
    entry = os.path.join(hf_home, "hub", "models--" + repo.replace("/", "--"))
    ref = os.path.join(entry, "refs", "main")
    if os.path.exists(ref):
        with open(ref) as f:
            held = os.path.join(entry, "snapshots", f.read().strip())
        if os.path.exists(os.path.join(held, "config.json")):
            return held
    text = (config or qwen3_vl_8b_config()).to_json_string()
    revision = hashlib.sha1(text.encode()).hexdigest()  # stands in for the hub's commit hash
    snapshot = os.path.join(entry, "snapshots", revision)
    os.makedirs(snapshot, exist_ok=True)
    with open(os.path.join(snapshot, "config.json"), "w") as f:
        f.write(text)
    os.makedirs(os.path.dirname(ref), exist_ok=True)
    with open(ref, "w") as f:
        f.write(revision)
    return snapshot


def write_random_base(out_dir: str, config=None) -> str:
    """A Hugging Face checkpoint of ``config`` (default: the cached Qwen3-VL-8B-Instruct config) with
    random weights, in bf16: a LoRA base of the real size and shape whose loss means nothing."""
    import torch
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    config = config or AutoConfig.from_pretrained(HF_REPO)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 8B weights is minutes on CPU
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


# ------------------------------------------------------------------------------------------------
# The recipe, fed by vlmfeed
# ------------------------------------------------------------------------------------------------
def qwen3_vl_recipes() -> types.ModuleType:
    """Bridge's Qwen3-VL recipe module. Bridge 0.6.2's ``megatron.bridge.recipes`` package imports every
    model family's recipes, and the FLUX ones need ``diffusers``; where such a package is missing, the
    Qwen3-VL module is loaded under a bare package of the same directory instead."""
    try:
        return importlib.import_module(RECIPE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("megatron"):
            raise
    import megatron.bridge

    package = types.ModuleType("megatron.bridge.recipes")
    package.__path__ = [os.path.join(os.path.dirname(megatron.bridge.__file__), "recipes")]
    sys.modules["megatron.bridge.recipes"] = package
    return importlib.import_module(RECIPE_MODULE)


LORA_NEEDS_A_BASE = ("LoRA adapts a base model: give --pretrained DIR (a Megatron checkpoint, or a Hugging Face model "
                     "directory; `random-base DIR` writes a random one for measurements)")


def build_config(pretrained: str | None, shards=(), *, recipe: str = "peft-8b",
                 overrides: BridgeOverrides = BridgeOverrides(), out: str = "bridge_recipe_out",
                 world_size: int | None = None, **data_options):
    """(the recipe's ConfigContainer fed by vlmfeed, its ``VlmfeedFeed``). ``pretrained``: the base
    weights (a Megatron checkpoint or a Hugging Face model directory; LoRA needs one);
    ``data_options`` go to ``datasvc.for_training`` (``max_pixels``, ``min_actors``, ``decode`` ...)."""
    from trainer.megatron.provider import feed_from_vlmfeed, without_missing_kernels

    function, adapts_a_base, one_gpu = RECIPES[recipe]
    if adapts_a_base and not pretrained:
        raise SystemExit(LORA_NEEDS_A_BASE)
    cfg = getattr(qwen3_vl_recipes(), function)()
    cfg.checkpoint.pretrained_checkpoint = pretrained
    cfg.checkpoint.save = cfg.checkpoint.load = os.path.join(out, "checkpoints")
    cfg.logger.tensorboard_dir = os.path.join(out, "tb_logs")
    # The recipe's own knobs first (fit to one GPU, then the user's): vlmfeed reads the geometry after them.
    apply_overrides(cfg, BridgeOverrides(one_gpu))
    apply_overrides(cfg, overrides)
    without_missing_kernels(cfg.model)
    feed = feed_from_vlmfeed(cfg, shards, world_size=world_size, **data_options)
    return cfg, feed


def train(args: argparse.Namespace) -> dict:
    """Trains on this rank; the last rank returns the run's summary (tokens/s, data wait, peak memory)."""
    if RECIPES[args.recipe][1] and not args.pretrained:
        raise SystemExit(LORA_NEEDS_A_BASE)  # before anything is imported or built
    import torch

    from datasvc import PoolConfig
    from trainer.megatron.loop import init_loopback_distributed
    from trainer.megatron.provider import pretrain
    from trainer.summary import summarize

    cfg, feed = build_config(args.pretrained, args.shards or (), recipe=args.recipe,
                             overrides=BridgeOverrides.from_args(args), out=args.out, max_pixels=args.max_pixels,
                             pool=PoolConfig(min_actors=args.data_actors[0], max_actors=args.data_actors[1]))
    if "RANK" not in os.environ:  # run with python, not torchrun: one rank on a loopback rendezvous
        from trainer.rendezvous import loopback_env

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_loopback_port()), **loopback_env())
        init_loopback_distributed(cfg)
    t0 = time.time()
    pretrain(cfg, feed.forward_step(), callbacks=feed.callbacks())
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) != world - 1:
        return {}
    summary = summarize(feed.records, feed.provider.owner.data_stats, "megatron", world, time.time() - t0)
    keep = ("steps", "first_step", "last_step", "steady_steps", "step_time_s", "tokens_per_s", "data_wait_share",
            "real_token_fraction", "tflops_per_gpu", "peak_mem_gib", "loss_first", "loss_last")
    summary = {k: summary[k] for k in keep} | {"gpu": torch.cuda.get_device_name()}
    print(json.dumps(summary), flush=True)
    return summary


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMMANDS = {"hf-cache": "write the recipes' config.json files into the Hugging Face cache",
            "random-base": "write a random-init Hugging Face checkpoint of the cached config (a LoRA base)",
            "train": "train the recipe on vlmfeed's stream"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """One parser per command, each read with parse_intermixed_args (argparse's subparsers cannot be),
    so KEY=VALUE overrides may stand before, between or after train's options."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        top = argparse.ArgumentParser(prog="bridge_recipe.py", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        top.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
        top.parse_args(argv[:1])
    cmd, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"bridge_recipe.py {cmd}", description=COMMANDS[cmd])
    if cmd == "hf-cache":
        p.add_argument("--hf-home", default=os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")))
    elif cmd == "random-base":
        p.add_argument("dir")
    else:
        _add_train_args(p)
    return argparse.Namespace(cmd=cmd, **vars(p.parse_intermixed_args(rest)))


def _add_train_args(run: argparse.ArgumentParser) -> None:
    from datasvc.training import add_data_flags

    add_override_args(run)
    run.add_argument("--recipe", choices=list(RECIPES), default="peft-8b",
                     help="peft-8b: LoRA on Qwen3-VL-8B; sft-30b-a3b: full SFT of a 4-layer Qwen3-VL-30B-A3B")
    run.add_argument("--pretrained", default=None, help="base weights: a Megatron checkpoint or a Hugging Face "
                     "model directory (LoRA needs one)")
    run.add_argument("--shards", nargs="+", default=None, help="WebDataset shards (default: bundled photos)")
    add_data_flags(run, "--max-pixels")
    run.add_argument("--data-actors", type=int, nargs=2, default=(2, 8), metavar=("MIN", "MAX"),
                     help="preprocessing actors per DP rank (autoscaled between)")
    run.add_argument("--out", default="bridge_recipe_out", help="checkpoints and TensorBoard logs")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cmd == "hf-cache":
        print(write_hf_cache(args.hf_home))
        print(write_hf_cache(args.hf_home, qwen3_vl_30b_a3b_config(), repo=MOE_HF_REPO))
    elif args.cmd == "random-base":
        print(write_random_base(args.dir))
    else:
        train(args)


if __name__ == "__main__":
    main()

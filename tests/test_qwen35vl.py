"""Qwen3.5-VL against transformers' own: the processor's pixels, grids and token ids on real photos,
and the facts of pipelines/qwen35vl (token ids, vocabulary, architecture) against transformers' config
classes. Offline: the tokenizer is the bundled Qwen3.5 vocabulary."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from datasvc.media.decode import CpuDecoder
from datasvc.media.vision import ImageRejected, to_pixel_values
from datasvc.read.shards import RawSample
from datasvc.registry import get_pipeline, pipeline_part
from datasvc.samples import real_photos
from datasvc.stream.process import preprocess_images
# Qwen3.5-VL keeps Qwen3-VL's ChatML and vision span, so the same template renders these samples.
from test_formats import QWEN3_VL_TEMPLATE as TEMPLATE

MAX_MAD = 0.02


@pytest.fixture(scope="module")
def qwen35vl():
    return get_pipeline("qwen35vl")


def tokenizer_file(pipeline: str) -> str:
    import os

    from pipelines.qwen3vl.data import bundled_qwen3_tokenizer_dir
    from pipelines.qwen35vl.tokenizer import bundled_tokenizer_file

    return {"qwen3vl": os.path.join(bundled_qwen3_tokenizer_dir(), "tokenizer.json"),
            "qwen35vl": bundled_tokenizer_file()}[pipeline]


def hf_processor(pipeline: str):
    """transformers' processor (AutoProcessor's classes for ``qwen3_5_moe``, the same as Qwen3-VL's)
    at the pipeline's numbers and over its vocabulary, built offline."""
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.models.qwen3_vl import Qwen3VLProcessor, Qwen3VLVideoProcessor

    assert PROCESSOR_MAPPING_NAMES["qwen3_5_moe"] == "Qwen3VLProcessor"
    assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_5_moe"]["torchvision"] == "Qwen2VLImageProcessor"
    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file(pipeline), pad_token="<|endoftext|>")
    tok.image_token, tok.video_token = "<|image_pad|>", "<|video_pad|>"
    tok.vision_bos_token, tok.vision_eos_token = "<|vision_start|>", "<|vision_end|>"
    v = get_pipeline(pipeline).vision
    image = Qwen2VLImageProcessor(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                  merge_size=v.merge_size, image_mean=list(v.image_mean), image_std=list(v.image_std),
                                  min_pixels=v.min_pixels, max_pixels=v.max_pixels)
    return Qwen3VLProcessor(image_processor=image, tokenizer=tok,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=TEMPLATE)


def jpeg(img: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(img).convert("RGB").save(b, "JPEG", quality=92)
    return b.getvalue()


def test_vision_numbers_are_the_vision_configs():
    """Patch, temporal patch and merge sizes of Qwen3.5's vision tower; the rest of the processor's
    numbers (pixel limits, mean and std) are Qwen3-VL's, from the checkpoints' processor configs."""
    from transformers import Qwen3_5MoeVisionConfig, Qwen3_5VisionConfig

    vision = get_pipeline("qwen35vl").vision
    for hf in (Qwen3_5MoeVisionConfig(), Qwen3_5VisionConfig()):
        assert (hf.patch_size, hf.temporal_patch_size, hf.spatial_merge_size) == (
            vision.patch_size, vision.temporal_patch_size, vision.merge_size)
    assert get_pipeline("qwen3vl").vision == vision


def test_token_ids_and_vocabulary_are_transformers():
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from pipelines.qwen35vl import TOKENS, VIDEO_PAD, VOCAB_SIZE

    for cfg in (Qwen3_5MoeConfig(), Qwen3_5Config()):
        assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
            TOKENS.image_pad, VIDEO_PAD, TOKENS.vision_start, TOKENS.vision_end)
        assert cfg.text_config.vocab_size == VOCAB_SIZE
    tok = get_pipeline("qwen35vl").tokenizer
    named = {"<|im_start|>": TOKENS.im_start, "<|im_end|>": TOKENS.im_end, "<|endoftext|>": TOKENS.pad,
             "<|vision_start|>": TOKENS.vision_start, "<|vision_end|>": TOKENS.vision_end,
             "<|image_pad|>": TOKENS.image_pad, "<|video_pad|>": VIDEO_PAD}
    assert {s: tok.token_to_id(s) for s in named} == named
    assert tok.get_vocab_size() <= VOCAB_SIZE


def test_the_moe_preset_is_transformers_35b_a3b():
    from transformers import Qwen3_5MoeTextConfig

    hf = Qwen3_5MoeTextConfig()
    a = pipeline_part("qwen35vl", "arch").arch("qwen35vl-35b-a3b")
    assert (a.hidden_size, a.num_layers, a.num_attention_heads, a.num_kv_heads, a.head_dim) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (a.num_experts, a.moe_topk, a.moe_ffn_hidden_size, a.shared_expert_ffn_hidden_size) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.shared_expert_intermediate_size)
    assert (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim)
    assert a.layer_types() == hf.layer_types
    assert pipeline_part("qwen35vl", "megatron").hf_config(a).text_config.layer_types == hf.layer_types


def _ours(qwen35vl, photos: list[bytes], raw: RawSample):
    results = preprocess_images(photos, qwen35vl.vision, CpuDecoder(num_threads=1))
    assert not any(isinstance(r, ImageRejected) for r in results)
    grids = [g for _, g in results]
    pv = np.concatenate([np.asarray(to_pixel_values(rows, qwen35vl.vision, [g])) for rows, g in results])
    ids, _ = qwen35vl.encode(raw, grids)
    return ids, pv, np.asarray(grids)


@pytest.mark.parametrize("pipeline", ["qwen3vl", "qwen35vl"])
def test_photos_pixels_grids_and_token_ids_match_the_hf_processor(pipeline):
    """Two photos in one conversation, over the photo set: identical token ids and grids, pixel values
    within JPEG-decoder noise of transformers' processor, each family over its own vocabulary."""
    ours, hf = get_pipeline(pipeline), hf_processor(pipeline)
    checked = 0
    photos = [(name, img) for name, img, _ in real_photos() if img.ndim == 3 and img.shape[2] == 3]
    for (name, img), (name2, img2) in zip(photos, photos[1:] + photos[:1]):
        data = [jpeg(img), jpeg(img2)]
        convo = {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                         {"type": "text", "text": " with "}, {"type": "image"}]},
            {"role": "assistant", "content": f"{name} and {name2}."}]}
        ids, pv, grids = _ours(ours, data, RawSample("s", "k", [], None, convo))
        text = hf.apply_chat_template(convo["messages"], tokenize=False)
        ref = hf(text=[text], images=[Image.open(io.BytesIO(d)) for d in data], return_tensors="np")
        assert ids.tolist() == ref["input_ids"][0].tolist(), name
        assert grids.tolist() == ref["image_grid_thw"].tolist(), name
        assert pv.shape == ref["pixel_values"].shape, name
        assert float(np.abs(pv - ref["pixel_values"]).mean()) < MAX_MAD, name
        checked += 1
    assert checked >= 10


def test_the_cpu_model_trains_on_a_real_sample(qwen35vl):
    """The development model takes a packed sample's ids, pixels and grid and learns from it."""
    cpu = pipeline_part("qwen35vl", "cpu_model")
    from pipelines.qwen35vl import TOKENS

    name, img, caption = next(p for p in real_photos() if p[1].ndim == 3 and p[1].shape[2] == 3)
    ids, pv, grids = _ours(qwen35vl, [jpeg(img)], RawSample("s", "k", [], caption, None))
    model = cpu.build_model(cpu.CpuModelConfig(), seed=0)
    ids = torch.from_numpy(ids).long().unsqueeze(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        out = model(input_ids=ids, pixel_values=torch.from_numpy(pv), image_grid_thw=torch.from_numpy(grids),
                    mm_token_type_ids=(ids == TOKENS.image_pad).long(), labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("preset, provider, hidden, layers, experts", [
    ("qwen35vl-35b-a3b", "Qwen35VLMoEModelProvider", 2048, 40, 256),
    ("qwen35vl-27b", "Qwen35VLModelProvider", 5120, 64, None)])
def test_presets_map_through_megatron_bridges_autobridge(preset, provider, hidden, layers, experts):
    """The Megatron binding: Bridge's own Qwen3.5-VL provider, built on CPU from the preset's HF config,
    with this family's vocabulary and image token."""
    from test_megatron_config import _OK, _WHY

    if not _OK:
        pytest.skip(_WHY)
    from trainer.config import ModelConfig, TrainerConfig
    from trainer.megatron import container

    m = container.build_provider(TrainerConfig(model=ModelConfig(pipeline="qwen35vl", preset=preset)))
    assert type(m).__name__ == provider
    assert (m.hidden_size, m.num_layers, m.num_moe_experts) == (hidden, layers, experts)
    assert m.vocab_size == 248320 and m.image_token_id == pipeline_part("qwen35vl", "data").TOKENS.image_pad


@pytest.mark.parametrize("preset", ["qwen35vl-35b-a3b", "qwen35vl-27b", "qwen35vl-35b-a3b-4layers-16experts"])
def test_the_planner_counts_the_parameters_transformers_builds(preset):
    """The memory planner's parameters of each layer kind (gated attention, Gated DeltaNet, routed and
    shared experts, dense MLP) add up to transformers' own model of the preset, built on the meta device,
    but for the vision tower's position table and biases (3-4M parameters, under 0.1 GiB of states)."""
    import transformers

    from trainer.plan.memory import total_params

    a = pipeline_part("qwen35vl", "arch").arch(preset)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(pipeline_part("qwen35vl", "megatron").hf_config(a))
    assert total_params(a) == pytest.approx(sum(p.numel() for p in model.parameters()), abs=4e6)


def test_the_planner_keeps_deltanet_activations_apart_from_attention():
    """A layer's kept bytes are the mean over its kinds: 3 DeltaNet layers in 4 keep other tensors
    than softmax attention, a dense model keeps its MLP and no router, and full recompute keeps only
    each layer's input."""
    arch = pipeline_part("qwen35vl", "arch").arch
    moe, dense = arch("qwen35vl-35b-a3b"), arch("qwen35vl-27b")
    all_attention = arch("qwen35vl-35b-a3b", full_attention_interval=1).decoder_kept_bytes_per_token("none", [])
    hybrid = moe.decoder_kept_bytes_per_token("none", [])
    assert hybrid["attention"] != all_attention["attention"] and hybrid["moe"] == all_attention["moe"]
    assert "router" not in dense.decoder_kept_bytes_per_token("none", []) and dense.decoder_layer_params()[1] == 0
    assert moe.decoder_kept_bytes_per_token("full", []) == {"input": 2 * moe.hidden_size}
    selective = dense.decoder_kept_bytes_per_token("selective", ["mlp", "layernorm"])
    assert selective["mlp"] == selective["mlp_act"] == selective["layernorm"] == 0.0


def test_a_gpu_job_without_the_deltanet_kernels_is_refused_in_one_line(monkeypatch):
    import importlib.util

    from trainer.config import ModelConfig, TrainerConfig
    from trainer.job import missing_gpu_packages

    installed = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else installed(name, *a))
    message = missing_gpu_packages(TrainerConfig(model=ModelConfig(pipeline="qwen35vl", preset="qwen35vl-35b-a3b")))
    assert "flash-linear-attention" in message and "\n" not in message
    assert missing_gpu_packages(TrainerConfig()) is None  # Qwen3-VL needs nothing beyond Megatron-Bridge

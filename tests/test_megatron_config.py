"""Megatron-Bridge backend at the config level, on CPU: option parsing and validation, the
ConfigContainer for both strategies (checked by Megatron-Bridge's own runtime validation), the
external data provider, THD packing and per-sample MRoPE restart. Tests that build the model need
CUDA and are marked ``gpu`` too."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from datasvc.batch import TrainBatch
from trainer.config import (
    ConfigError,
    CudaGraphConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RecomputeConfig,
    TrainConfig,
    TrainerConfig,
    add_cli_args,
    from_args,
)

pytestmark = pytest.mark.megatron


def _megatron_importable() -> tuple[bool, str]:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        return False, "megatron.bridge is not installed (.ci/bootstrap installs it only where the prebuilt " \
                      "Transformer Engine wheel is available)"
    try:
        import megatron.bridge.training.config  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # an import failure is a reason to skip, stated, never faked
        return False, f"megatron.bridge does not import here: {type(e).__name__}: {e}"
    return True, ""


_OK, _WHY = _megatron_importable()
needs_bridge = pytest.mark.skipif(not _OK, reason=_WHY)
# What MRoPE reads from a Qwen3-VL model's Bridge provider: its vision token ids and merge size.
QWEN3VL_IDS = SimpleNamespace(spatial_merge_size=2, image_token_id=151655, video_token_id=151656,
                              vision_start_token_id=151652)


def proxy(**sections) -> TrainerConfig:
    """The 30B-A3B proxy of the GPU proof (4 decoder layers), with section overrides."""
    sections.setdefault("model", ModelConfig(num_layers=4))
    sections.setdefault("train", TrainConfig(mbs=2, gbs=4, seq_len=4096, train_iters=10))
    return TrainerConfig(**sections)


# ------------------------------------------------------------------------------------------------
# Options and validation (plain Python)
# ------------------------------------------------------------------------------------------------
def test_cli_round_trip():
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        "--strategy 3d --mbs 2 --gbs 16 --seq-len 8192 --num-layers 8 --tp 2 --ep 4 --recompute selective "
        "--recompute-modules core_attn moe_act --cuda-graph-scope moe_router moe_preprocess "
        "--moe-dispatcher flex --flex-backend hybridep --freeze-vision-model --no-bf16 "
        "--vision-chunk-patches 32768 --expandable-segments".split())
    cfg = from_args(args)
    assert cfg.parallel.strategy == "3d" and cfg.parallel.tp == 2 and cfg.parallel.ep == 4
    assert cfg.train.mbs == 2 and cfg.train.gbs == 16 and cfg.train.seq_len == 8192 and not cfg.train.bf16
    assert cfg.model.num_layers == 8 and cfg.model.freeze_vision_model and not cfg.model.freeze_language_model
    assert cfg.recompute.granularity == "selective" and cfg.recompute.modules == ["core_attn", "moe_act"]
    assert cfg.cuda_graph.scope == ["moe_router", "moe_preprocess"]
    assert cfg.moe.dispatcher == "flex" and cfg.moe.flex_backend == "hybridep"
    assert cfg.model.arch().num_layers == 8 and cfg.model.arch().hidden_size == 2048
    assert cfg.model.vision_chunk_patches == 32768 and cfg.train.expandable_segments
    cfg.validate(8)


def test_defaults_are_valid():
    TrainerConfig().validate(1)
    proxy().validate(1)
    proxy(parallel=ParallelConfig(strategy="3d")).validate(1)


@pytest.mark.parametrize("world, cfg, needle", [
    (8, proxy(parallel=ParallelConfig(strategy="3d", tp=3)), "TP*PP*CP"),
    (8, proxy(model=ModelConfig(num_layers=4, num_experts=6), parallel=ParallelConfig(ep=4)),
     "EP=4 must divide the number of experts (6)"),
    (8, proxy(parallel=ParallelConfig(strategy="fsdp", pp=2), model=ModelConfig(num_layers=8)),
     "run without pipeline parallelism"),
    (2, proxy(parallel=ParallelConfig(strategy="3d", pp=2)), "deepstack"),  # 2 layers on the first stage
    (8, proxy(parallel=ParallelConfig(strategy="3d", tp=8)), "KV heads"),
    (1, proxy(train=TrainConfig(mbs=2, gbs=3)), "multiple of MBS*DP"),
    (1, proxy(cuda_graph=CudaGraphConfig(scope=["attn"])), "THD PackedSeqParams"),
    (1, proxy(cuda_graph=CudaGraphConfig(scope=["moe_router"]), recompute=RecomputeConfig(granularity="full")),
     "--recompute full is incompatible"),
    (1, proxy(cuda_graph=CudaGraphConfig(scope=["moe_preprocess"])), "needs 'moe_router'"),
    (1, proxy(cuda_graph=CudaGraphConfig(scope=["moe_router", "moe_preprocess"])), "Megatron-FSDP's parameter hooks"),
    (1, proxy(cuda_graph=CudaGraphConfig(scope=["moe"])), "drop-and-pad"),
    (1, proxy(cuda_graph=CudaGraphConfig(scope=["moe_router"]),
              recompute=RecomputeConfig(granularity="selective", modules=["moe"])), "recompute module 'moe'"),
    (2, proxy(moe=MoEConfig(dispatcher="flex"), parallel=ParallelConfig(ep=2)), "--flex-backend"),
    (1, proxy(moe=MoEConfig(dispatcher="flex", flex_backend="deepep")), "TP*EP > 1"),
    (1, proxy(recompute=RecomputeConfig(granularity="selective", modules=["attention"])), "not understood"),
    (4, proxy(parallel=ParallelConfig(cp=4), train=TrainConfig(mbs=1, gbs=1, seq_len=4100)), "2*CP"),
    (1, proxy(model=ModelConfig(num_layers=4, hf_path="Qwen/Qwen3-VL-30B-A3B-Instruct")), "--hf-path"),
    (1, proxy(model=ModelConfig(num_layers=4, vision_depth=8)), "deepstack taps"),
    (1, proxy(model=ModelConfig(num_layers=4, vision_chunk_patches=-1)), "--vision-chunk-patches"),
])
def test_validation_says_what_to_change(world, cfg, needle):
    with pytest.raises(ConfigError) as err:
        cfg.validate(world)
    assert needle in str(err.value)


def test_validation_lists_every_problem():
    cfg = proxy(parallel=ParallelConfig(strategy="fsdp", tp=3, pp=2), cuda_graph=CudaGraphConfig(scope=["attn"]))
    with pytest.raises(ConfigError) as err:
        cfg.validate(8)
    msg = str(err.value)
    assert "TP*PP*CP" in msg and "without pipeline parallelism" in msg and "THD PackedSeqParams" in msg


def test_padded_mode_allows_attention_graphs():
    proxy(cuda_graph=CudaGraphConfig(scope=["attn", "moe_router", "moe_preprocess"]),
          parallel=ParallelConfig(strategy="3d"), train=TrainConfig(mbs=1, gbs=1, padded=True)).validate(1)


# ------------------------------------------------------------------------------------------------
# ConfigContainer (Megatron-Bridge)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mb():
    if not _OK:
        pytest.skip(_WHY)
    from trainer.megatron import container, loop, metrics, provider, step, thd
    return SimpleNamespace(container=container, loop=loop, metrics=metrics, provider=provider, step=step, thd=thd)


def _finalized(mb, cfg: TrainerConfig, world: int, monkeypatch):
    """Build and run Megatron-Bridge's own runtime config update + validation (no GPU needed)."""
    from megatron.bridge.training.config import runtime_config_update
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg.validate(world)
    container = mb.container.build_config_container(cfg, world)
    runtime_config_update(container)
    return container


@needs_bridge
def test_fsdp_container(mb, monkeypatch):
    c = _finalized(mb, proxy(parallel=ParallelConfig(strategy="fsdp")), 1, monkeypatch)
    assert type(c.model).__name__ == "Qwen3VLMoEModelProvider"
    assert c.ddp.use_megatron_fsdp and c.dist.use_megatron_fsdp
    assert c.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    assert c.ddp.overlap_grad_reduce and c.ddp.overlap_param_gather
    assert c.ddp.use_distributed_optimizer and c.optimizer.use_distributed_optimizer
    assert c.model.bf16 and c.model.params_dtype == torch.bfloat16  # bf16_mixed applied
    assert c.model.calculate_per_token_loss and not c.ddp.average_in_collective
    assert c.train.micro_batch_size == 2 and c.train.global_batch_size == 4 and c.model.seq_length == 4096


@needs_bridge
def test_3d_container(mb, monkeypatch):
    cfg = proxy(model=ModelConfig(num_layers=8), parallel=ParallelConfig(strategy="3d", tp=2, pp=2, ep=4, etp=1),
                train=TrainConfig(mbs=1, gbs=8, seq_len=4096))
    c = _finalized(mb, cfg, 8, monkeypatch)
    m = c.model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size,
            m.expert_tensor_parallel_size) == (2, 2, 4, 1)
    assert m.sequence_parallel  # required with TP > 1 for Qwen3-VL MoE
    assert m.variable_seq_lengths  # PP stages exchange flat THD activations
    assert not c.ddp.use_megatron_fsdp and c.ddp.use_distributed_optimizer
    assert c.data_parallel_size == 2


@needs_bridge
def test_wgrad_fusion_needs_apex(mb, monkeypatch):
    # Bridge turns gradient-accumulation fusion on whenever Transformer Engine imports, but the
    # Qwen3-VL output layer (a plain ColumnParallelLinear) then refuses to build without APEX's
    # fused_weight_gradient_mlp_cuda: the model build failed that way on the H200.
    monkeypatch.setattr(mb.provider, "has_apex_wgrad_fusion", lambda: False)
    assert mb.container.build_provider(proxy()).gradient_accumulation_fusion is False
    monkeypatch.setattr(mb.provider, "has_apex_wgrad_fusion", lambda: True)
    assert mb.container.build_provider(proxy()).gradient_accumulation_fusion is True


@needs_bridge
def test_dataset_helper_compile_is_skipped(mb, monkeypatch, caplog):
    # The megatron-core wheel ships the helpers prebuilt without their Makefile, so Bridge's
    # compile_helpers() (make, then sys.exit(1) on failure) ended the training process on the H200.
    import megatron.bridge.training.initialize as bridge_init

    commands = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **k: commands.append(cmd) or
                        subprocess.CompletedProcess(cmd, returncode=2))
    monkeypatch.setattr(bridge_init, "compile_helpers", bridge_init.compile_helpers)
    with pytest.raises(SystemExit):  # what the unpatched helper does where make fails
        bridge_init.compile_helpers()
    assert commands and commands[0][0] == "make"

    commands.clear()
    mb.provider.skip_dataset_helper_compile()
    with caplog.at_level(logging.INFO, logger="vlmfeed.megatron"):
        assert bridge_init.compile_helpers() is None  # no exit
    assert commands == []  # and no make
    assert "dataset index helpers not compiled" in caplog.text


@needs_bridge
def test_knobs_reach_the_provider(mb, monkeypatch):
    cfg = proxy(
        model=ModelConfig(num_layers=4, freeze_vision_model=True),
        recompute=RecomputeConfig(granularity="selective", modules=["core_attn", "moe_act"]),
        cuda_graph=CudaGraphConfig(scope=["moe_router", "moe_preprocess"]),
        parallel=ParallelConfig(strategy="3d", ep=2),
        train=TrainConfig(mbs=1, gbs=2, seq_len=4096, bf16=True),
    )
    c = _finalized(mb, cfg, 2, monkeypatch)
    m = c.model
    assert m.recompute_granularity == "selective" and m.recompute_modules == ["core_attn", "moe_act"]
    assert m.cuda_graph_impl == "transformer_engine"
    assert [s.name for s in m.cuda_graph_modules] == ["moe_router", "moe_preprocess"]
    assert m.freeze_vision_model and not m.freeze_language_model and not m.freeze_vision_projection
    hooks = len(getattr(m, "_pre_wrap_hooks", []))
    chunked = mb.container.build_provider(proxy(model=ModelConfig(num_layers=4, vision_chunk_patches=16384)))
    assert len(chunked._pre_wrap_hooks) == hooks + 1

    # The flex dispatcher: Bridge's runtime check asks the GPU's architecture, so on CPU only the
    # provider fields are checked.
    flex = proxy(moe=MoEConfig(dispatcher="flex", flex_backend="hybridep"), parallel=ParallelConfig(ep=2),
                 train=TrainConfig(mbs=1, gbs=2))
    flex.validate(2)
    m = mb.container.build_provider(flex)
    assert m.moe_token_dispatcher_type == "flex" and m.moe_flex_dispatcher_backend == "hybridep"
    assert not m.moe_shared_expert_overlap

    full = _finalized(mb, proxy(recompute=RecomputeConfig(granularity="full", num_layers=1)), 1, monkeypatch)
    assert full.model.recompute_granularity == "full" and full.model.recompute_method == "uniform"
    none = _finalized(mb, proxy(), 1, monkeypatch)
    assert none.model.recompute_granularity is None and none.model.cuda_graph_impl == "none"
    assert none.model.moe_token_dispatcher_type == "alltoall"
    fp32 = _finalized(mb, proxy(train=TrainConfig(mbs=2, gbs=4, bf16=False)), 1, monkeypatch)
    assert not fp32.model.bf16


@needs_bridge
@pytest.mark.parametrize("preset, hidden, layers, heads, moe_ffn", [
    ("qwen3vl-30b-a3b", 2048, 48, 32, 768), ("qwen3vl-235b-a22b", 4096, 94, 64, 1536)])
def test_presets_map_through_autobridge(mb, preset, hidden, layers, heads, moe_ffn):
    m = mb.container.build_provider(TrainerConfig(model=ModelConfig(preset=preset)))
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups, m.kv_channels) == \
        (hidden, layers, heads, 4, 128)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (128, 8, moe_ffn)
    assert m.vision_config.depth == 27 and m.vision_config.out_hidden_size == hidden
    assert list(m.vision_config.deepstack_visual_indexes) == [8, 16, 24]
    assert m.position_embedding_type == "mrope" and list(m.mrope_section) == [24, 20, 20]
    assert m.rotary_base == 5_000_000 and m.vocab_size == 151936 and not m.share_embeddings_and_output_weights
    assert (m.image_token_id, m.vision_start_token_id) == (151655, 151652)


@needs_bridge
def test_external_data_provider(mb, tmp_path):
    from megatron.bridge.data.utils import get_dataset_provider

    it = mb.metrics.TimedIterator(iter([]))
    c = mb.container.build_config_container(proxy(), 1, it)
    assert c.dataset.dataloader_type == "external"
    build = get_dataset_provider(c.dataset)  # Bridge's protocol adapter for DatasetProvider
    train_ds, valid_ds, test_ds = build([10, 0, 0], c.dataset)
    assert train_ds is it and valid_ds is None and test_ds is None
    c.to_yaml(str(tmp_path / "config.yaml"))  # the runtime iterator must not break config dumps
    assert "external" in (tmp_path / "config.yaml").read_text()


# ------------------------------------------------------------------------------------------------
# Packed rows: THD params and MRoPE restart (pure tensor logic)
# ------------------------------------------------------------------------------------------------
TEXT = 1000  # ordinary token ids start here


def make_sample(n_text_before: int, grids: list[tuple[int, int, int]], n_text_after: int, seed: int):
    """tokens, labels for one sample: text, then each image span, then text."""
    g = torch.Generator().manual_seed(seed)
    ids = [int(x) for x in torch.randint(TEXT, TEXT + 5000, (n_text_before,), generator=g)]
    for t, h, w in grids:
        ids += [151652] + [151655] * (t * h * w // 4) + [151653]
    ids += [int(x) for x in torch.randint(TEXT, TEXT + 5000, (n_text_after,), generator=g)]
    tokens = torch.tensor(ids)
    labels = torch.cat([tokens[1:], torch.tensor([-100])])
    labels[(tokens == 151655) | (tokens == 151652)] = -100
    return tokens, labels


def make_batch(rows: list[list[tuple]], S: int):
    """rows: per row, a list of (tokens, labels, grids); returns the DataClient's TrainBatch."""
    B, K = len(rows), max(len(r) for r in rows)
    tokens = torch.full((B, S), 151643, dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    cu = torch.zeros((B, K + 1), dtype=torch.int32)
    grids = []
    for r, samples in enumerate(rows):
        at = 0
        for j, (tk, lb, gr) in enumerate(samples):
            tokens[r, at:at + len(tk)] = tk
            labels[r, at:at + len(tk)] = lb
            at += len(tk)
            cu[r, j + 1] = at
            grids += gr
        cu[r, len(samples) + 1:] = at
    return TrainBatch(
        tokens=tokens, labels=labels, loss_mask=(labels != -100).float(), cu_seqlens=cu,
        num_samples=torch.tensor([len(r) for r in rows], dtype=torch.int32),
        image_grid_thw=torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        pixel_values=torch.zeros(sum(t * h * w for t, h, w in grids), 1536),
    )


@pytest.fixture()
def batch():
    s1 = (*make_sample(5, [(1, 4, 6)], 7, 1), [(1, 4, 6)])  # 5 + 8 + 7 = 20 tokens
    s2 = (*make_sample(3, [(1, 2, 2), (1, 4, 4)], 4, 2), [(1, 2, 2), (1, 4, 4)])  # 3 + 3 + 6 + 4 = 16
    s3 = (*make_sample(9, [], 0, 3), [])  # text only
    s4 = (*make_sample(2, [(1, 6, 4)], 11, 4), [(1, 6, 4)])  # 2 + 8 + 11 = 21
    return make_batch([[s1, s2], [s3, s4]], S=48), [s1, s2, s3, s4]


@needs_bridge
def test_pack_thd_in_place(mb, batch):
    b, samples = batch
    p = mb.thd.pack_thd(b.tokens, b.labels, b.loss_mask, b.cu_seqlens, b.num_samples)
    # Row 0: 20 + 16 + filler 12; row 1: 9 + 21 + filler 18. Fixed T = B*S.
    assert p.tokens.shape == (1, 96)
    assert p.cu_seqlens_padded.tolist() == [0, 20, 36, 48, 57, 78, 96]
    assert p.cu_seqlens.tolist() == p.cu_seqlens_padded.tolist()  # no holes: every segment is real
    assert p.sample_spans == [(0, 20), (20, 36), (48, 57), (57, 78)]
    assert p.max_seqlen == 21
    for (a, e), (tk, lb, _) in zip(p.sample_spans, samples):
        assert torch.equal(p.tokens[0, a:e], tk)
    assert p.loss_mask[0, 36:48].sum() == 0 and p.loss_mask[0, 78:].sum() == 0
    assert (p.labels >= 0).all()  # -100 mapped to the pad id, masked
    assert torch.equal(p.loss_mask.bool(), (b.labels != -100).reshape(1, -1))
    params = p.params
    assert params.qkv_format == "thd" and params.max_seqlen_q == 21
    assert torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv)
    assert params.cu_seqlens_q.dtype == torch.int32


@needs_bridge
def test_pack_thd_context_parallel_layout(mb, batch):
    b, samples = batch
    # CP=2: every segment a multiple of 4; TP=2 with SP: T a multiple of TP*CP = 4.
    p = mb.thd.pack_thd(b.tokens, b.labels, b.loss_mask, b.cu_seqlens, b.num_samples,
                    segment_multiple=4, total_multiple=4)
    phys = p.cu_seqlens_padded.tolist()
    real = p.cu_seqlens.tolist()
    assert all((e - a) % 4 == 0 for a, e in zip(phys[:-1], phys[1:]))
    assert phys[-1] == p.tokens.shape[1] and p.tokens.shape[1] % 4 == 0
    lens = [len(s[0]) for s in samples]
    assert [e - a for a, e in zip(real[:-1], real[1:])][:4] == lens  # real lengths, TE convention
    for (a, e), (tk, lb, _) in zip(p.sample_spans, samples):
        assert torch.equal(p.tokens[0, a:e], tk)
        assert a in phys  # every sample starts a segment
    holes = torch.ones(p.tokens.shape[1], dtype=torch.bool)
    for a, e in p.sample_spans:
        holes[a:e] = False
    assert p.loss_mask[0, holes].sum() == 0


@needs_bridge
def test_mrope_restarts_per_sample(mb, batch):
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import get_rope_index

    b, samples = batch
    p = mb.thd.pack_thd(b.tokens, b.labels, b.loss_mask, b.cu_seqlens, b.num_samples)
    pos = mb.thd.mrope_position_ids(p, QWEN3VL_IDS, b.image_grid_thw)
    assert pos.shape == (3, 1, 96)
    for (a, e), (tk, _, grids) in zip(p.sample_spans, samples):
        assert pos[:, 0, a].tolist() == [0, 0, 0]  # restarts
        alone, _ = get_rope_index(2, 151655, 151656, 151652, tk[None],
                                  image_grid_thw=torch.tensor(grids).reshape(-1, 3) if grids else None)
        assert torch.equal(pos[:, 0, a:e], alone[:, 0]), "packed MRoPE differs from the sample run alone"
    # An image's pad tokens get 2-D positions: h and w vary inside the span (sample 1: grid 1x4x6 -> 2x3).
    a = p.sample_spans[0][0] + 5 + 1
    assert pos[1, 0, a:a + 6].tolist() == [6, 6, 6, 7, 7, 7] and pos[2, 0, a:a + 6].tolist() == [6, 7, 8, 6, 7, 8]

    # Same under the CP layout (padding between samples).
    q = mb.thd.pack_thd(b.tokens, b.labels, b.loss_mask, b.cu_seqlens, b.num_samples,
                    segment_multiple=4, total_multiple=4)
    qpos = mb.thd.mrope_position_ids(q, QWEN3VL_IDS, b.image_grid_thw)
    for (a, e), (pa, pe) in zip(q.sample_spans, p.sample_spans):
        assert torch.equal(qpos[:, 0, a:e], pos[:, 0, pa:pe])


class Replayable:
    """A resumable stream: batch i is the i-th item; the state is the position, as the data
    service's ``DataClient`` keeps it. Each ``__next__`` blocks ``delay_s`` first."""

    def __init__(self, items: list, delay_s: float = 0.0):
        self.items, self.delay_s, self.position = items, delay_s, 0

    def __next__(self):
        time.sleep(self.delay_s)
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return self.items[self.position - 1]

    def save_state(self):
        return {"position": self.position}

    def restore_state(self, state):
        self.position = state["position"]


@needs_bridge
def test_timed_iterator_counts_waits_and_resumes_at_the_saved_position(mb, batch):
    b, _ = batch
    single = make_batch([[(*make_sample(4, [(1, 4, 4)], 5, 9), [(1, 4, 4)])]], S=32)
    items = [b, single, b]
    it = mb.metrics.TimedIterator(Replayable(items, delay_s=0.02))
    assert next(it) is b
    state = it.save_state()
    assert next(it) is single and next(it) is b
    assert it.micro_batches == 3 and it.slot_tokens == 2 * 96 + 32
    assert it.real_tokens == 2 * (36 + 30) + 15  # the single row: 4 text + 6 image span + 5 text
    assert it.wait_s >= 3 * 0.02  # the time blocked in the source is counted
    it.reset()
    assert (it.wait_s, it.micro_batches, it.real_tokens, it.slot_tokens) == (0.0, 0, 0, 0)

    # A checkpoint restore goes to the source: the next batch is the one after the saved position,
    # also in a fresh iterator over a fresh source (a restarted job).
    it.restore_state(state)
    assert next(it) is single
    fresh = mb.metrics.TimedIterator(Replayable(items))
    fresh.restore_state(state)
    assert next(fresh) is single and next(fresh) is b
    with pytest.raises(StopIteration):
        next(fresh)


@needs_bridge
def test_stock_adapter_takes_one_sample_per_row(mb, batch):
    b, _ = batch
    with pytest.raises(ValueError, match="one sample per row"):
        mb.step.to_stock_batch(b)
    single = make_batch([[(*make_sample(4, [(1, 4, 4)], 5, 9), [(1, 4, 4)])]], S=32)
    stock = mb.step.to_stock_batch(single)
    assert "cu_seqlens" not in stock and stock["position_ids"] is None
    assert torch.equal(stock["visual_inputs"].image_grid_thw, single.image_grid_thw)
    assert (stock["labels"] >= 0).all() and stock["loss_mask"].sum() == (single.labels != -100).sum()
    stocked = mb.metrics.TimedIterator(Replayable([single]), adapt=mb.step.to_stock_batch)
    assert "visual_inputs" in next(stocked) and stocked.real_tokens == 15


@needs_bridge
def test_per_sample_losses(mb):
    losses = torch.arange(10, dtype=torch.float32)[None]
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    assert mb.thd.per_sample_losses(losses, mask, [(0, 4), (4, 10)]) == [1.5, 6.0]


# ------------------------------------------------------------------------------------------------
# GPU: the packed-vs-alone proof on a real model (a GPU box only)
# ------------------------------------------------------------------------------------------------
@needs_bridge
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="builds the Qwen3-VL model: needs a CUDA GPU")
def test_packed_row_matches_samples_alone():
    from trainer.bench.gpu_proof import packed_vs_alone

    report = packed_vs_alone(num_layers=4, num_experts=128)
    assert report["ok"], report


def test_the_video_proof_row_is_what_bridges_model_takes(mb):
    """The GPU proof's packed row with video, checked on CPU against the model's own input code:
    Bridge's reorganizer finds every image and video (per temporal group) in order, and the
    vision pads equal the patches over the merge window."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import reorganize_inputs

    from trainer.bench.gpu_proof import proof_samples, rows_to_batch

    rng = torch.Generator().manual_seed(7)
    batch = rows_to_batch([proof_samples(rng, with_video=True)], 4096, torch.device("cpu"), rng)
    packed = mb.thd.pack_thd(batch.tokens, batch.labels, batch.loss_mask, batch.cu_seqlens,
                             batch.num_samples)
    positions = mb.thd.mrope_position_ids(packed, QWEN3VL_IDS, batch.image_grid_thw, batch.video_grid_thw)
    assert positions.shape == (3, 1, packed.tokens.shape[1])
    data, grids, mask = reorganize_inputs(packed.tokens, batch.pixel_values, batch.pixel_values_videos,
                                          batch.image_grid_thw, batch.video_grid_thw)
    assert grids.tolist() == [[1, 28, 28], [1, 12, 12], [4, 16, 16], [1, 32, 20], [2, 20, 12]]
    assert data.shape[0] == int(grids.prod(-1).sum()) == int(mask.sum()) * 4


@needs_bridge
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="builds the Qwen3-VL model: needs a CUDA GPU")
def test_packed_row_with_video_matches_samples_alone():
    from trainer.bench.gpu_proof import packed_vs_alone

    report = packed_vs_alone(num_layers=4, num_experts=128, with_video=True)
    assert report["ok"] and report["video_grids"] == [[4, 16, 16], [2, 20, 12]], report


@needs_bridge
def test_timed_forward_step_keeps_the_signature_bridge_injects_state_by():
    from megatron.bridge.training.utils.train_utils import needs_global_state_injection

    from trainer.megatron.metrics import ForwardClock, TimedForwardStep
    from trainer.megatron.step import PackedForwardStep

    assert needs_global_state_injection(TimedForwardStep(PackedForwardStep(), ForwardClock()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_forward_clock_times_each_forward_once_per_drain():
    from trainer.megatron.metrics import ForwardClock

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
    clock = ForwardClock()
    x = torch.randn(4096, 1024, device="cuda")
    for _ in range(3):
        clock.start()
        model(x)
        clock.stop()
    clock.stop()  # a stop with no start adds nothing
    torch.cuda.synchronize()
    assert len(clock._spans) == 3
    assert not model._forward_hooks and not model._forward_pre_hooks  # CUDA graphs refuse hooked modules
    assert clock.drain() > 0 and clock.drain() == 0

"""The fixed-length vision path's mask keeps the model: each temporal group of patches attends only
within itself, and padding stays apart (``trainer.megatron.vision_graphs``)."""
import torch

from trainer.megatron.vision_graphs import per_frame_attention_mask


def test_each_frame_attends_within_itself_and_padding_apart():
    grid = torch.tensor([[1, 2, 2], [2, 1, 3]])  # an image of 4 patches, a video of 2 groups of 3
    mask = per_frame_attention_mask(grid, length=12)
    assert mask.shape == (1, 1, 12, 12) and mask.dtype == torch.bool
    allowed = ~mask[0, 0]
    units = [range(0, 4), range(4, 7), range(7, 10)]
    for i in range(12):
        mine = next((u for u in units if i in u), None)
        expected = {i} if mine is None else set(mine)  # a padding patch sees only itself
        assert {j for j in range(12) if allowed[i, j]} == expected
    assert allowed.any(dim=-1).all()  # no row fully masked: softmax stays finite


def test_the_mask_matches_separate_attention_per_image():
    """Attention under the mask equals attention run on each image alone."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 2, 3], [1, 1, 4], [1, 3, 1]])
    sizes = grid.prod(-1).tolist()
    q, k, v = (torch.randn(sum(sizes) + 5, 8, generator=gen) for _ in range(3))
    mask = per_frame_attention_mask(grid, length=sum(sizes) + 5)[0, 0]
    masked = torch.softmax((q @ k.T).masked_fill(mask, float("-inf")), dim=-1) @ v
    start = 0
    for n in sizes:
        s = slice(start, start + n)
        alone = torch.softmax(q[s] @ k[s].T, dim=-1) @ v[s]
        assert torch.allclose(masked[s], alone, atol=1e-6)
        start += n
    full = torch.softmax(q @ k.T, dim=-1) @ v  # the control: attending across images differs
    assert not torch.allclose(full[:sizes[0]], masked[:sizes[0]], atol=1e-3)


def test_more_patches_than_the_fixed_length_are_refused():
    import pytest

    with pytest.raises(ValueError, match="do not fit the fixed length 8"):
        per_frame_attention_mask(torch.tensor([[1, 3, 3]]), length=8)


def _static(**train):
    from trainer.config import CudaGraphConfig, ModelConfig, ParallelConfig, TrainConfig, TrainerConfig

    return TrainerConfig(model=ModelConfig(num_layers=4), parallel=ParallelConfig(strategy="3d"),
                         cuda_graph=CudaGraphConfig(static_shapes=True),
                         train=TrainConfig(**{"mbs": 1, "gbs": 4, "seq_len": 1024, **train}))


def test_static_shapes_are_refused_in_one_line_where_they_cannot_work():
    import dataclasses

    import pytest

    from trainer.config import ConfigError, ParallelConfig

    _static().validate(1)
    with pytest.raises(ConfigError, match=r"--mbs x --seq-len x 4 = 32768 patches.*use --mbs 1 --seq-len 2048"):
        _static(mbs=2, seq_len=4096).validate(1)
    fsdp = dataclasses.replace(_static(), parallel=ParallelConfig(strategy="fsdp"))
    with pytest.raises(ConfigError, match="cannot hold Megatron-FSDP's parameter hooks; use --strategy 3d"):
        fsdp.validate(1)


def test_static_shapes_set_the_vision_graphs_and_the_per_frame_mask():
    import pytest

    pytest.importorskip("megatron.bridge")
    from trainer.megatron.container import build_provider
    from trainer.megatron.vision_graphs import within_frames_hook

    provider = build_provider(_static())
    assert provider.vision_cuda_graph_impl == "transformer_engine" and provider.vision_cuda_graph_scope == []
    assert provider.max_vision_cuda_graph_seq_length == 4096 and provider.cuda_graph_impl == "none"
    assert within_frames_hook in provider._pre_wrap_hooks
    from trainer.config import TrainerConfig

    assert getattr(build_provider(TrainerConfig()), "vision_cuda_graph_impl", "none") == "none"


def test_vision_layers_are_captured_with_their_rotary_positions():
    from types import SimpleNamespace

    from trainer.megatron.vision_graphs import capture_with_positions

    layer = SimpleNamespace(config=SimpleNamespace(hidden_size=1152, num_attention_heads=16),
                            get_layer_static_inputs=lambda s, b: {"hidden_states": torch.ones(s, b, 1152),
                                                                  "attention_mask": torch.zeros(1, 1, s, s, dtype=torch.bool)})
    capture_with_positions(layer)
    inputs = layer.get_layer_static_inputs(64, 1)
    assert set(inputs) == {"hidden_states", "attention_mask", "rotary_pos_emb"}
    assert inputs["rotary_pos_emb"].shape == (64, 1, 1, 72) and inputs["rotary_pos_emb"].dtype == torch.float32

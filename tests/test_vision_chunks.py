import pytest
import torch

from trainer.vision_chunks import chunk_vision_hook, chunked, image_groups


@pytest.mark.parametrize("patches, cap, groups", [
    ([4, 4, 4], 8, [(0, 2), (2, 3)]),
    ([4, 4, 4], 12, [(0, 3)]),
    ([16, 4, 4], 8, [(0, 1), (1, 3)]),   # an image over the cap gets a group of its own
    ([4, 16, 4], 8, [(0, 1), (1, 2), (2, 3)]),
    ([4], 1, [(0, 1)]),
    ([], 8, []),
])
def test_image_groups(patches, cap, groups):
    assert image_groups(patches, cap) == groups


class ToyVision(torch.nn.Module):
    """Same contract as Qwen3-VL's vision tower: each image attends only to its own patches, 4 patches
    merge into one token, and two intermediate layers feed 'deepstack' features."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)
        self.merge = torch.nn.Linear(32, 5)
        self.calls = 0

    def forward(self, pixels, grid_thw):
        self.calls += 1
        x = self.proj(pixels)
        outs, deep1, deep2 = [], [], []
        for image in torch.split(x, grid_thw.prod(-1).tolist()):
            attn = torch.softmax(image @ image.T / 8, dim=-1) @ image
            merged = self.merge(attn.reshape(-1, 32))
            outs.append(merged)
            deep1.append(merged * 2)
            deep2.append(merged.tanh())
        return torch.cat(outs), [torch.cat(deep1), torch.cat(deep2)]


def _grids():
    return torch.tensor([[1, 2, 4], [1, 4, 4], [1, 2, 2], [1, 2, 6]])  # 8, 16, 4, 12 patches


def test_chunked_matches_one_call_and_gradients():
    torch.manual_seed(0)
    model = ToyVision()
    grid = _grids()
    pixels = torch.randn(int(grid.prod(-1).sum()), 6)

    ref_out, ref_deep = model(pixels, grid)
    (ref_out.sum() + sum(d.square().sum() for d in ref_deep)).backward()
    ref_grad = model.proj.weight.grad.clone()
    model.zero_grad()

    model.calls = 0
    out, deep = chunked(model.forward, max_patches=16)(pixels, grid)
    assert model.calls == 3  # [8], [16], [4, 12]
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(deep, ref_deep, strict=True):
        torch.testing.assert_close(a, b)
    (out.sum() + sum(d.square().sum() for d in deep)).backward()
    torch.testing.assert_close(model.proj.weight.grad, ref_grad)


def test_one_group_is_a_single_call():
    model = ToyVision()
    grid = _grids()
    chunked(model.forward, max_patches=1000)(torch.randn(40, 6), grid)
    assert model.calls == 1


def test_hook_wraps_vision_forward_below_call():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_model = ToyVision()

    class LaterStage(torch.nn.Module):
        vision_model = None

    models = [Model(), LaterStage()]
    hooks_fired = []
    models[0].vision_model.register_forward_pre_hook(lambda *_: hooks_fired.append(1))
    assert chunk_vision_hook(8)(models) is models
    grid = _grids()
    models[0].vision_model(torch.randn(40, 6), grid)
    assert models[0].vision_model.calls == 4  # 8 | 16 | 4 | 12 with a cap of 8
    assert hooks_fired == [1]  # module hooks (FSDP's gathering) still run once

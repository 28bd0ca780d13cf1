"""The transposed layout of linear layers: the same products to rounding, restored on exit, and
never laid over a module that is not a plain ``nn.Linear`` or already has its own forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rest_spec.drafter.hf.linear_layout import transposed_linears
from tests.helpers import tiny_causal_lm


class Scaled(nn.Linear):
    """A subclass (as quantized linears are): its own forward must survive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@torch.inference_mode()
def test_transposed_linears_compute_the_same_logits_and_restore_the_model() -> None:
    model = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain = model(input_ids=ids).logits
    with transposed_linears(model):
        assert all("forward" in vars(m) for m in model.modules() if type(m) is nn.Linear)
        transposed = model(input_ids=ids).logits
    assert torch.allclose(plain, transposed, atol=1e-5) and plain.shape == transposed.shape
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(RuntimeError, match="inside"), transposed_linears(model):
        raise RuntimeError("an error inside the block")
    assert not any("forward" in vars(m) for m in model.modules())
    with transposed_linears(model, enabled=False):
        assert not any("forward" in vars(m) for m in model.modules())


@torch.inference_mode()
def test_bias_subclasses_and_hooked_modules() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Scaled(16, 16), nn.Linear(16, 4, bias=False))
    hook = lambda x: torch.zeros(*x.shape[:-1], 4)  # noqa: E731 -- stands for e.g. an accelerate hook
    vars(net[2])["forward"] = hook
    x = torch.randn(3, 5, 8)
    plain = net[1](net[0](x))
    with transposed_linears(net):
        assert "forward" in vars(net[0])  # with a bias, over a 3-D input
        assert "forward" not in vars(net[1])  # the subclass keeps its own forward
        assert vars(net[2])["forward"] is hook  # the hook is untouched
        transposed = net[1](net[0](x))
    assert torch.allclose(plain, transposed, atol=1e-6) and plain.shape == transposed.shape
    assert vars(net[2])["forward"] is hook and "forward" not in vars(net[0])

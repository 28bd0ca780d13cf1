"""Running a model's linear layers as ``(W @ x.T).T`` instead of PyTorch's ``x @ W.T``, for blocks
whose measured cost says that is faster.

The two products are the same matrix; the BLAS kernel that computes them is not. On a CPU (fp32,
MKL) ``x @ W.T`` with one to a few rows of ``x`` -- exactly the shapes of decoding and of small
verification blocks -- can run at a fraction of the memory bandwidth the other layout reaches, so
a two-row block may take longer than a one-row step as ``x @ W.T`` and less as ``(W @ x.T).T``
(this project's figures: ``benchmarks/verify_cost.py``, recorded in ``benchmarks/README.md``
under "The verifier's cost"). Which layout wins depends on the BLAS, the CPU, the dtype and the
device, so it is never assumed: it is measured per block size with the rest of the cost
(``drafter.hf.measure``) and chosen per step (``drafter.core.cost.BlockShape``). The results agree with
PyTorch's to rounding (summation order), like any change of kernel; the verifier's outputs are
checked against plain decoding in the tests.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_LINEARS: weakref.WeakKeyDictionary[nn.Module, list[nn.Linear]] = weakref.WeakKeyDictionary()


def _transposed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(self.weight, rows.t()).t()
    out = out + self.bias if self.bias is not None else out.contiguous()
    return out.view(*x.shape[:-1], out.shape[-1])


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's ``nn.Linear`` modules, exactly that class (a quantized subclass keeps its own
    forward) and without an instance-level ``forward`` already (hooks such as accelerate's)."""
    if model not in _LINEARS:
        _LINEARS[model] = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)]
    return _LINEARS[model]


@contextmanager
def transposed_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block, ``model``'s linear layers compute ``(W @ x.T).T`` (when ``enabled``);
    they are restored on exit, exceptions included. Not for a model other threads run meanwhile."""
    if not enabled:
        yield
        return
    linears = _plain_linears(model)
    for linear in linears:
        vars(linear)["forward"] = types.MethodType(_transposed_forward, linear)
    try:
        yield
    finally:
        for linear in linears:
            vars(linear).pop("forward", None)

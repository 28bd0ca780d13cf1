"""What a generation with the transformers engine is opened with, shared by ``rest-generate``,
``rest-chat``, benchmarks and tests: the drafter a datastore spec names (``open_drafter``), the
tokenizer, model and drafter together (``load_parts``), the cost of decoding without drafts
(``no_draft_cost``), handing a finished output back to the drafter (``remember_output``), and a
conversation with the model (``ChatSession``).

torch and transformers are imported inside the functions that need them, so a command's ``--help``
stays instant.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rest_spec.common.errors import CliError, NoOutputStoreError
from rest_spec.common.prompts import Prompt, encode_prompt
from rest_spec.common.types import DEFAULT_CONFIG, DraftConfig, DraftTree
from rest_spec.drafter.core.sources import open_datastore

if TYPE_CHECKING:
    from transformers.generation import BaseStreamer

    from rest_spec.drafter.core.protocol import Drafter
    from rest_spec.drafter.hf.generate import GenerationResult

log = logging.getLogger(__name__)


def open_drafter(
    spec: str, *, tls_ca: str | None = None, auth_token: str | None = None, outputs_from: str | None = None
) -> Drafter:
    """The datastore ``spec`` names (``drafter.core.sources.open_datastore``): an index directory
    (several, comma-separated, answer as one; with a copy of the store of outputs of the server
    ``outputs_from``) or HOST:PORT, asked for its ``info()`` now, so an unreachable server or a
    broken index fails here, with a one-line ``CliError`` naming ``--datastore``."""
    try:
        return open_datastore(
            spec, where="--datastore", tls_ca=tls_ca, auth_token=auth_token, outputs_from=outputs_from
        )
    except ValueError as exc:
        log.debug("opening %s failed", spec, exc_info=True)
        raise CliError(str(exc)) from exc


def load_parts(
    model: str | Path | None,
    *,
    datastore: str | None,
    device: str | None = None,
    adaptive: bool = False,
    config: DraftConfig = DEFAULT_CONFIG,
    tls_ca: str | None = None,
    auth_token: str | None = None,
    outputs_from: str | None = None,
):
    """(tokenizer, model, drafter or None) for the model spec ``model`` (``drafter.hf.model.load_model``)
    and ``datastore`` (None: decoding without drafts). The drafter is opened first (a bad datastore
    fails before the slow model load) and checked against the tokenizer; ``adaptive`` wraps it in an
    ``AdaptiveDrafter`` drafting with ``config`` at the verify cost measured (once, then cached) for
    this model and device, which its close caches as the steps corrected it, and the calibrations
    the last run of this model left (``drafter.core.calibration_memory``), which its close keeps. The
    caller closes the drafter."""
    from rest_spec.common.tokenizer import check_tokenizer, load_tokenizer, tokenizer_fingerprint
    from rest_spec.drafter.hf.model import load_model

    drafter = (
        None
        if datastore is None
        else open_drafter(datastore, tls_ca=tls_ca, auth_token=auth_token, outputs_from=outputs_from)
    )
    try:
        started = time.perf_counter()
        tokenizer = load_tokenizer(model)
        if drafter is not None:
            check_tokenizer(drafter, tokenizer_fingerprint(tokenizer))
        loaded = load_model(model, device=device)
    except BaseException:
        if drafter is not None:
            drafter.close()
        raise
    log.info("loaded %s on %s in %.1f s", type(loaded).__name__, loaded.device, time.perf_counter() - started)
    if adaptive and drafter is not None:
        from rest_spec.drafter.core.adaptive import SOURCES, AdaptiveDrafter
        from rest_spec.drafter.core.calibration_memory import CalibrationMemory, calibration_path
        from rest_spec.drafter.hf.measure import load_or_measure

        memory = CalibrationMemory(
            calibration_path(
                str(getattr(loaded, "name_or_path", None) or model), tokenizer_fingerprint(tokenizer), SOURCES
            )
        )
        drafter = AdaptiveDrafter(
            drafter, cost=load_or_measure(loaded), config=config, cache_healed=True, memory=memory
        )
        drafter.warm_up()  # its kernels loaded with the model, not in the first request
    return tokenizer, loaded, drafter


def remember_output(drafter, output_ids: list[int]) -> None:
    """Add a finished generation to the drafter's store of recent outputs (None: no drafter). A store
    that keeps none says so at DEBUG; any other refusal is a warning, never the generation's end."""
    if drafter is None or not output_ids:
        return
    try:
        drafter.add_output(output_ids)
    except NoOutputStoreError as exc:  # a store started with --outputs-max-tokens 0 keeps none, by design
        log.debug("output not stored: %s", exc)
    except (RuntimeError, ConnectionError) as exc:
        # any other refusal (a token, a full disk, a dead server) is worth a line, not the generation
        log.warning("output not stored: %s", exc)


def no_draft_cost(model):
    """The cached verify-cost table's fastest one-token block for decoding without drafts (the same
    output, faster), corrected by the steps' times as ``--adaptive``'s is; None where no table is
    cached (only ``--adaptive`` measures one: its drafter holds it)."""
    from rest_spec.drafter.core.corrected_cost import CorrectedCost
    from rest_spec.drafter.hf.measure import load_cached

    table = load_cached(model)
    if table is None:
        return None
    cost = CorrectedCost(table)
    shape = cost.current.block_shape([DraftTree.empty()])  # the table's choice, not a step checking it
    log.info("no drafts: steps of %d position(s), linear layers %s (the cached verify-cost table)",
             shape.size, "transposed" if shape.transposed else "as PyTorch lays them out")  # fmt: skip
    return cost


@dataclass(frozen=True)
class Reply:
    """One assistant turn: its text, the decoding loop's result, and the length in tokens of the
    prompt (conversation so far) it continued."""

    text: str
    result: GenerationResult
    context_tokens: int


class ChatSession:
    """A conversation with the model: the message history and one ``reply`` per user turn."""

    def __init__(
        self,
        model,
        tokenizer,
        drafter: Drafter | None,
        *,
        config: DraftConfig,
        max_new_tokens: int,
        system: str | None = None,
        overlap: bool = False,
    ) -> None:
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.config, self.max_new_tokens, self.overlap = config, max_new_tokens, overlap
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def prompt_ids(self, user_text: str) -> list[int]:
        """The conversation so far plus ``user_text``, rendered with the chat template."""
        turn = {"role": "user", "content": user_text}
        return encode_prompt(self.tokenizer, Prompt(messages=(*self.messages, turn)))

    def reply(self, user_text: str, streamer: BaseStreamer | None = None) -> Reply:
        """Generate the assistant's reply to ``user_text`` (streamed to ``streamer``) and add the
        exchange to the history; if generation is interrupted, the history is left as it was."""
        from rest_spec.drafter.hf.generate import generate

        ids = self.prompt_ids(user_text)
        result = generate(
            self.model,
            ids,
            self.drafter,
            max_new_tokens=self.max_new_tokens,
            config=self.config,
            streamer=streamer,
            overlap=self.overlap,
        )
        remember_output(self.drafter, result.output_ids)
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        return Reply(text, result, len(ids))

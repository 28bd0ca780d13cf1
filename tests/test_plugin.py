"""The transformers plug-in on the real SmolLM2 and the real stdlib index: ``model.generate`` with
``custom_generate=rest_generate`` (callable) or ``REST_GENERATE_DIR`` (directory) returns what plain
``model.generate`` returns, token for token, for every option it honours."""

from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer
from transformers.generation import BaseStreamer, GenerateDecoderOnlyOutput, StoppingCriteria, StoppingCriteriaList

from benchmarks.harness.sets import humaneval_prompts
from rest_spec.common.tokenizer import tokenizer_fingerprint
from rest_spec.common.types import DraftConfig
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.server import DatastoreServer, ServerConfig
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.core.remote import RemoteDrafter
from rest_spec.drafter.hf.plugin import REST_GENERATE_DIR, RestGenerateOutput, generate_with_drafts, rest_generate

pytestmark = pytest.mark.model
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def store(stdlib_index):
    with Datastore.open(stdlib_index) as store:
        yield store


@pytest.fixture(scope="module")
def local(smollm2, stdlib_index):
    _, tokenizer = smollm2
    with LocalDrafter.open(stdlib_index, expected_fingerprint=tokenizer_fingerprint(tokenizer)) as drafter:
        yield drafter


@pytest.fixture(scope="module")
def remote(store):
    """A RemoteDrafter talking to a real gRPC server on a loopback port."""
    with DatastoreServer(store, ServerConfig(port=0, workers=2)) as server, RemoteDrafter(server.address) as drafter:
        yield drafter


@pytest.fixture(scope="module")
def prompts(smollm2):
    """Token ids [1, L] of the first two HumanEval prompts."""
    _, tokenizer = smollm2
    return [tokenizer(p, return_tensors="pt").input_ids for p in humaneval_prompts(2)]


def plain(model, ids, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    """Plain greedy ``model.generate`` sequences for ``prompts``."""
    model, _ = smollm2
    return [plain(model, ids, do_sample=False, max_new_tokens=NEW_TOKENS) for ids in prompts]


@pytest.mark.core
@pytest.mark.parametrize("where", ["local", "remote"])
@pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")  # none on the newest transformers
def test_greedy_sequences_equal_generate(smollm2, prompts, reference, request, where):
    model, _ = smollm2
    drafter = request.getfixturevalue(where)
    new_tokens = steps = 0
    for ids, expected in zip(prompts, reference):
        out = plain(
            model,
            ids,
            custom_generate=rest_generate,
            drafter=drafter,
            draft_config=DraftConfig(budget=32),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
        )
        assert isinstance(out, GenerateDecoderOnlyOutput) and isinstance(out, RestGenerateOutput)
        assert torch.equal(out.sequences, expected)
        new_tokens, steps = new_tokens + len(out.rest.output_ids), steps + out.rest.steps
        assert out.rest.drafting.steps == out.rest.steps  # how drafting overlapped the forwards
    assert steps < new_tokens  # drafts were accepted: fewer verifier forwards than tokens


def test_eos_list(smollm2, local, prompts, reference):
    """Several eos ids: generation stops after the first of them, as plain generate does."""
    model, _ = smollm2
    new = reference[0][0, prompts[0].shape[1] :].tolist()
    eos = [new[12], new[20]]  # tokens the greedy output reaches, so it stops early
    expected = plain(model, prompts[0], do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert expected.shape[1] - prompts[0].shape[1] <= 13
    out = plain(
        model,
        prompts[0],
        custom_generate=rest_generate,
        drafter=local,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
    )
    assert torch.equal(out, expected)


class StopAfterToken(StoppingCriteria):
    """Stops a row once it has generated ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token


def test_stopping_criteria(smollm2, local, prompts, reference):
    model, _ = smollm2
    token = reference[1][0, prompts[1].shape[1] + 9].item()
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    expected = plain(model, prompts[1], do_sample=False, max_new_tokens=NEW_TOKENS, stopping_criteria=criteria)
    assert expected.shape[1] - prompts[1].shape[1] <= 10
    out = plain(
        model,
        prompts[1],
        custom_generate=rest_generate,
        drafter=local,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        stopping_criteria=criteria,
    )
    assert torch.equal(out, expected)


def test_stop_strings(smollm2, local, prompts, reference):
    model, tokenizer = smollm2
    text = tokenizer.decode(reference[0][0, prompts[0].shape[1] :])
    stop = text[len(text) // 3 : len(text) // 3 + 4]  # a string the greedy output contains, mid-way
    expected = plain(
        model, prompts[0], do_sample=False, max_new_tokens=NEW_TOKENS, stop_strings=[stop], tokenizer=tokenizer
    )
    assert expected.shape[1] < reference[0].shape[1]
    out = plain(
        model,
        prompts[0],
        custom_generate=REST_GENERATE_DIR,
        trust_remote_code=True,
        drafter=local,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        stop_strings=[stop],
        tokenizer=tokenizer,
    )
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="tokenizer="):
        generate_with_drafts(model, prompts[0], drafter=local, max_new_tokens=4, stop_strings=[stop])


class RecordingStreamer(BaseStreamer):
    """Keeps every ``put`` and counts ``end`` calls, passing each on to ``then`` where given."""

    def __init__(self, then: BaseStreamer | None = None) -> None:
        self.puts: list[list[int]] = []
        self.ends = 0
        self.then = then

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())
        if self.then is not None:
            self.then.put(value)

    def end(self) -> None:
        self.ends += 1
        if self.then is not None:
            self.then.end()


def test_directory_form_streams(smollm2, local, prompts, reference, capsys):
    """``custom_generate=REST_GENERATE_DIR`` returns plain generate's sequences; its streamer gets the
    prompt, then every new token once, in order, then ``end``; a TextStreamer given the same calls
    prints the same text as with plain generate."""
    model, tokenizer = smollm2
    ids, expected = prompts[0], reference[0]
    recorder = RecordingStreamer(then=TextStreamer(tokenizer, skip_prompt=True))
    capsys.readouterr()
    out = plain(
        model,
        ids,
        custom_generate=REST_GENERATE_DIR,
        trust_remote_code=True,
        drafter=local,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        streamer=recorder,
    )
    printed = capsys.readouterr().out
    assert torch.equal(out, expected)
    assert recorder.puts[0] == ids[0].tolist() and recorder.ends == 1
    assert [t for put in recorder.puts[1:] for t in put] == expected[0, ids.shape[1] :].tolist()
    assert len(recorder.puts) - 1 < NEW_TOKENS  # several tokens per put when drafts are accepted

    plain(model, ids, do_sample=False, max_new_tokens=NEW_TOKENS, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert printed == capsys.readouterr().out != ""


def test_max_new_tokens_and_max_length(smollm2, local, prompts, reference):
    model, _ = smollm2
    ids = prompts[0]
    for limits in ({"max_new_tokens": 1}, {"max_length": ids.shape[1] + 5}):
        out = plain(model, ids, custom_generate=rest_generate, drafter=local, do_sample=False, **limits)
        assert torch.equal(out, reference[0][:, : out.shape[1]]) and out.shape[1] == ids.shape[1] + (
            limits.get("max_new_tokens") or 5
        )
    with pytest.raises(ValueError, match="max_new_tokens"):  # refused by generate itself, as without us
        plain(model, ids, custom_generate=rest_generate, drafter=local, max_new_tokens=0)


def test_sampling_config_is_applied(smollm2, local, prompts, reference):
    """Sampling with top_k=1 is greedy whatever the temperature; a repetition penalty changes greedy
    output exactly as in plain generate."""
    model, _ = smollm2
    ids = prompts[0]
    out = plain(
        model,
        ids,
        custom_generate=rest_generate,
        drafter=local,
        do_sample=True,
        top_k=1,
        temperature=0.7,
        max_new_tokens=NEW_TOKENS,
    )
    assert torch.equal(out, reference[0])
    expected = plain(model, ids, do_sample=False, repetition_penalty=1.3, max_new_tokens=NEW_TOKENS)
    assert not torch.equal(expected, reference[0])
    out = plain(
        model,
        ids,
        custom_generate=rest_generate,
        drafter=local,
        do_sample=False,
        repetition_penalty=1.3,
        max_new_tokens=NEW_TOKENS,
    )
    assert torch.equal(out, expected)


def test_seeded_sampling_is_reproducible(smollm2, local, prompts):
    model, _ = smollm2
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        outputs.append(
            plain(
                model,
                prompts[1],
                custom_generate=rest_generate,
                drafter=local,
                do_sample=True,
                temperature=0.8,
                top_p=0.9,
                max_new_tokens=16,
            )
        )
    assert torch.equal(*outputs)


def test_batch_rows_padded_like_generate(smollm2, local, prompts, reference):
    """Two left-padded prompts, one stopping early on eos: each row equals that prompt decoded alone,
    and the early row is padded with the pad id after its eos, as plain generate returns it."""
    model, tokenizer = smollm2
    rows_new = [ref[0, ids.shape[1] :].tolist() for ids, ref in zip(prompts, reference)]
    eos = next(t for t in rows_new[1][5:] if t not in rows_new[0])  # ends row 1 early, not row 0
    alone = [
        plain(model, ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos)[0, ids.shape[1] :]
        for ids in prompts
    ]
    batch = tokenizer.pad({"input_ids": [ids[0].tolist() for ids in prompts]}, padding_side="left", return_tensors="pt")
    out = model.generate(
        **batch,
        custom_generate=rest_generate,
        drafter=local,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    width = batch.input_ids.shape[1]
    assert torch.equal(out[:, :width], batch.input_ids)
    assert len(alone[1]) < len(alone[0]) and out.shape[1] == width + len(alone[0])
    for row, expected in enumerate(alone):
        new = out[row, width:]
        assert torch.equal(new[: len(expected)], expected)
        assert (new[len(expected) :] == tokenizer.pad_token_id).all()


def test_unsupported_options_are_refused_by_name(smollm2, local, prompts):
    model, _ = smollm2
    with pytest.raises(ValueError, match="(?i)beam_search"):
        plain(model, prompts[0], custom_generate=rest_generate, drafter=local, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="output_scores"):
        plain(
            model,
            prompts[0],
            custom_generate=rest_generate,
            drafter=local,
            max_new_tokens=4,
            return_dict_in_generate=True,
            output_scores=True,
        )
    with pytest.raises(TypeError, match="drafter must be a Drafter"):
        plain(model, prompts[0], custom_generate=rest_generate, drafter="indexes/python-stdlib", max_new_tokens=4)

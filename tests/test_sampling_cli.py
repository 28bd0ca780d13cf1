"""Sampling from the command line: ``--temperature``, ``--top-p``, ``--top-k`` and ``--seed``
(``drafter.cli.generation``), shared by ``rest-generate``, ``rest-chat`` and ``rest-fill-outputs``.
A value out of range, or a sampling flag given to greedy decoding, is a usage error naming the flag
(before anything is loaded); on the real SmolLM2 drafting from the real stdlib index, a sampled
``rest-generate`` reproduces its text with the same seed and draws another with another seed,
``--compare`` with a seed compares the outputs with drafts and without (without a seed it compares
speeds only), and ``rest-chat``
samples reproducibly too. The commands run in process: what is tested is the command, not a new
interpreter importing torch."""

from __future__ import annotations

import io
import json

import pytest

from rest_spec.drafter.cli import chat, fill_outputs, rest_generate

MAINS = {"rest-generate": rest_generate.main, "rest-chat": chat.main, "rest-fill-outputs": fill_outputs.main}
# what each command needs besides the flags under test to get past argument parsing
REQUIRED = {
    "rest-generate": ["--no-draft", "--prompt", "hi"],
    "rest-chat": ["--no-draft"],
    "rest-fill-outputs": ["--prompts", "p.jsonl", "--outputs-dir", "outs"],
}


@pytest.mark.parametrize("command", sorted(MAINS))
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-0.5"], "argument --temperature: must be a finite number >= 0"),
        (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
        (["--temperature", "warm"], "argument --temperature: expected a number, got 'warm'"),
        (["--temperature", "1", "--top-p", "0"], "argument --top-p: must be in (0, 1]"),
        (["--temperature", "1", "--top-p", "1.5"], "argument --top-p: must be in (0, 1]"),
        (["--temperature", "1", "--top-k", "-1"], "argument --top-k: must be >= 0"),
        (["--temperature", "1", "--seed", "-1"], "argument --seed: must be in [0, 4294967295]"),
        (["--temperature", "0", "--seed", "3"], "--seed applies to sampling: set --temperature above 0"),
        (["--temperature", "0", "--top-p", "0.9", "--seed", "3"], "--top-p and --seed apply to sampling"),
    ],
    ids=["negative-t", "nan-t", "word-t", "zero-p", "big-p", "negative-k", "negative-seed", "greedy-seed", "greedy-p"],
)
def test_bad_sampling_flags_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], command: str, flags: list[str], message: str
) -> None:
    """Every command that samples refuses the same values with the same words, before it loads
    anything (rest-fill-outputs has no --top-k: its engines sample without a top-k cut)."""
    if command == "rest-fill-outputs" and "--top-k" in flags:
        flags, message = ["--top-k", "5"], "unrecognized arguments: --top-k 5"
    try:
        status = MAINS[command]([*REQUIRED[command], *flags])
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {command}") and message in err and "Traceback" not in err, err


# --- the real model (``smollm2``, ``stdlib_index``: session fixtures in conftest.py) ---------------

NEW_TOKENS = 20
PROMPT = "Once upon a time, in a small village by the sea,"  # prose: many likely continuations


def sampled_run(capsys: pytest.CaptureFixture[str], index, *flags: str) -> tuple[dict, str]:
    """(the ``--json`` record, stderr) of ``rest-generate`` sampling ``PROMPT`` with drafts from
    ``index`` (no --adaptive: the trees, and so the draws, do not depend on timings)."""
    argv = ["--datastore", str(index), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json"]
    status = rest_generate.main([*argv, "--temperature", "1.0", *flags])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.model
def test_sampled_rest_generate_reproduces_with_a_seed_and_differs_with_another(capsys, smollm2, stdlib_index):
    first, _ = sampled_run(capsys, stdlib_index, "--seed", "11")
    again, _ = sampled_run(capsys, stdlib_index, "--seed", "11")
    other, _ = sampled_run(capsys, stdlib_index, "--seed", "12", "--top-p", "0.95", "--top-k", "40")
    assert 1 <= first["new_tokens"] <= NEW_TOKENS and first["text"].strip()
    assert again["output_ids"] == first["output_ids"] and again["text"] == first["text"]
    assert other["output_ids"] != first["output_ids"]
    # --compare decodes without drafts from a stream of its own, seeded alike: the seed's text both ways, but
    # where a draw falls within rounding of a token's edge (counted, not an error: the status is 0 either way)
    compared, err = sampled_run(capsys, stdlib_index, "--seed", "11", "--compare")
    assert compared["output_ids"] == first["output_ids"]
    plain = compared["without_drafts"]
    assert plain["same_output"] in (True, False) and plain["tokens_per_second"] > 0
    assert 1 <= plain["new_tokens"] <= NEW_TOKENS
    [summary] = [line for line in err.splitlines() if line.startswith("REST (drafts from ")]
    assert f"the same output on {int(plain['same_output'])} of 1 prompt(s)" in summary and summary.count("tok/s") == 2
    # without a seed the two ways draw different texts: speeds only
    unseeded, err = sampled_run(capsys, stdlib_index, "--compare")
    assert unseeded["without_drafts"]["same_output"] is None
    [summary] = [line for line in err.splitlines() if line.startswith("REST (drafts from ")]
    assert (
        f"{unseeded['new_tokens']} tokens in " in summary
        and f"the model alone: {unseeded['without_drafts']['new_tokens']} tokens in " in summary
    )
    assert summary.count("tok/s") == 2 and "x the speed" in summary
    assert "outputs not compared: decoding is sampled without --seed" in summary


@pytest.mark.model
def test_sampled_rest_chat_reproduces_with_a_seed(capsys, monkeypatch, smollm2, stdlib_index) -> None:
    """Two turns at a temperature, twice with one seed: the same replies; with another seed, others."""
    replies = []
    for seed in ("5", "5", "6"):
        monkeypatch.setattr("sys.stdin", io.StringIO("Tell me a story.\nAnother one.\n"))
        argv = ["--datastore", str(stdlib_index), "--max-new-tokens", "12", "--temperature", "1.2", "--seed", seed]
        assert chat.main(argv) == 0
        out, err = capsys.readouterr()
        assert err.count("[turn ") == 2, err
        replies.append(out)
    assert replies[0] == replies[1] and replies[0].strip()
    assert replies[2] != replies[0]  # another seed, other draws: it samples

"""Every benchmark takes the options they share from one parser (``benchmarks.harness.report.benchmark_parser``):
spelled alike, checked alike, before any work starts."""

from __future__ import annotations

import importlib

import pytest

BENCHMARKS = (
    "batch",
    "code_scale",
    "cost_noise",
    "cost_trace",
    "draft_quality",
    "draft_step",
    "e2e",
    "faults",
    "fleet",
    "history",
    "llama_cpp",
    "merge_rules",
    "overlap",
    "own_corpus",
    "restart",
    "sharded",
    "tradeoff",
    "vllm",
)
WITHOUT_PROMPTS = {"own_corpus"}  # it counts prompts with --count


def parse(name: str):
    """The function of benchmark ``name`` that parses its command line first thing."""
    module = importlib.import_module(f"benchmarks.{name}")
    return getattr(module, "parse_args", None) or module.main


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_refuses_a_count_below_one_naming_the_option(name, capsys):
    options = ("--max-new-tokens",) if name in WITHOUT_PROMPTS else ("--max-new-tokens", "--prompts")
    for option in options:
        for value in ("0", "-3", "many"):
            with pytest.raises(SystemExit) as exited:
                parse(name)([option, value])
            assert exited.value.code == 2
            assert f"argument {option}: must be " in capsys.readouterr().err


def test_the_shared_options_read_as_each_benchmark_declares_them():
    from benchmarks import e2e, fleet, history, vllm

    args = e2e.parse_args(["--prompts", "3", "--max-new-tokens", "16", "--sets", "sharegpt"])
    assert (args.prompts, args.max_new_tokens, args.sets) == (3, 16, ["sharegpt"])
    assert vllm.parse_args([]).sets == list(vllm.DEFAULT_SETS) and vllm.parse_args([]).max_new_tokens == 128
    assert vllm.parse_args([]).modes == list(vllm.MODES)
    assert vllm.parse_args(["--modes", "rest,suffix,rest"]).modes == ["plain", "rest", "suffix"]  # as given
    assert fleet.parse_args([]).sets == ["code", "chat"]
    replay = history.parse_args(["--sets", "chat", "--warmup", "500,0", "--replicas", "4,1", "--drafters", "rest"])
    assert (replay.sets, replay.warmup, replay.replicas, replay.drafters) == (["chat"], [0, 500], [1, 4], ["rest"])
    for bad in (["--sets", "code,poetry"], ["--drafters", "rest,oracle"], ["--warmup", "x"]):
        with pytest.raises(SystemExit):
            history.parse_args(bad)


def test_own_index_reads_stream_dir_pairs_and_is_required_by_the_methods_that_open_it(tmp_path, capsys):
    from benchmarks import fleet, history

    own = tmp_path / "own"
    args = fleet.parse_args(["--sets", "code", "--methods", "suffix,rest-own", "--own-index", f"code={own}"])
    assert args.own_index == {"code": own} and args.methods == ["suffix", "rest-own"]
    assert fleet.parse_args([]).methods == ["suffix", "rest", "rest-copy"] and fleet.parse_args([]).own_index == {}
    replay = history.parse_args(["--sets", "chat", "--drafters", "rest-own", "--own-index", f"chat={own}"])
    assert replay.own_index == {"chat": own}
    for parse, argv, says in (
        (fleet.parse_args, ["--sets", "code,chat", "--methods", "rest-own", "--own-index", f"code={own}"], "for chat"),
        (history.parse_args, ["--sets", "code", "--drafters", "rest-own"], "for code"),
        (fleet.parse_args, ["--own-index", f"poetry={own}"], "STREAM one of code,chat; not 'poetry="),
        (history.parse_args, ["--own-index", "code"], "must be STREAM=DIR"),
        (fleet.parse_args, ["--own-index", "code="], "must be STREAM=DIR"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse(argv)
        assert exited.value.code == 2 and says in capsys.readouterr().err

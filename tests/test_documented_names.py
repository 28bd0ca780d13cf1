"""Names the README documents are a promise: every dotted path it names today, and every one it named
before a move (``rest_spec._moved``), resolves; every ``python -m`` module it names can be run; every
console script the installed distribution declares points at a callable."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import warnings

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
DOTTED = re.compile(r"\brest_spec(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FROM_IMPORT = re.compile(r"^\s*from (rest_spec[\w.]*) import ([\w, ]+)", re.MULTILINE)
RUN_MODULE = re.compile(r"python -m (rest_spec[\w.]*)")

# Every dotted path an earlier README named (collected from its history), where it differs from today's
DOCUMENTED_BEFORE = (
    "rest_spec.drafter.vllm.RestProposer",
    "rest_spec.drafter.vllm_model.hf_checkpoint",
    "rest_spec.drafter.hf.REST_GENERATE_DIR",
    "rest_spec.drafter.hf.generate_with_drafts",
    "rest_spec.drafter.hf.rest_generate",
    "rest_spec.drafter.llamacpp.rest_llama",
    "rest_spec.drafter.llamacpp.RestDraftModel",
    "rest_spec.drafter.chat.main",
    "rest_spec.drafter.vllm_shim",
    "rest_spec.drafter.vllm_plugin",
    "rest_spec.drafter.vllm_sampling_fix",
    "rest_spec.datastore.tokenizer.load_tokenizer",
    "rest_spec.common.tokenizer",
    "rest_spec.proto.v1",
    "rest_spec.drafter.hf.plugin",
    "rest_spec.datastore.index.Engine",  # the README's "an `Engine` (`datastore/index.py`)", now a Retriever
)
RUN_BEFORE = ("rest_spec.drafter.vllm_model", "rest_spec.drafter.chat", "rest_spec.proto.generate")
# The public names drafter.core.cost held before its split by concern, each with the module it lives in now
MOVED_FROM_COST = {
    **dict.fromkeys(
        (
            "StepShape",
            "CONSISTENT",
            "corrected_cost",
            "OBSERVED_MIN",
            "OBSERVED_WINDOW",
            "OBSERVED_REFRESH",
            "CorrectedCost",
        ),
        "corrected_cost",
    ),
    **dict.fromkeys(("select_tree", "select_chain", "select_batch_chains", "select_batch_trees"), "selection"),
    **dict.fromkeys(
        (
            "PROVISIONAL_SLOPE",
            "CELL_WINDOW",
            "REFIT_EVERY",
            "HALF_LIFE",
            "PRIOR_WEIGHT",
            "FORGET_AFTER",
            "BatchCost",
        ),
        "batch_cost",
    ),
    **dict.fromkeys(("WORTH_WINDOW", "MAX_SKIP", "DraftingWorth"), "worth"),
}


def resolve(path: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        return value
    raise ModuleNotFoundError(path)


def documented_paths() -> list[str]:
    paths = set(DOTTED.findall(README)) | set(DOCUMENTED_BEFORE)
    for module, names in FROM_IMPORT.findall(README):
        paths.update(f"{module}.{name.strip()}" for name in names.split(",") if name.strip())
    return sorted(paths)


@pytest.mark.parametrize("path", documented_paths())
def test_every_documented_dotted_path_resolves(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert resolve(path) is not None


@pytest.mark.parametrize("module", sorted(set(RUN_MODULE.findall(README)) | set(RUN_BEFORE)))
def test_every_documented_python_m_module_can_run(module):
    import rest_spec  # noqa: F401  (installs the finder of moved names, as ``python -m rest_spec...`` does)

    spec = importlib.util.find_spec(module)  # the moved module's own spec once imported under its old name
    assert spec is not None and spec.loader.get_code(spec.name) is not None


def test_a_moved_name_is_the_same_object_and_says_where_it_went():
    from rest_spec.drafter.vllm.checkpoint import hf_checkpoint

    sys.modules.pop("rest_spec.drafter.vllm_model", None)  # as in a process that has not imported it yet
    with pytest.warns(DeprecationWarning, match="rest_spec.drafter.vllm.checkpoint"):
        from rest_spec.drafter.vllm_model import hf_checkpoint as old  # noqa: F401
    assert old is hf_checkpoint
    with pytest.warns(DeprecationWarning, match="rest_spec.drafter.vllm.proposer.RestProposer"):
        proposer = resolve("rest_spec.drafter.vllm.RestProposer")
    assert proposer is resolve("rest_spec.drafter.vllm.proposer.RestProposer")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        resolve("rest_spec.drafter.hf.NoSuchName")


def test_a_name_renamed_in_place_answers_under_its_old_name_and_says_the_new_one():
    import rest_spec.datastore.index as index

    with pytest.warns(DeprecationWarning, match=r"rest_spec\.datastore\.index\.Retriever\b"):
        from rest_spec.datastore.index import Engine
    assert Engine is index.Retriever
    with pytest.warns(DeprecationWarning, match=r"rest_spec\.datastore\.index\.RetrieverUnavailable\b"):
        assert index.EngineUnavailable is index.RetrieverUnavailable
    assert not {"Engine", "EngineUnavailable"} & set(vars(index))  # one name per thing in the module itself
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        index.NoSuchName  # noqa: B018


@pytest.mark.parametrize(("name", "home"), sorted(MOVED_FROM_COST.items()))
def test_a_name_split_out_of_the_cost_module_still_imports_from_it(name, home):
    new = getattr(importlib.import_module(f"rest_spec.drafter.core.{home}"), name)
    with pytest.warns(DeprecationWarning, match=rf"rest_spec\.drafter\.core\.{home}\.{name}\b"):
        old = getattr(importlib.import_module("rest_spec.drafter.core.cost"), name)
    assert old is new


def test_the_cost_module_keeps_the_table_and_answers_only_names_that_moved():
    import rest_spec.drafter.core.cost as cost

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a name that stayed answers without a warning
        from rest_spec.drafter.core.cost import BlockShape, CostKey, StepCost, VerifyCost, shape_problems  # noqa: F401
    assert not set(MOVED_FROM_COST) & set(vars(cost))  # one home per name: none is defined twice
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        cost.NoSuchName  # noqa: B018


@pytest.mark.cli
def test_a_fresh_process_imports_the_packages_own_submodules_first():
    """``from rest_spec.drafter.hf import internals`` inside the package's own modules asks the
    package for the attribute first: a submodule is never taken for an alias (that import cycled)."""
    code = "import rest_spec.drafter.hf.generate, rest_spec.drafter.vllm.proposer, rest_spec.drafter.hf.plugin"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.cli
def test_an_old_python_m_path_runs_the_moved_command():
    done = subprocess.run(
        [sys.executable, "-m", "rest_spec.drafter.vllm_model", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "safetensors checkpoint" in done.stdout, done.stderr


def test_every_console_script_points_at_a_callable():
    scripts = [e for e in importlib.metadata.distribution("rest-spec").entry_points if e.group == "console_scripts"]
    assert {"build_index", "rest-datastore", "rest-generate"} <= {e.name for e in scripts}
    for script in scripts:
        assert callable(script.load()), script


def test_only_rest_spec_itself_imports_the_alias_table():
    """The old names live in one table outside the modules they left (``rest_spec._moved``): no
    module of the product imports it, the drafting core least of all."""
    imports = re.compile(
        r"^\s*(?:from rest_spec\._moved import|from rest_spec import _moved|import rest_spec\._moved)", re.M
    )
    folders = ("build_index", "common", "datastore", "drafter", "proto")
    users = [str(path.relative_to(ROOT)) for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))
             if imports.search(path.read_text(encoding="utf-8"))]  # fmt: skip
    assert users == []

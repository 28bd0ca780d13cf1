"""Names the README documented before they moved or were renamed: each keeps working, as an alias of what it is now.

A moved module is the same module object under its old name (``import``, ``from ... import`` and
``python -m`` alike), found by a finder that ``rest_spec`` installs on import; a name that moved out
of a module that became a package, or of a module split, is resolved by a ``__getattr__`` the same
finder gives that module as it is loaded (``moved_name``): the modules themselves know nothing of
their old names, and nothing imports this module but ``rest_spec`` itself.
Each use of an old name warns once (``DeprecationWarning``) with the name to use instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> the module that holds it now
MOVED_MODULES = {
    # the split of drafter/ into rooms (core, hf, vllm, llamacpp, cli)
    "rest_spec.drafter.vllm_model": "rest_spec.drafter.vllm.checkpoint",
    "rest_spec.drafter.vllm_shim": "rest_spec.drafter.vllm.shim",
    "rest_spec.drafter.chat": "rest_spec.drafter.cli.chat",
    "rest_spec.drafter.prompts": "rest_spec.drafter.cli.prompts",
    "rest_spec.drafter.hf_internals": "rest_spec.drafter.hf.internals",
    **{
        f"rest_spec.drafter.{name}": f"rest_spec.drafter.core.{name}"
        for name in (
            "adaptive",
            "breaker",
            "cost",
            "kernels",
            "local",
            "merge",
            "protocol",
            "remote",
            "request_matcher",
            "scheduler",
            "uploads",
        )
    },
    **{
        f"rest_spec.drafter.{name}": f"rest_spec.drafter.hf.{name}"
        for name in (
            "generate",
            "kv_cache",
            "linear_layout",
            "measure",
            "model",
            "sampling",
            "tree_attention",
            "verify",
        )
    },
    # earlier moves
    "rest_spec.build_index.signals": "rest_spec.common.signals",
    "rest_spec.drafter.vllm_plugin": "rest_spec.drafter.vllm.shim",
    "rest_spec.drafter.vllm_sampling_fix": "rest_spec.drafter.vllm.shim",
    "rest_spec.datastore.tokenizer": "rest_spec.common.tokenizer",
}

# package that was a module, or a module split -> the module its public names live in now (several:
# each name from the first that has it)
MOVED_NAMES: dict[str, str | tuple[str, ...]] = {
    "rest_spec.drafter.vllm": "rest_spec.drafter.vllm.proposer",
    "rest_spec.drafter.hf": "rest_spec.drafter.hf.plugin",
    "rest_spec.drafter.llamacpp": "rest_spec.drafter.llamacpp.draft_model",
    # a module split: the contract stayed, the step helpers moved
    "rest_spec.drafter.core.protocol": "rest_spec.drafter.core.steps",
    # a module split by concern: the measured table stayed, the rest moved to one module each
    "rest_spec.drafter.core.cost": (
        "rest_spec.drafter.core.corrected_cost",
        "rest_spec.drafter.core.selection",
        "rest_spec.drafter.core.batch_cost",
        "rest_spec.drafter.core.worth",
    ),
}

# a module -> its names that were renamed in place, old name -> new name ("engine" meant three things:
# the retrieval one became a retriever, the build's ones backends; "engine" is a generation engine)
RENAMED_NAMES: dict[str, dict[str, str]] = {
    "rest_spec.datastore.index": {"Engine": "Retriever", "EngineUnavailable": "RetrieverUnavailable"},
}


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new}; the old name is an alias", DeprecationWarning, stacklevel=stacklevel)


class _Alias(importlib.abc.Loader):
    """Loads an old module name as the module it moved to (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        _warn(spec.name, self.target)
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__  # importlib sets __spec__ to the alias's next
        return module

    def exec_module(self, module) -> None:
        """The module ran when it was first imported under its own name: only its spec is put back."""
        module.__spec__ = self._own_spec

    def get_code(self, fullname: str):
        """The moved module's code, for ``python -m OLD_NAME`` (runpy runs it as ``__main__``)."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _AnswersMovedNames:
    """Loads a module of ``MOVED_NAMES`` with its own loader, then gives it a ``__getattr__`` that
    answers the names that moved out of it (PEP 562). The module's spec and ``__loader__`` are its
    own loader's, as if this one were not there."""

    def __init__(self, loader, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        if "__getattr__" not in vars(module):
            module.__getattr__ = _moved_names_of(self.name)

    def __getattr__(self, name: str):  # get_code, get_source, is_package...: the module's own loader's
        return getattr(self.loader, name)


def _moved_names_of(package: str):
    def __getattr__(name: str):  # a frame of its own: moved_name's warning points at the line using the name
        return moved_name(package, name)

    return __getattr__


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: an old module name as its new module, and a module of
    ``MOVED_NAMES`` or ``RENAMED_NAMES`` found by the finders after it, to be loaded by
    ``_AnswersMovedNames``; any other name is left to them."""

    def find_spec(self, fullname: str, path, target=None):
        moved = MOVED_MODULES.get(fullname)
        if moved is not None:
            return importlib.util.spec_from_loader(fullname, _Alias(moved))
        if fullname not in MOVED_NAMES and fullname not in RENAMED_NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _AnswersMovedNames):
                    spec.loader = _AnswersMovedNames(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Put ``MovedModuleFinder`` first on ``sys.meta_path`` (once), before any module of
    ``MOVED_NAMES`` is imported: ``rest_spec`` calls it before importing anything of its own."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def moved_name(package: str, name: str):
    """``name`` of ``package`` (a module that became a package, or one split) from where it lives
    now, or under its new name where it was renamed in place; for the module's ``__getattr__``."""
    if name.startswith("__"):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    renamed = RENAMED_NAMES.get(package, {}).get(name)
    if renamed is not None:
        _warn(f"{package}.{name}", f"{package}.{renamed}", stacklevel=4)
        return getattr(sys.modules[package], renamed)
    homes = MOVED_NAMES.get(package)
    if homes is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    # ``from package import submodule`` asks for the attribute before it imports the submodule:
    # a submodule's name is never an alias
    is_package = "__path__" in vars(sys.modules[package])  # not hasattr: that would ask __getattr__ again
    if is_package and importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    for home in (homes,) if isinstance(homes, str) else homes:
        value = getattr(importlib.import_module(home), name, None)
        if value is not None:
            _warn(f"{package}.{name}", f"{home}.{name}", stacklevel=4)  # the line that used the old name
            return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

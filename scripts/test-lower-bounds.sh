#!/usr/bin/env bash
# The tests that reach into transformers' internals (drafter/hf/internals.py: the cache keyword, the
# cache layers, generate's private helpers) on the lowest transformers pyproject.toml admits, after
# scripts/setup.sh. .venv-lower holds only that transformers (and what it pins differently); every other
# package, the project included, comes from .venv, which it reads after its own. Extra pytest arguments
# are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test-lower-bounds: run scripts/setup.sh first" >&2; exit 1; }
LOWER=$(sed -n 's/^ *"transformers>=\([0-9.]*\)",.*/\1/p' pyproject.toml)
[ -n "$LOWER" ] || { echo "test-lower-bounds: no transformers>=X in pyproject.toml" >&2; exit 1; }
[ -x .venv-lower/bin/python ] || .venv/bin/python -m venv .venv-lower
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lower_site=$(.venv-lower/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$main_site')" >"$lower_site/_rest_spec_main_venv.pth"
.venv-lower/bin/python -m pip install --quiet --disable-pip-version-check "transformers==$LOWER"
echo "lower bounds: $(.venv-lower/bin/python -c 'import tokenizers, transformers; print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__)')"
.venv-lower/bin/python -m pytest -q -p no:cacheprovider --full tests/test_plugin.py tests/test_generate.py \
    tests/test_verify.py tests/test_sampling.py tests/test_batch.py tests/test_measure.py "$@"

#!/usr/bin/env bash
# The tests on the lowest release of every dependency pyproject.toml admits (the `"name>=X"`
# requirements of the project, of the dev, bench and embedded extras setup.sh installs, and of the ray
# extra), after scripts/setup.sh: torch excepted, which stays the CPU build .venv has (an older one is a
# CUDA build of gigabytes). .venv-lower holds only those floors (and what they pin differently) and the
# project itself (editable, for its console scripts); every other package comes from .venv, which it
# reads after its own. Lints with ruff's floor (rules and formatting change between ruff's releases; CI
# also lints with the newest), then runs with --full the tests that reach into transformers' internals
# (drafter/hf/internals.py: the cache keyword, the cache layers, generate's private helpers) and the Ray
# builds (which .venv, without Ray, skips), and the rest of the README's test command (the default tier)
# but its five end-to-end tests, in one process (CI runs it beside the vLLM tests). Where the floors
# cannot be installed (no package index reachable), it says so and tests on transformers' floor alone.
# Extra pytest arguments are passed to both runs.
#
# Why CI runs the default run's tests here although its gate ran them already: the gate ran them on the
# newest release of every dependency (.venv), this runs them on the oldest (.venv-lower); a range is
# tested at both ends, so each end needs the tests that reach the dependencies (numpy, numba, protobuf,
# grpcio, tokenizers, transformers...), and the default run is the cheapest set that reaches them all. On
# the newest releases the default run is run once (the gate) and the tests beyond it once (CI's
# REST_TESTS=beyond-default); here the default run less its five end-to-end tests (122 s of one Zen 3
# core alone, calls into the dependencies that the rest makes too), and the tiers only where the floors
# change what they test (transformers' internals, Ray). CI runs it beside the vLLM tests, whose engines
# leave a third of the two cores idle, and which it slows (each phase of CI is CPU-bound:
# benchmarks/notes/ci.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test-lower-bounds: run scripts/setup.sh first" >&2; exit 1; }
FLOORS=$(.venv/bin/python - <<'EOF'
import re
text = open("pyproject.toml").read()
runtime = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
extras = re.findall(r"^(?:dev|bench|embedded|ray) = \[(.*)\]", text, re.M)  # what setup.sh installs, and Ray
for block in [runtime.group(1) if runtime else "", *extras]:
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+(?:\[[A-Za-z0-9_,.-]+\])?)>=([0-9][0-9.]*)[",]', block):
        if name != "torch":
            print(f"{name}=={version}")
EOF
)
case "$FLOORS" in *transformers==*) ;; *) echo "test-lower-bounds: no transformers>=X in pyproject.toml" >&2; exit 1 ;; esac
[ -x .venv-lower/bin/python ] || .venv/bin/python -m venv .venv-lower
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lower_site=$(.venv-lower/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$main_site')" >"$lower_site/_rest_spec_main_venv.pth"
PIP=(.venv-lower/bin/python -m pip install --quiet --disable-pip-version-check --no-warn-conflicts)
# shellcheck disable=SC2086  # one requirement per word
if ! "${PIP[@]}" $FLOORS; then
    echo "test-lower-bounds: WARNING: could not install every floor ($(echo $FLOORS)); testing transformers' alone" >&2
    "${PIP[@]}" "$(echo "$FLOORS" | grep '^transformers==')"
fi
PYTHONWARNINGS="ignore:Editable installation" "${PIP[@]}" --no-deps -e .
# numba caches its kernels per numba release: compile the floor's now, as setup.sh does for .venv's, so
# that no test's deadline pays for it
.venv-lower/bin/python -m rest_spec.drafter.core.kernels
# what the tests run on: each floor's package as installed (the floor, or more where the fallback ran) and torch
# shellcheck disable=SC2046  # one name per word
echo "lower bounds: $(.venv-lower/bin/python -c 'import sys, importlib.metadata as m
print(", ".join(f"{n} {m.version(n)}" for n in sys.argv[1:]))' $(echo "$FLOORS" | sed 's/\[.*//; s/==.*//') torch)"
.venv-lower/bin/ruff check --quiet . && .venv-lower/bin/ruff format --check --quiet .
FULL=(tests/test_plugin.py tests/test_generate.py tests/test_verify.py tests/test_sampling.py tests/test_batch.py
    tests/test_measure.py tests/test_ray_build.py)
.venv-lower/bin/python -m pytest -q -p no:cacheprovider --full "${FULL[@]}" "$@"
# the default run's tests of no tier (tests/conftest.py's TIERS): its few end-to-end tests marked core (SmolLM2
# through the commands, a server and a killed one) are left out, their calls into the dependencies made here by
# FULL's files (the model, generation, sampling) and the untiered tests (real gRPC servers, numba, the index)
UNTIERED="not (model or server or build or cli or packaging or bench or llama or vllm)"
.venv-lower/bin/python -m pytest -q -p no:cacheprovider -n 0 -m "$UNTIERED" "${FULL[@]/#/--ignore=}" "$@"

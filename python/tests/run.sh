#!/usr/bin/env bash
# CTest entry of the kvstage Python package (py/test_kvstage): installs ./python into the venv
# that scripts/setup.sh makes, built against the build tree under test, then runs python/tests
# with pytest. Exits 77 (CTest's skip) when the venv is missing, saying why.
#   Usage: run.sh BUILD_DIR [pytest args...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="$(cd "$1" && pwd)"
shift
venv="${KVS_VENV:-$repo/.venv}"
if ! "$venv/bin/python" -c 'import pytest, numpy, wheel' 2>/dev/null; then
    echo "SKIPPED: no Python venv with pytest, numpy and wheel at $venv (scripts/setup.sh" \
        "creates it; it needs PyPI)"
    exit 77
fi
KVSTAGE_BUILD_DIR="$build" KVSTAGE_WERROR=1 "$venv/bin/python" -m pip install --quiet \
    --no-build-isolation --no-deps --disable-pip-version-check "$repo/python"
# From the tests' folder, so that `import kvstage` finds the installed package, not ./python's.
cd "$here"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider . "$@"

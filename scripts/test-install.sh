#!/usr/bin/env bash
# The installed library as an engine integrator sees it (CTest's install/example): installs the
# build tree into a fresh prefix, builds examples/*.c from a clean directory with nothing but
# `cc` and `pkg-config --cflags --libs kvstage` (and once against libkvstage.a), and runs each;
# also checks that the shared library exports kvs_ symbols only and that every installed
# header compiles on its own.  Usage: test-install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" >/dev/null
libdir=$(dirname "$(find "$work/prefix" -name kvstage.pc | head -1)")/..
export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
for f in "$work/prefix/include/kvstage/"*.h; do
  # Every installed header stands alone.
  echo "#include <kvstage/$(basename "$f")>" | cc -std=c11 -fsyntax-only -Wall -Wextra -Werror \
    $(pkg-config --cflags kvstage) -x c - || { echo "test-install: $(basename "$f") does not compile alone" >&2; exit 1; }
done
exported=$(nm -D --defined-only "$libdir/libkvstage.so" | awk '{print $3}' | grep -v '^kvs_' || true)
if [ -n "$exported" ]; then
  echo "test-install: libkvstage.so exports symbols outside kvs_: $exported" >&2
  exit 1
fi
cd "$work"
for ex in "$src"/examples/*.c; do
  name=$(basename "$ex" .c)
  cp "$ex" .
  # shellcheck disable=SC2086 # KVS_EXAMPLE_CFLAGS: the sanitizer flags of a sanitizer build
  cc -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror ${KVS_EXAMPLE_CFLAGS:-} "$name.c" \
    $(pkg-config --cflags --libs kvstage) -Wl,-rpath,"$libdir" -o "$name"
  echo "test-install: running $name"
  ./"$name"
  # The static archive too. Debian's libzmq.pc cannot link statically (it names a missing
  # libprotokit.a), so the dependencies link as shared libraries and only libkvstage is static.
  # shellcheck disable=SC2046,SC2086
  cc -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror ${KVS_EXAMPLE_CFLAGS:-} "$name.c" \
    $(pkg-config --cflags kvstage) "$libdir/libkvstage.a" $(pkg-config --libs libzmq ucx) \
    $(sed -n 's/^Libs.private: //p' "$libdir/pkgconfig/kvstage.pc") -o "$name-static"
  echo "test-install: running $name (static libkvstage)"
  ./"$name-static"
done

#!/usr/bin/env python3
"""The layering rules, checked (CTest's layers/check, so `make test` runs it).

The layers are the kvs_layer() calls of CMakeLists.txt: each names its folder, its public
headers (include/kvstage/) and the layers (or libraries) it links. This script fails when
- a file of a layer includes a header of a layer it does not link, directly or through the
  layers below it (an upward or sideways include), or the header of an external library that
  its layer does not link (e.g. <jansson.h> outside the HTTP layer);
- libkvstage needs a symbol of the serving or simulation libraries, or of libmicrohttpd,
  jansson or libcurl (`nm -u` of libkvstage.a, `nm -D -u` and the NEEDED entries of
  libkvstage.so).

Usage: check-layers.py [--build DIR] (DIR: a configured and built build tree; without it only
the includes are checked).
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# External headers and the CMake target that provides them.
EXTERNAL = [
    (re.compile(r"^zmq\.h$"), "PkgConfig::ZMQ"),
    (re.compile(r"^(ucp|ucs|uct)/"), "PkgConfig::UCX"),
    (re.compile(r"^microhttpd\.h$"), "PkgConfig::MHD"),
    (re.compile(r"^jansson\.h$"), "PkgConfig::JANSSON"),
    (re.compile(r"^curl/"), "PkgConfig::CURL"),
    (re.compile(r"^nccl\.h$"), "${KVS_NCCL_LIB}"),
]
# Symbol prefixes of the libraries libkvstage must not need.
FORBIDDEN_SYMBOLS = re.compile(r"^(MHD_|curl_|json_|jansson_)")
FORBIDDEN_NEEDED = re.compile(r"lib(microhttpd|jansson|curl)")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def parse_layers():
    """{name: {"dir", "headers", "deps"}} from the kvs_layer() calls of CMakeLists.txt."""
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    text = re.sub(r"#[^\n]*", "", text)
    layers = {}
    for m in re.finditer(r"\bkvs_layer\(\s*(\w+)([^)]*)\)", text):
        name, args = m.group(1), m.group(2).split()
        if name == "name":  # the function's own definition
            continue
        cur, spec = None, {"dir": None, "headers": [], "deps": [], "target": "kvs_" + name}
        for a in args:
            if a in ("DIR", "PUBLIC_HEADERS", "DEPS", "TARGET", "TYPE"):
                cur = a
            elif cur == "DIR":
                spec["dir"] = a.replace("${PROJECT_SOURCE_DIR}/", "")
            elif cur == "PUBLIC_HEADERS":
                spec["headers"].append(a)
            elif cur == "DEPS":
                spec["deps"].append(a)
            elif cur == "TARGET":
                spec["target"] = a
        layers[name] = spec
    if not layers:
        sys.exit("check-layers: no kvs_layer() calls found in CMakeLists.txt")
    return layers


def closure(layers):
    """For every layer: the layers and external targets it may use (itself included)."""
    by_target = {spec["target"]: n for n, spec in layers.items()}
    # The core static library stands for every core layer (the ones under src/).
    core = [n for n, s in layers.items() if s["dir"].startswith("src/")]
    out = {}

    def visit(name, seen):
        for d in layers[name]["deps"]:
            if d in by_target:
                dep = [by_target[d]]
            elif d == "kvstage":
                dep = core
            else:
                seen.add(d)  # an external target
                continue
            for n in dep:
                if n not in seen:
                    seen.add(n)
                    visit(n, seen)

    for n in layers:
        seen = {n}
        visit(n, seen)
        # The core library's own external dependencies travel with it.
        if any(c in seen for c in core) and n not in core:
            for c in core:
                visit(c, seen)
        out[n] = seen
    return out


def check_includes(layers, allowed):
    header_layer = {h: n for n, s in layers.items() for h in s["headers"]}
    errors = []
    for name, spec in layers.items():
        base = os.path.join(ROOT, spec["dir"])
        files = []
        for dirpath, _, names in os.walk(base):
            files += [os.path.join(dirpath, f) for f in names if f.endswith((".c", ".h", ".cu"))]
        # Public headers are checked as part of their layer.
        files += [os.path.join(ROOT, "include", "kvstage", h) for h in spec["headers"]]
        for path in sorted(files):
            rel = os.path.relpath(path, ROOT)
            for kind, inc in INCLUDE.findall(open(path, errors="replace").read()):
                target = None
                if kind == "<":
                    for pattern, lib in EXTERNAL:
                        if pattern.search(inc) and lib not in allowed[name]:
                            errors.append(f"{rel}: <{inc}> needs {lib}, which layer {name} "
                                          "does not link")
                    continue
                first = inc.split("/", 1)[0]
                if first == "kvstage":
                    target = header_layer.get(inc.split("/", 1)[1])
                    if target is None:
                        errors.append(f"{rel}: \"{inc}\" is not a public header of any layer")
                        continue
                elif first in layers and "/" in inc:
                    target = first
                elif os.path.exists(os.path.join(os.path.dirname(path), inc)):
                    target = name
                else:
                    errors.append(f"{rel}: \"{inc}\" resolves to no layer")
                    continue
                if target not in allowed[name]:
                    errors.append(f"{rel}: layer {name} includes \"{inc}\" of layer {target}, "
                                  "which it does not link")
    return errors


def nm(args, path):
    res = subprocess.run(["nm"] + args + [path], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"check-layers: nm {' '.join(args)} {path} failed: {res.stderr.strip()}")
    return res.stdout.splitlines()


def symbols(path, kind):
    """Defined ("D") or undefined ("U") external symbols of an archive or object."""
    out = set()
    for line in nm(["-g"], path):
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U" and kind == "U":
            out.add(parts[1])
        elif len(parts) == 3 and parts[1] not in "Uw" and kind == "D":
            out.add(parts[2])
    return out


def check_symbols(build):
    errors = []
    core = os.path.join(build, "libkvstage.a")
    shared = os.path.join(build, "libkvstage.so")
    for p in (core, shared):
        if not os.path.exists(p):
            return [f"{p} does not exist (build first)"]
    needed = symbols(core, "U") - symbols(core, "D")
    for lib in ("libkvstage_serve.a", "libkvstage_sim.a"):
        path = os.path.join(build, lib)
        if not os.path.exists(path):
            errors.append(f"{path} does not exist (build first)")
            continue
        for s in sorted(needed & symbols(path, "D")):
            errors.append(f"libkvstage.a needs {s}, defined in {lib}")
    for s in sorted(needed):
        if FORBIDDEN_SYMBOLS.search(s):
            errors.append(f"libkvstage.a needs {s}")
    for line in nm(["-D", "--undefined-only"], shared):
        s = line.split()[-1]
        if FORBIDDEN_SYMBOLS.search(s):
            errors.append(f"libkvstage.so needs {s}")
    dyn = subprocess.run(["objdump", "-p", shared], capture_output=True, text=True).stdout
    for m in re.finditer(r"NEEDED\s+(\S+)", dyn):
        if FORBIDDEN_NEEDED.search(m.group(1)):
            errors.append(f"libkvstage.so links {m.group(1)}")
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", help="a built build tree: also check libkvstage's symbols")
    args = ap.parse_args()
    layers = parse_layers()
    allowed = closure(layers)
    errors = check_includes(layers, allowed)
    if args.build:
        errors += check_symbols(args.build)
    for e in errors:
        print("check-layers:", e, file=sys.stderr)
    if errors:
        return 1
    print(f"check-layers: {len(layers)} layers, includes point down"
          + (", libkvstage needs no serving, simulation, HTTP or JSON code" if args.build else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Builds kvstage._kvstage against libkvstage, linked statically (the archive is
position-independent), so the installed module needs only libzmq, UCX and, in CUDA builds, the
CUDA runtime at run time, wherever libkvstage came from. In order, libkvstage is:

  1. the CMake build tree named by KVSTAGE_BUILD_DIR (what the CTest entry uses);
  2. an installed libkvstage that pkg-config finds (`cmake --install build --prefix P` and
     PKG_CONFIG_PATH=P/lib/pkgconfig);
  3. the repository's own build/ (made by `make build`), built here first with the Makefile's
     CMake flags when it is missing (a fresh checkout that ran scripts/setup.sh).

The package version is the library's (kvstage.pc), so the two cannot disagree."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def pkg_config(*args):
    return subprocess.run(["pkg-config", *args], check=True, capture_output=True,
                          text=True).stdout.split()


def read_pc(path):
    """The Version and Libs.private fields of a kvstage.pc."""
    text = Path(path).read_text()
    version = re.search(r"^Version:\s*(\S+)", text, re.M).group(1)
    private = re.search(r"^Libs\.private:(.*)$", text, re.M)
    return version, shlex.split(private.group(1)) if private else []


def from_build_tree(build):
    build = Path(build).resolve()
    archive = build / "libkvstage.a"
    cache = build / "CMakeCache.txt"
    if not archive.exists() or not cache.exists():
        sys.exit(f"kvstage: {build} holds no libkvstage.a (run `make build` in the repository)")
    source = re.search(r"^kvstage_SOURCE_DIR:STATIC=(.*)$", cache.read_text(), re.M).group(1)
    version, private = read_pc(build / "kvstage.pc")
    return archive, [f"-I{source}/include"], private, version


def from_pkg_config():
    libdir = pkg_config("--variable=libdir", "kvstage")[0]
    pcdir = pkg_config("--variable=pcfiledir", "kvstage")[0]
    version, private = read_pc(Path(pcdir) / "kvstage.pc")
    return Path(libdir) / "libkvstage.a", pkg_config("--cflags", "kvstage"), private, version


def build_repo():
    build = REPO / "build"
    if not (build / "libkvstage.a").exists():
        if not (REPO / "CMakeLists.txt").exists():
            sys.exit("kvstage: no libkvstage found: set KVSTAGE_BUILD_DIR to a kvstage build "
                     "tree, or PKG_CONFIG_PATH to an installed one's lib/pkgconfig")
        print("kvstage: building libkvstage in", build, file=sys.stderr)
        subprocess.run(["cmake", "-S", str(REPO), "-B", str(build),
                        "-DCMAKE_BUILD_TYPE=RelWithDebInfo"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "kvstage", "-j",
                        str(os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
    return from_build_tree(build)


def find_libkvstage():
    if os.environ.get("KVSTAGE_BUILD_DIR"):
        return from_build_tree(os.environ["KVSTAGE_BUILD_DIR"])
    if subprocess.run(["pkg-config", "--exists", "kvstage"]).returncode == 0:
        return from_pkg_config()
    return build_repo()


archive, cflags, private, version = find_libkvstage()
warnings = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
if os.environ.get("KVSTAGE_WERROR"):
    warnings.append("-Werror")

setup(
    version=version,
    ext_modules=[
        Extension(
            "kvstage._kvstage",
            sources=["kvstage/_kvstage.c"],
            extra_compile_args=["-std=c11", "-D_POSIX_C_SOURCE=200809L", *warnings, *cflags],
            define_macros=[("KVS_PY_VERSION", f'"{version}"')],
            extra_objects=[str(archive)],
            extra_link_args=[*pkg_config("--libs", "libzmq", "ucx"), *private],
            depends=[str(archive)],
        )
    ],
)

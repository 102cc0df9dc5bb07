"""The examples as a user runs them: each in its own interpreter, checked by exit status and
summary line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(name, *args, timeout=120):
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=os.path.dirname(__file__))


@pytest.mark.parametrize("args", [(), ("--prompt", "200", "--base", "0")])
def test_two_process_handoff_over_the_net_link(args):
    r = run("handoff.py", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert "SUCCESS (OK)" in line and " 0 mismatching elements" in line, line
    assert "['SUCCESS', 'SUCCESS']" in line


def test_handoff_refuses_a_base_off_the_page_grid():
    r = run("handoff.py", "--base", "10")
    assert r.returncode == 2 and "--base must be a multiple of 16" in r.stderr

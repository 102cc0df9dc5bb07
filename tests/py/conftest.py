"""A deployment for the tests: a prefill, a decode and a colocated server of the default model
(SmolLM2-135M, one rank each) and a router in front of the first two, each a `kvstage`
process (KVS_TOOL) on a port the system picks, stopped at the end of the session."""
import os
import re
import signal
import subprocess
import time

import pytest

START_S = 120


class Proc:
    def __init__(self, args, ready):
        tool = os.environ.get("KVS_TOOL")
        if not tool:
            pytest.skip("KVS_TOOL (the kvstage binary) is not set")
        self.p = subprocess.Popen([tool] + args, stdout=subprocess.PIPE, stderr=None,
                                  stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        deadline = time.monotonic() + START_S
        line = ""
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"kvstage {' '.join(args)} exited before '{ready}'")
            if line.startswith(ready):
                break
        else:
            raise RuntimeError(f"kvstage {' '.join(args)}: no '{ready}' line in {START_S} s")
        self.line = line
        self.url = re.search(r"http://[0-9.]+:[0-9]+", line).group(0)
        m = re.search(r"bootstrap ([^)]+)\)", line)
        self.bootstrap = m.group(1) if m else None

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


class Deployment:
    def __init__(self):
        self.procs = []
        try:
            self.prefill = self._start(["serve", "--role", "prefill", "--port", "0"], "serving on")
            self.decode = self._start(["serve", "--role", "decode", "--port", "0", "--bootstrap",
                                       self.prefill.bootstrap], "serving on")
            self.colocated = self._start(["serve", "--role", "colocated", "--port", "0"],
                                         "serving on")
            self.router = self._start(["router", "--prefill", self.prefill.url, "--decode",
                                       self.decode.url, "--port", "0"], "routing on")
        except Exception:
            self.stop()
            raise

    def _start(self, args, ready):
        p = Proc(args, ready)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="session")
def deployment():
    d = Deployment()
    yield d
    d.stop()

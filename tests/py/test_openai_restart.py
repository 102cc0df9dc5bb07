"""The official openai client through a router while its servers die and come back: a router
over a prefill server (a KV pool of one 64-token request) and a decode server bound to none,
each on a port fixed for the test so that a restarted process comes back at the address the
router knows. A killed prefill or decode server makes requests fail at once with 503 (not hang),
its restart on the same port serves the same greedy answer again, and so does a restarted router;
bad requests get the client's own error types; more clients than the prefill pool holds at once
all get their answers."""
import concurrent.futures
import os
import signal
import socket
import time

import openai
import pytest

from conftest import Proc

CTX = 64  # the prefill server's --max-model-len and --kv-tokens: one request fills its pool
BACK_S = 60  # a restarted process serves again within this


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    def __init__(self):
        self.ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
        self.procs = {}
        try:
            for name in ("prefill", "decode", "router"):
                self.start(name)
        except Exception:
            self.stop()
            raise

    def args(self, name):
        port = str(self.ports[name])
        if name == "prefill":
            return ["serve", "--role", "prefill", "--port", port, "--kv-tokens", str(CTX),
                    "--max-model-len", str(CTX)], "serving on"
        if name == "decode":
            return ["serve", "--role", "decode", "--port", port], "serving on"
        return ["router", "--prefill", f"http://127.0.0.1:{self.ports['prefill']}", "--decode",
                f"http://127.0.0.1:{self.ports['decode']}", "--port", port,
                "--health-interval-ms", "200"], "routing on"

    def start(self, name):
        self.procs[name] = Proc(*self.args(name))

    def kill(self, name):
        """SIGKILL to the process and its ranks (its whole process group), as a crash would."""
        p = self.procs.pop(name).p
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def stop(self):
        for p in reversed(list(self.procs.values())):
            p.stop()

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.ports['router']}/v1",
                             api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    yield f
    f.stop()


def ask(fleet, model, content="Say hi.", **kw):
    r = fleet.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=8,
        temperature=0, **kw)
    return r.choices[0].message.content


def served_again(fleet, model, expect):
    """Asks until an answer comes (a restarted process is back once the router's health check has
    seen it), within BACK_S; the answer must be the greedy one from before."""
    deadline = time.monotonic() + BACK_S
    while True:
        try:
            got = ask(fleet, model)
            break
        except (openai.InternalServerError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert got == expect


def fails_fast_with_503(fleet, model):
    """The next requests fail with 503 and a reason naming the server side (none available, or
    the one the request reached before the router saw it die), each well before the client's
    timeout."""
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            ask(fleet, model)
        assert e.value.status_code == 503
        assert "server" in str(e.value)
        assert time.monotonic() - t0 < 10


def test_kill_and_restart_each_process(fleet):
    model = fleet.client().models.list().data[0].id
    expect = ask(fleet, model)
    assert expect

    # Bad requests: the client's own error types, and nothing held after them.
    with pytest.raises(openai.NotFoundError):
        ask(fleet, "no-such-model")
    with pytest.raises(openai.BadRequestError) as e:
        ask(fleet, model, content="word " * CTX)
    assert "context length" in str(e.value)
    assert ask(fleet, model) == expect

    for name in ("prefill", "decode"):
        fleet.kill(name)
        fails_fast_with_503(fleet, model)
        fleet.start(name)
        served_again(fleet, model, expect)

    fleet.kill("router")
    with pytest.raises(openai.APIConnectionError):
        ask(fleet, model)
    fleet.start("router")
    served_again(fleet, model, expect)


def test_more_clients_than_the_prefill_pool_holds(fleet):
    """Eight requests at once of about half the context each, where the prefill pool holds one
    request: they queue, and every one is answered in full."""
    model = fleet.client().models.list().data[0].id

    def one(i):
        r = fleet.client().completions.create(model=model, prompt=f"tok {i} " * 12, max_tokens=10,
                                              temperature=0)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(8)))
    assert got == [("length", 10)] * 8

"""kvstage.connector driven by the mini-engine of examples/mini_engine.py: both engines in this
process over the in-process link (scheduler loops interleaved), then the two-process run."""

import sys
import time
from pathlib import Path

import pytest

import kvstage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import mini_engine  # noqa: E402
from test_examples import run  # noqa: E402


def engines(progress_thread=False, timeouts=None):
    layout = mini_engine.make_layout()
    net = kvstage.InprocNet(1, 1)
    pre = mini_engine.PrefillEngine(layout, net.link("prefill", 0), timeouts=timeouts,
                                    progress_thread=progress_thread)
    dec = mini_engine.DecodeEngine(layout, net.link("decode", 0), timeouts=timeouts,
                                   progress_thread=progress_thread)
    return pre, dec


def serve(pre, dec, room, tokens=None, timeout=10):
    deadline = time.monotonic() + timeout
    while room not in dec.results or room not in pre.results:
        assert time.monotonic() < deadline, (pre.requests, dec.requests)
        pre.step()
        dec.step()
    return dec.results.pop(room), pre.results.pop(room)


@pytest.mark.parametrize("progress_thread", [False, True])
def test_requests_with_a_prefix_hit(progress_thread):
    pre, dec = engines(progress_thread)
    for room, tokens in mini_engine.requests():
        dec.add_request(room, tokens)
        pre.add_request(room, tokens)
        res, sent = serve(pre, dec, room)
        assert sent is True
        assert res["ok"] and res["mismatches"] == 0, res
        assert res["first_token"] == mini_engine.first_token(tokens)
        assert res["base"] == (96 if room == 2 else 0)
    # prefill has every block back; decode keeps the prompts' full blocks in its prefix cache
    assert len(pre.blocks.free_ids) == mini_engine.BLOCKS
    cached = {b for ids in dec.prefix.values() for b in ids}
    assert len(cached) == 150 // 16 + (126 - 96) // 16 + 70 // 16
    assert len(dec.blocks.free_ids) == mini_engine.BLOCKS - len(cached)
    assert not cached & set(dec.blocks.free_ids)


def test_abort_frees_blocks_on_both_sides():
    pre, dec = engines()
    room, tokens = mini_engine.requests()[0]
    dec.add_request(room, tokens)
    pre.add_request(room, tokens)
    pre.step()  # one chunk computed
    dec.conn.abort(room)  # the decode engine drops the request
    res, sent = serve(pre, dec, room)
    assert res == {"ok": False, "base": 0, "reason": "ERR_ABORTED"}
    assert sent is False
    assert len(pre.blocks.free_ids) == len(dec.blocks.free_ids) == mini_engine.BLOCKS


def test_prefill_that_never_comes_fails_the_request():
    pre, dec = engines(timeouts={"waiting": 0.2, "release": 0.2})
    dec.add_request(9, list(range(40)))
    deadline = time.monotonic() + 5
    while 9 not in dec.results:
        assert time.monotonic() < deadline
        dec.step()
    assert dec.results[9] == {"ok": False, "base": 0, "reason": "ERR_TIMEOUT"}
    assert len(dec.blocks.free_ids) == mini_engine.BLOCKS


def test_receivable_base_is_whole_blocks():
    pre, dec = engines()
    assert [dec.conn.receivable_base(n) for n in (0, 15, 16, 47, 48)] == [0, 0, 16, 32, 48]
    with pytest.raises(kvstage.StateError):
        dec.add_request(5, list(range(40)))
        dec.conn.release(5)  # still moving: not releasable


def test_two_process_mini_engine():
    r = run("mini_engine.py")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 and all("exact, first token matches" in x for x in lines), lines
    assert "decode held 96" in lines[1]

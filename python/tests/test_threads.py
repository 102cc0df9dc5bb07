"""The GIL and threads: blocking and progress calls release the GIL, libkvstage's progress
threads drive rooms while Python threads run, and an object can go while its thread runs."""

import gc
import threading
import time

import pytest

import kvstage
from test_inproc import PROMPT, deployment


class Busy(threading.Thread):
    """Counts in pure Python until stopped: it advances only while nobody holds the GIL."""

    def __init__(self):
        super().__init__(daemon=True)
        self.count = 0
        self.stop = False

    def run(self):
        while not self.stop:
            self.count += 1


def test_blocking_call_releases_the_gil():
    registry = kvstage.Registry("tcp://127.0.0.1:0")
    busy = Busy()
    busy.start()
    time.sleep(0.05)
    before = busy.count
    t0 = time.monotonic()
    assert registry.serve(300) == 0  # nobody asks: blocks 300 ms in libkvstage
    waited = time.monotonic() - t0
    during = busy.count - before
    busy.stop = True
    busy.join()
    assert waited >= 0.25
    # with the GIL held for the whole wait the counter could not have moved at all
    assert during > 10000, during


def start_room(layout, pre, dec, tx, rx, room=1):
    tables = [p.pool.alloc(13) for p in pre]
    for p, t in zip(pre, tables):
        p.fill(t, 0, PROMPT)
    delta = dec.pool.alloc(13)
    rx.add_room(room, 0, PROMPT, delta)
    for s, t in zip(tx, tables):
        s.add_room(room, PROMPT, t)
        s.advance(room, PROMPT)
        s.finish(room, b"\x01")
    return delta


def test_progress_threads_and_a_busy_python_thread_both_advance(layout, make_rank):
    net, pre, dec, tx, rx = deployment(layout, make_rank)
    busy = Busy()
    busy.start()
    for r in tx + [rx]:
        r.start_progress_thread()
    with pytest.raises(kvstage.StateError):
        rx.start_progress_thread()  # one thread per object
    delta = start_room(layout, pre, dec, tx, rx)
    before = busy.count
    deadline = time.monotonic() + 10
    while not all(r.poll(1).done for r in tx + [rx]) and time.monotonic() < deadline:
        time.sleep(0.001)  # this thread only polls; the progress threads do the work
    during = busy.count - before
    busy.stop = True
    busy.join()
    assert rx.poll(1).status == kvstage.RoomStatus.SUCCESS
    assert dec.mismatches(delta, 0, PROMPT) == 0
    assert during > 0
    for r in tx + [rx]:
        r.stop_progress_thread()
        r.release(1)


def test_python_threads_driving_progress_concurrently(layout, make_rank):
    """Each rank driven from its own Python thread (every call releases the GIL and takes the
    net's lock), while the main thread adds and polls."""
    net, pre, dec, tx, rx = deployment(layout, make_rank)
    stop = threading.Event()
    calls = {}

    def pump(r):
        n = 0
        while not stop.is_set():
            r.progress()
            n += 1
        calls[id(r)] = n

    threads = [threading.Thread(target=pump, args=(r,)) for r in tx + [rx]]
    for t in threads:
        t.start()
    try:
        delta = start_room(layout, pre, dec, tx, rx)
        deadline = time.monotonic() + 10
        while not all(r.poll(1).done for r in tx + [rx]) and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert rx.poll(1).status == kvstage.RoomStatus.SUCCESS
    assert dec.mismatches(delta, 0, PROMPT) == 0
    assert all(n > 0 for n in calls.values())


def test_deleting_objects_while_their_threads_run(layout, make_rank):
    net, pre, dec, tx, rx = deployment(layout, make_rank, timeouts={"waiting": 0.3,
                                                                    "release": 0.2})
    start_room(layout, pre, dec, tx, rx)
    for r in tx + [rx]:
        r.start_progress_thread()
    time.sleep(0.002)
    del tx[:]  # stops each thread, then destroys the sender (draining its writes)
    gc.collect()
    deadline = time.monotonic() + 5
    while not rx.poll(1).done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert rx.poll(1).done
    rx.close()  # with its thread still running
    assert rx.progress() == 0
    with pytest.raises(kvstage.StateError):
        rx.poll(1)

"""Shared fixtures: a small deployment and pools over numpy arrays of known KV."""

import time

import pytest

import kvstage
from kvstage import testing


@pytest.fixture
def layout():
    """TP2 prefill -> TP1 decode, 4 heads, pages of 8 and chunks of 32 tokens."""
    shape = kvstage.Shape(layers=3, kv_heads=4, head_dim=16, head_dim_v=8, elem_bytes=2)
    return kvstage.Layout(shape, prefill_tp=2, decode_tp=1, page_size=8, chunk_tokens=32)


class Rank:
    """One rank's arrays and the pool over them."""

    def __init__(self, layout, side, rank, pages, order):
        self.layout, self.side, self.rank, self.order = layout, side, rank, order
        self.kv = testing.arrays(layout, side, rank, pages, order)
        v = self.kv[1] if layout.shape.components == 2 else None
        self.pool = kvstage.Pool(layout, side, rank, k=self.kv[0], v=v, order=order)

    def fill(self, table, start, stop, base=0):
        testing.fill(self.layout, self.side, self.rank, self.kv, self.order, table, start, stop,
                     base)

    def mismatches(self, table, start, stop, base=0):
        return testing.mismatches(self.layout, self.side, self.rank, self.kv, self.order, table,
                                  start, stop, base)


@pytest.fixture
def make_rank():
    return Rank


def drive(ranks, rooms, timeout=10.0):
    """Progresses every sender/receiver until each room is done on all of them; returns the
    last RoomInfo per room of the last rank (decode's, when it comes last)."""
    deadline = time.monotonic() + timeout
    while True:
        for r in ranks:
            r.progress()
        infos = {room: [r.poll(room) for r in ranks] for room in rooms}
        if all(i.done for v in infos.values() for i in v):
            return {room: v[-1] for room, v in infos.items()}
        if time.monotonic() > deadline:
            raise AssertionError(f"rooms not done after {timeout} s: {infos}")
        time.sleep(0.0002)

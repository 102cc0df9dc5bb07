"""One process, the in-process link: rooms end to end from numpy pools of both layouts, a
decode prefix hit, aborts and timeouts as failed rooms, and lifetimes (a sender deleted with
rooms live)."""

import gc
import time

import pytest

import kvstage
from conftest import drive

PROMPT = 100  # 4 chunks of 32 tokens (the last partial), 13 pages of 8


def deployment(layout, make_rank, pd_order="NHD", dec_order="HND", pages=32, timeouts=None,
               **faults):
    net = kvstage.InprocNet(layout.prefill_tp, layout.decode_tp, **faults)
    pre = [make_rank(layout, "prefill", r, pages, pd_order) for r in range(layout.prefill_tp)]
    dec = make_rank(layout, "decode", 0, pages, dec_order)
    tx = [kvstage.Sender(layout, r, pre[r].pool, net.link("prefill", r), timeouts=timeouts)
          for r in range(layout.prefill_tp)]
    rx = kvstage.Receiver(layout, 0, dec.pool, net.link("decode", 0), timeouts=timeouts)
    return net, pre, dec, tx, rx


@pytest.mark.parametrize("pd_order,dec_order", [("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")])
@pytest.mark.parametrize("base", [0, 40])
def test_room_end_to_end(layout, make_rank, pd_order, dec_order, base):
    net, pre, dec, tx, rx = deployment(layout, make_rank, pd_order, dec_order)
    room = 7
    tables = [p.pool.alloc(13) for p in pre]
    for p, t in zip(pre, tables):
        p.fill(t, 0, PROMPT)
    # decode already holds [0, base) (a prefix hit): those pages are not sent and stay as they
    # are (here: zero, so a write into them would show)
    delta = dec.pool.alloc(13 - base // 8)
    rx.add_room(room, base, PROMPT, delta)
    for s, t in zip(tx, tables):
        s.add_room(room, PROMPT, t)
    # chunked prefill: KV becomes computed chunk by chunk
    for computed in (32, 64, 96, PROMPT):
        for s in tx:
            s.advance(room, computed, min(computed + 32, PROMPT))
        for _ in range(5):
            for s in tx:
                s.progress()
            rx.progress()
    for s in tx:
        s.finish(room, b"\x2a\x00")
    info = drive(tx + [rx], [room])[room]
    assert info.status == kvstage.RoomStatus.SUCCESS, info
    assert info.reason == kvstage.Status.OK
    assert info.final == b"\x2a\x00"
    assert dec.mismatches(delta, base, PROMPT, base) == 0
    # the check can fail: one element off shows, and so would any write into the prefix pages
    dec.kv[1][2][delta[0]].reshape(-1)[0] ^= 1  # V of layer 2, first token of the first page
    assert dec.mismatches(delta, base, PROMPT, base) == 1
    m = rx.metrics()
    # whole pages move: the last one's tail too
    assert m["bytes"] == (13 * 8 - base) * 3 * 4 * (16 + 8) * 2
    assert m["chunks"] == len(range(base, PROMPT, 32))
    for s in tx + [rx]:
        s.release(room)
        with pytest.raises(kvstage.NotFoundError):
            s.release(room)
        assert s.rooms_held() == 0


def test_room_through_a_lossy_net(layout, make_rank):
    """The in-process net's adversarial scheduler (drops, duplicates, delays): the protocol
    recovers and every element still arrives."""
    net, pre, dec, tx, rx = deployment(layout, make_rank, timeouts={"retry": 0.005}, seed=11,
                                       drop_permille=150, dup_permille=150,
                                       delay_max_ns=200_000, write_delay_max_ns=200_000)
    tables = [p.pool.alloc(13) for p in pre]
    for p, t in zip(pre, tables):
        p.fill(t, 0, PROMPT)
    delta = dec.pool.alloc(13)
    rx.add_room(8, 0, PROMPT, delta)
    for s, t in zip(tx, tables):
        s.add_room(8, PROMPT, t)
        s.advance(8, PROMPT)
        s.finish(8, b"")
    info = drive(tx + [rx], [8], timeout=20)[8]
    assert info.status == kvstage.RoomStatus.SUCCESS, info
    assert dec.mismatches(delta, 0, PROMPT) == 0
    stats = net.stats()
    assert stats["dropped"] > 0 and stats["duplicated"] > 0


def test_receiver_checks_arguments(layout, make_rank):
    net, pre, dec, tx, rx = deployment(layout, make_rank)
    with pytest.raises(kvstage.InvalidError, match="delta_pages: 2 entries; 100 tokens at page "
                                                   "size 8 need 13"):
        rx.add_room(1, 0, PROMPT, [0, 1])
    with pytest.raises(kvstage.InvalidError, match=r"page_table\[1\]: page id out of range"):
        tx[0].add_room(1, 9, [0, 32])
    with pytest.raises(kvstage.InvalidError, match="link: it is prefill rank 1's"):
        kvstage.Sender(layout, 0, pre[0].pool, kvstage.InprocNet(2, 1).link("prefill", 1))
    with pytest.raises(kvstage.StateError, match="rank 1 already has a link"):
        net.link("prefill", 1)
    tx[0].add_room(2, 8, [3])
    with pytest.raises(kvstage.InvalidError, match="already added"):
        tx[0].add_room(2, 8, [3])
    with pytest.raises(kvstage.NotFoundError):
        tx[0].poll(99)
    with pytest.raises(kvstage.InvalidError, match="final: 65 bytes"):
        tx[0].finish(2, bytes(65)) if kvstage.FINAL_MAX == 64 else pytest.skip()


def test_abort_fails_the_room_on_both_sides(layout, make_rank):
    net, pre, dec, tx, rx = deployment(layout, make_rank)
    tables = [p.pool.alloc(13) for p in pre]
    delta = dec.pool.alloc(13)
    rx.add_room(3, 0, PROMPT, delta)
    for s, t in zip(tx, tables):
        s.add_room(3, PROMPT, t)
    for _ in range(10):
        for s in tx + [rx]:
            s.progress()
    rx.abort(3)
    infos = [drive([r], [3])[3] for r in tx + [rx]]
    for i in infos:
        assert i.status == kvstage.RoomStatus.FAILED
    assert infos[-1].reason == kvstage.Status.ERR_ABORTED


def test_timeout_fails_the_room_and_progress_never_raises(layout, make_rank, caplog):
    net, pre, dec, tx, rx = deployment(layout, make_rank, timeouts={"waiting": 0.2, "release": 0.2})
    delta = dec.pool.alloc(13)
    rx.add_room(4, 0, PROMPT, delta)  # no prefill rank ever adds it
    t0 = time.monotonic()
    info = drive([rx], [4], timeout=5)[4]
    assert info.status == kvstage.RoomStatus.FAILED
    assert info.reason == kvstage.Status.ERR_TIMEOUT
    assert time.monotonic() - t0 >= 0.2
    assert any(r.name == "kvstage" and r.levelname == "WARNING" and "room 4 failed" in
               r.getMessage() for r in caplog.records)
    with pytest.raises(kvstage.InvalidError, match=r"timeouts\[waiting\]"):
        kvstage.Receiver(layout, 0, dec.pool, kvstage.InprocNet(2, 1).link("decode", 0),
                         timeouts={"waiting": -1})
    with pytest.raises(kvstage.InvalidError, match="unknown name 'wait'"):
        kvstage.Receiver(layout, 0, dec.pool, kvstage.InprocNet(2, 1).link("decode", 0),
                         timeouts={"wait": 1})


def test_deleting_a_sender_with_live_rooms(layout, make_rank):
    """The sender goes (its writes waited for, its page tables dropped after); decode's room
    then fails by its timeout instead of anything crashing, and a closed sender refuses calls."""
    net, pre, dec, tx, rx = deployment(layout, make_rank, timeouts={"waiting": 0.3, "release": 0.2})
    tables = [p.pool.alloc(13) for p in pre]
    for p, t in zip(pre, tables):
        p.fill(t, 0, PROMPT)
    delta = dec.pool.alloc(13)
    rx.add_room(5, 0, PROMPT, delta)
    for s, t in zip(tx, tables):
        s.add_room(5, PROMPT, t)
        s.advance(5, 64)
    for _ in range(20):  # some chunks in flight
        for s in tx + [rx]:
            s.progress()
    tx[0].close()
    with pytest.raises(kvstage.StateError):
        tx[0].poll(5)
    assert tx[0].progress() == 0
    del tx[:]
    gc.collect()
    info = drive([rx], [5], timeout=5)[5]
    assert info.status == kvstage.RoomStatus.FAILED
    rx.release(5)

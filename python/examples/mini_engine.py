"""A tiny paged engine (numpy KV, its own block allocator and prefix cache, a fake forward that
writes known values per position) whose scheduler loop uses kvstage.connector, run as a prefill
and a decode process on this host over the net link, with a router (this process) sending them
requests. The second request shares a prefix with the first, so decode finds it in its prefix
cache and receives only the suffix.

    python examples/mini_engine.py

Prints one line per request and exits 0 only if every request's KV arrived exactly (prefix
blocks included) with prefill's first token, and the prefix hit happened."""

import multiprocessing as mp
import sys
import time

import kvstage
from kvstage import testing
from kvstage.connector import DecodeConnector, PrefillConnector

BLOCKS = 64


def make_layout():
    shape = kvstage.Shape(layers=2, kv_heads=2, head_dim=16, elem_bytes=2)
    return kvstage.Layout(shape, prefill_tp=1, decode_tp=1, page_size=16, chunk_tokens=32)


def first_token(tokens):
    """The fake sampler: prefill's "first token" of a prompt."""
    return (sum(tokens) * 7 % 32000).to_bytes(4, "little")


class Blocks:
    """The engine's own block allocator (an engine's, not kvstage's)."""

    def __init__(self, n):
        self.free_ids = list(range(n - 1, -1, -1))

    def alloc(self, n):
        if n > len(self.free_ids):
            raise MemoryError(f"need {n} blocks, {len(self.free_ids)} free")
        return [self.free_ids.pop() for _ in range(n)]

    def free(self, ids):
        self.free_ids.extend(ids)


class Engine:
    side = None

    def __init__(self, layout, link, connector_cls, **options):
        self.layout, self.P = layout, layout.page_size
        self.kv = testing.arrays(layout, self.side, 0, BLOCKS, "NHD")
        self.blocks = Blocks(BLOCKS)
        self.conn = connector_cls(layout, 0, link, **options)
        self.conn.register_kv_caches(self.kv[0], self.kv[1])
        self.requests = {}  # room -> state
        self.results = {}   # room -> outcome

    def blocks_for(self, tokens):
        return (tokens + self.P - 1) // self.P


class PrefillEngine(Engine):
    side = "prefill"

    def __init__(self, layout, link, **options):
        super().__init__(layout, link, PrefillConnector, **options)

    def add_request(self, room, tokens):
        ids = self.blocks.alloc(self.blocks_for(len(tokens)))
        self.conn.request_started(room, len(tokens), ids)
        self.requests[room] = {"tokens": tokens, "blocks": ids, "computed": 0}

    def step(self):
        """One scheduler iteration: one chunk of forward per running request, then the
        requests whose KV has left give their blocks back."""
        C = self.layout.chunk_tokens
        for room, r in list(self.requests.items()):
            n = len(r["tokens"])
            if r["computed"] < n:
                start, stop = r["computed"], min(r["computed"] + C, n)
                # the fake forward: this chunk's KV, a known value per position
                testing.fill(self.layout, "prefill", 0, self.kv, "NHD", r["blocks"], start, stop)
                r["computed"] = stop
                self.conn.request_computed(room, stop, min(stop + C, n))
                if stop == n:
                    self.conn.request_finished(room, first_token(r["tokens"]))
                continue
            sent = self.conn.kv_sent(room)
            if sent is not None:
                self.conn.release(room)
                self.blocks.free(r["blocks"])
                self.results[room] = sent
                del self.requests[room]
        self.conn.step()


class DecodeEngine(Engine):
    side = "decode"

    def __init__(self, layout, link, **options):
        super().__init__(layout, link, DecodeConnector, **options)
        self.prefix = {}  # tuple of a prompt's first k*P tokens -> its k blocks (never evicted)

    def lookup(self, tokens):
        """Longest cached prefix of whole blocks: (tokens held, their blocks)."""
        for k in range(len(tokens) // self.P, 0, -1):
            ids = self.prefix.get(tuple(tokens[:k * self.P]))
            if ids is not None:
                return k * self.P, ids
        return 0, []

    def add_request(self, room, tokens):
        hit, hit_blocks = self.lookup(tokens)
        base = self.conn.receivable_base(hit)
        ids = self.blocks.alloc(self.blocks_for(len(tokens) - base))
        self.conn.request_allocated(room, base, len(tokens), ids)
        self.requests[room] = {"tokens": tokens, "base": base,
                               "prefix": hit_blocks[:base // self.P], "blocks": ids}

    def step(self):
        for room, r in list(self.requests.items()):
            ready = self.conn.kv_ready(room)
            if ready is None:
                continue
            n, table = len(r["tokens"]), r["prefix"] + r["blocks"]
            if ready:
                # the fake decode step reads every position's KV, the prefix's included
                bad = testing.mismatches(self.layout, "decode", 0, self.kv, "NHD", table, 0, n)
                self.results[room] = {"ok": bad == 0, "base": r["base"], "mismatches": bad,
                                      "first_token": self.conn.first_token(room)}
            else:
                self.results[room] = {"ok": False, "base": r["base"],
                                      "reason": self.conn.reason(room).name}
            self.conn.release(room)
            full = n // self.P
            if ready:  # the prompt's full blocks go into the prefix cache, the rest back
                for k in range(len(r["prefix"]) + 1, full + 1):
                    self.prefix[tuple(r["tokens"][:k * self.P])] = table[:k]
                self.blocks.free(table[max(full, len(r["prefix"])):])
            else:
                self.blocks.free(r["blocks"])
            del self.requests[room]
        self.conn.step()


def prefill_main(conn):
    layout = make_layout()
    registry = kvstage.Registry("tcp://127.0.0.1:0")
    link = kvstage.Link.net("prefill", 0, peer_tp=1)
    registry.add(layout, 0, link.endpoint())
    registry.start_progress_thread()
    engine = PrefillEngine(layout, link)
    conn.send(registry.address)
    while True:
        while conn.poll(0):
            msg = conn.recv()
            if msg is None:
                return
            engine.add_request(*msg)
        engine.step()
        time.sleep(0.0001)


def decode_main(conn, registry):
    layout = make_layout()
    link = kvstage.Link.net("decode", 0, peer_tp=1,
                            peers=[kvstage.Registry.lookup(registry, layout, 0)],
                            registry=registry)
    engine = DecodeEngine(layout, link)
    while True:
        while conn.poll(0):
            msg = conn.recv()
            if msg is None:
                return
            engine.add_request(*msg)
        engine.step()
        for room in list(engine.results):
            conn.send((room, engine.results.pop(room)))
        time.sleep(0.0001)


def requests():
    shared = list(range(1000, 1096))  # 96 tokens (6 blocks) both of the first two share
    return [(1, shared + list(range(54))), (2, shared + list(range(500, 530))),
            (3, list(range(7, 77)))]


def main():
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    pre = ctx.Process(target=prefill_main, args=(p_child,))
    pre.start()
    dec = None
    ok = True
    try:
        if not p_conn.poll(60):
            raise RuntimeError("the prefill engine did not start")
        dec = ctx.Process(target=decode_main, args=(d_child, p_conn.recv()))
        dec.start()
        for room, tokens in requests():  # one at a time, so room 2 finds room 1's prefix
            d_conn.send((room, tokens))
            p_conn.send((room, tokens))
            if not d_conn.poll(30):
                raise RuntimeError(f"room {room}: no result from decode")
            got_room, res = d_conn.recv()
            good = (got_room == room and res["ok"] and
                    res["first_token"] == first_token(tokens) and
                    (room != 2 or res["base"] == 96))
            ok &= good
            print(f"mini_engine: room {room}, {len(tokens)} tokens, decode held {res['base']}: "
                  + ("exact, first token matches" if good else f"WRONG: {res}"))
        for c in (d_conn, p_conn):
            c.send(None)
    finally:
        for p in (dec, pre):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One request's KV handed from a prefill process (TP2: two ranks, each with its own net link)
to a decode process (TP1) on this host through the net link: ZeroMQ control, UCX data (or CUDA
IPC with --device cuda). The prefill process serves the bootstrap registry; decode looks its
ranks up there. The prompt spans several chunks and decode already holds a prefix (a radix
hit), so only the rest moves. Decode checks every element of the whole prompt, prefix
included, and this prints one summary line.

    python examples/handoff.py [--prompt 300] [--base 64] [--device cuda]

Exit status 0 only when the room succeeded on every rank and every element matches."""

import argparse
import multiprocessing as mp
import sys
import time

import kvstage
from kvstage import testing

ROOM = 7
FIRST_TOKEN = b"\x2a\x00\x00\x00"


def make_layout():
    shape = kvstage.Shape(layers=4, kv_heads=4, head_dim=32, head_dim_v=16, elem_bytes=2)
    return kvstage.Layout(shape, prefill_tp=2, decode_tp=1, page_size=16, chunk_tokens=64)


def device_of(args, rank):
    return None if args.device == "cpu" else f"cuda:{rank % args.gpus}"


def drive(ranks, deadline):
    """Progress until the room is done on every rank; the last RoomInfo of each."""
    while True:
        for r in ranks:
            r.progress()
        infos = [r.poll(ROOM) for r in ranks]
        if all(i.done for i in infos) or time.monotonic() > deadline:
            return infos
        time.sleep(0.0001)


def prefill(args, conn):
    layout = make_layout()
    registry = kvstage.Registry("tcp://127.0.0.1:0")
    ranks, senders = [], []
    for r in range(layout.prefill_tp):
        dev = device_of(args, r)
        kv = testing.arrays(layout, "prefill", r, args.pages, "NHD", dev)
        pool = kvstage.Pool(layout, "prefill", r, k=kv[0], v=kv[1])
        link = kvstage.Link.net("prefill", r, peer_tp=layout.decode_tp,
                                device=-1 if dev is None else int(dev[5:]))
        registry.add(layout, r, link.endpoint())
        senders.append(kvstage.Sender(layout, r, pool, link))
        ranks.append((kv, pool))
    registry.start_progress_thread()  # answers decode's lookups while this process works
    conn.send(registry.address)

    pages = (args.prompt + layout.page_size - 1) // layout.page_size
    tables = [pool.alloc(pages) for _, pool in ranks]
    for tx, t in zip(senders, tables):
        tx.add_room(ROOM, args.prompt, t)
    # The "forward pass": each chunk's KV is written, then reported computed, so chunks leave
    # while later ones are still being computed.
    for start in range(0, args.prompt, layout.chunk_tokens):
        stop = min(start + layout.chunk_tokens, args.prompt)
        for r, ((kv, _), t) in enumerate(zip(ranks, tables)):
            testing.fill(layout, "prefill", r, kv, "NHD", t, start, stop)
        testing.synchronize()
        for tx in senders:
            tx.advance(ROOM, stop, min(stop + layout.chunk_tokens, args.prompt))
            tx.progress()
    for tx in senders:
        tx.finish(ROOM, FIRST_TOKEN)
    infos = drive(senders, time.monotonic() + 30)
    conn.send([(int(i.status), int(i.reason)) for i in infos])
    conn.recv()  # decode is done with the room: now everything may go
    for tx in senders:
        tx.release(ROOM)
        tx.close()
    registry.stop_progress_thread()


def decode(args, registry, conn):
    layout = make_layout()
    peers = [kvstage.Registry.lookup(registry, layout, r) for r in range(layout.prefill_tp)]
    dev = device_of(args, layout.prefill_tp)
    kv = testing.arrays(layout, "decode", 0, args.pages, "HND", dev)
    pool = kvstage.Pool(layout, "decode", 0, k=kv[0], v=kv[1], order="HND")
    link = kvstage.Link.net("decode", 0, peer_tp=layout.prefill_tp, peers=peers,
                            registry=registry, device=-1 if dev is None else int(dev[5:]))
    rx = kvstage.Receiver(layout, 0, pool, link)

    P = layout.page_size
    # The prefix decode already holds, as its radix cache would: [0, base) in its own pages.
    prefix = pool.alloc(args.base // P)
    testing.fill(layout, "decode", 0, kv, "HND", prefix, 0, args.base)
    testing.synchronize()
    delta = pool.alloc((args.prompt - args.base + P - 1) // P)
    t0 = time.monotonic()
    rx.add_room(ROOM, args.base, args.prompt, delta)
    info = drive([rx], time.monotonic() + 30)[0]
    ms = (time.monotonic() - t0) * 1e3
    table = prefix + delta
    bad = testing.mismatches(layout, "decode", 0, kv, "HND", table, 0, args.prompt)
    m = rx.metrics()
    rx.release(ROOM)
    conn.send((int(info.status), int(info.reason), info.final, bad, m["bytes"], m["chunks"], ms))
    rx.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens (default 300)")
    ap.add_argument("--base", type=int, default=64,
                    help="tokens decode already holds, a multiple of 16 (default 64)")
    ap.add_argument("--pages", type=int, default=64, help="pages per pool (default 64)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: numpy pools, UCX; cuda: torch tensors (or, without torch, "
                         "kvstage.testing.CudaArray) on GPUs, CUDA IPC")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to spread the ranks over")
    args = ap.parse_args()
    if args.base % 16 or not 0 <= args.base < args.prompt or args.prompt > args.pages * 16:
        ap.error("--base must be a multiple of 16 in [0, prompt), and the prompt fit the pages")
    if args.gpus < 1:
        ap.error("--gpus must be at least 1")
    if args.device == "cuda" and testing.cuda_devices() < args.gpus:
        ap.error(f"--gpus {args.gpus}: this machine has {testing.cuda_devices()} CUDA device(s)")

    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    pre = ctx.Process(target=prefill, args=(args, p_child))
    pre.start()
    ok = False
    try:
        if not p_conn.poll(60):
            raise RuntimeError("the prefill process did not start")
        registry = p_conn.recv()
        dec = ctx.Process(target=decode, args=(args, registry, d_child))
        dec.start()
        if not d_conn.poll(60):
            raise RuntimeError("the decode process did not report")
        status, reason, final, bad, nbytes, chunks, ms = d_conn.recv()
        senders = p_conn.recv() if p_conn.poll(30) else []
        p_conn.send("done")
        dec.join(30)
        pre.join(30)
        success = int(kvstage.RoomStatus.SUCCESS)
        ok = (status == success and bad == 0 and final == FIRST_TOKEN and len(senders) == 2 and
              all(s == success for s, _ in senders) and dec.exitcode == 0 and pre.exitcode == 0)
        print(f"handoff: room {ROOM}, {args.prompt} tokens (decode held {args.base}), prefill "
              f"TP2 -> decode TP1 over the net link ({args.device}): "
              f"{kvstage.RoomStatus(status).name} ({kvstage.Status(reason).name}), {nbytes} bytes "
              f"in {chunks} chunks in {ms:.1f} ms, {bad} mismatching elements, prefill ranks "
              f"{[kvstage.RoomStatus(s).name for s, _ in senders]}")
    finally:
        for p in (pre,):
            if p.is_alive():
                p.kill()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

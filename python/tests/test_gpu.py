"""Device pools on GPUs (__cuda_array_interface__: torch tensors where torch is installed,
kvstage.testing.CudaArray otherwise), a room over the in-process link and the two-process
example over CUDA IPC. Skipped without a GPU; run on the GPU machine by scripts/gpu-check.sh
(step py-gpu)."""

import numpy as np
import pytest

import kvstage
from conftest import drive
from kvstage import testing
from test_examples import run

GPUS = testing.cuda_devices()
if GPUS == 0:
    pytest.skip("no CUDA GPU visible to the CUDA runtime", allow_module_level=True)


def gpu(rank):
    return f"cuda:{rank % GPUS}"


class DeviceRank:
    def __init__(self, layout, side, rank, pages, order):
        self.layout, self.side, self.rank, self.order = layout, side, rank, order
        self.kv = testing.arrays(layout, side, rank, pages, order, device=gpu(rank))
        self.pool = kvstage.Pool(layout, side, rank, k=self.kv[0], v=self.kv[1], order=order)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_device_pool_regions_are_the_tensors(layout, order):
    r = DeviceRank(layout, "prefill", 1, 8, order)
    assert r.pool.info()["device"] == 1 % GPUS
    for layer in range(layout.shape.layers):
        assert r.pool.region(layer, 0)[0] == r.kv[0][layer].__cuda_array_interface__["data"][0]
    with pytest.raises(kvstage.InvalidError, match="on a GPU; all or none"):
        kvstage.Pool(layout, "prefill", 0, k=r.kv[0],
                     v=[np.zeros(tuple(a.shape), np.uint16) for a in r.kv[1]], order=order)


def test_device_room_over_the_inproc_link(layout):
    net = kvstage.InprocNet(2, 1)
    pre = [DeviceRank(layout, "prefill", r, 16, "NHD") for r in range(2)]
    dec = DeviceRank(layout, "decode", 0, 16, "HND")
    tx = [kvstage.Sender(layout, r, pre[r].pool, net.link("prefill", r)) for r in range(2)]
    rx = kvstage.Receiver(layout, 0, dec.pool, net.link("decode", 0))
    tables = [p.pool.alloc(13) for p in pre]
    for p, t in zip(pre, tables):
        testing.fill(layout, "prefill", p.rank, p.kv, "NHD", t, 0, 100)
    delta = dec.pool.alloc(13 - 2)
    rx.add_room(1, 16, 100, delta)
    for s, t in zip(tx, tables):
        s.add_room(1, 100, t)
        s.advance(1, 100)
        s.finish(1, b"\x07")
    testing.synchronize()
    info = drive(tx + [rx], [1])[1]
    assert info.status == kvstage.RoomStatus.SUCCESS, info
    assert testing.mismatches(layout, "decode", 0, dec.kv, "HND", delta, 16, 100, 16) == 0


def test_two_process_handoff_over_cuda_ipc():
    r = run("handoff.py", "--device", "cuda", "--gpus", str(GPUS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 mismatching elements" in r.stdout

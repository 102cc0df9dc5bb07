"""Pools over numpy arrays: both layouts and any nesting of strides, what is refused, and
lifetimes (a pool keeps its arrays alive and never frees them)."""

import gc
import weakref

import numpy as np
import pytest

import kvstage


@pytest.fixture
def layout():
    shape = kvstage.Shape(layers=2, kv_heads=4, head_dim=8, head_dim_v=4, elem_bytes=2)
    return kvstage.Layout(shape, prefill_tp=2, decode_tp=1, page_size=4, chunk_tokens=8)


def kv(order, pages=6, heads=2, P=4, dtype=np.uint16):
    dims = [(pages, P, heads, 8), (pages, P, heads, 4)] if order == "NHD" else \
        [(pages, heads, P, 8), (pages, heads, P, 4)]
    return [np.zeros(dims[0], dtype) for _ in range(2)], [np.zeros(dims[1], dtype)
                                                          for _ in range(2)]


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_regions_are_the_arrays(layout, order):
    k, v = kv(order)
    pool = kvstage.Pool(layout, "prefill", 1, k=k, v=v, order=order)
    assert pool.total_pages == 6 and pool.free_pages == 6 and pool.heads == 2
    for layer in range(2):
        for comp, a in enumerate((k[layer], v[layer])):
            base, ps, ts, hs, heads, dim, e = pool.region(layer, comp)
            assert base == a.__array_interface__["data"][0]
            tok, head = (1, 2) if order == "NHD" else (2, 1)
            assert (ps, ts, hs) == (a.strides[0], a.strides[tok], a.strides[head])
            assert (heads, dim, e) == (2, a.shape[3], 2)
    pages = pool.alloc(6)
    assert sorted(pages) == list(range(6)) and pool.free_pages == 0
    with pytest.raises(kvstage.NoSpaceError, match="need 1, 0 free of 6"):
        pool.alloc(1)
    pool.free(pages[:3])
    with pytest.raises(kvstage.InvalidError, match="not allocated"):
        pool.free(pages[:1])
    assert pool.free_pages == 3


def test_one_stacked_array_and_strided_views(layout):
    """k as one [layers][pages][P][h][D] array, v as views into a wider buffer (non-contiguous
    page and token strides): only the last axis must be contiguous."""
    k = np.zeros((2, 6, 4, 2, 8), np.uint16)
    wide = np.zeros((2, 6, 4, 2, 10), np.uint16)
    v = wide[:, :, :, :, 3:7]
    pool = kvstage.Pool(layout, "prefill", 0, k=k, v=v)
    assert pool.region(1, 1)[0] == v[1].__array_interface__["data"][0]
    assert pool.region(1, 1)[2] == 2 * 10 * 2


@pytest.mark.parametrize("mutate,match", [
    (lambda k, v: k.__setitem__(0, k[0].astype(np.uint32)), "elements of 4 bytes"),
    (lambda k, v: k.__setitem__(1, np.zeros((6, 4, 4, 8), np.uint16)), "4 heads"),
    (lambda k, v: v.__setitem__(0, np.zeros((6, 5, 2, 4), np.uint16)), "layer 0 V: shape"),
    (lambda k, v: v.__setitem__(1, np.zeros((7, 4, 2, 4), np.uint16)), "layer 1 V: shape"),
    (lambda k, v: k.__setitem__(0, np.zeros((6, 4, 2, 16), np.uint16)[..., ::2]),
     "contiguous last axis"),
    (lambda k, v: k.__setitem__(0, np.zeros((6, 4, 2), np.uint16)), "4-dimensional"),
    (lambda k, v: k.__setitem__(0, [[1]]), "neither the buffer protocol"),
    (lambda k, v: k[0].setflags(write=False), "not writable"),
    (lambda k, v: k.__setitem__(0, np.broadcast_to(np.zeros((1, 4, 2, 8), np.uint16),
                                                   (6, 4, 2, 8))), "not writable"),
])
def test_bad_arrays_are_refused(layout, mutate, match):
    k, v = kv("NHD")
    mutate(k, v)
    with pytest.raises(kvstage.InvalidError, match=match):
        kvstage.Pool(layout, "prefill", 0, k=k, v=v)


def test_overlapping_strides_are_refused(layout):
    """Heads that alias each other (a writable view with a head stride of 0) would let two
    heads' KV land on the same bytes: libkvstage refuses the region."""
    k, v = kv("NHD")
    a = np.zeros((6, 4, 1, 8), np.uint16)
    k[0] = np.lib.stride_tricks.as_strided(a, (6, 4, 2, 8), (a.strides[0], a.strides[1], 0, 2))
    with pytest.raises(kvstage.InvalidError, match="layer 0 K region: strides"):
        kvstage.Pool(layout, "prefill", 0, k=k, v=v)


def test_argument_errors(layout):
    k, v = kv("NHD")
    with pytest.raises(kvstage.InvalidError, match="order: 'NDH'"):
        kvstage.Pool(layout, "prefill", 0, k=k, v=v, order="NDH")
    with pytest.raises(kvstage.InvalidError, match="MHA pools need k and v"):
        kvstage.Pool(layout, "prefill", 0, k=k)
    with pytest.raises(kvstage.InvalidError, match="1/2 layers"):
        kvstage.Pool(layout, "prefill", 0, k=k[:1], v=v)
    with pytest.raises(kvstage.InvalidError, match="TP"):
        kvstage.Pool(layout, "prefill", 2, k=k, v=v)


def test_mla_pool():
    shape = kvstage.Shape.mla(layers=2, latent=16, elem_bytes=4)
    layout = kvstage.Layout(shape, prefill_tp=2, decode_tp=1, page_size=4, chunk_tokens=8)
    k = [np.zeros((3, 4, 1, 16), np.float32) for _ in range(2)]
    pool = kvstage.Pool(layout, "prefill", 1, k=k)
    assert pool.heads == 1 and pool.region(1, 0)[5] == 16
    with pytest.raises(kvstage.InvalidError, match="MLA pools take the latent as k only"):
        kvstage.Pool(layout, "prefill", 1, k=k, v=k)


def test_pool_keeps_its_arrays_alive(layout):
    k, v = kv("HND")
    refs = [weakref.ref(a) for a in k + v]
    pool = kvstage.Pool(layout, "prefill", 0, k=k, v=v, order="HND")
    base = pool.region(0, 0)[0]
    del k, v
    gc.collect()
    assert all(r() is not None for r in refs)
    # the export pins the array: numpy refuses to resize memory a pool points into
    with pytest.raises(ValueError):
        refs[0]().resize((1,))
    assert pool.region(0, 0)[0] == base
    del pool
    gc.collect()
    assert all(r() is None for r in refs)


def test_sender_keeps_its_pool_and_link_alive(layout):
    k, v = kv("NHD")
    net = kvstage.InprocNet(2, 1)
    pool = kvstage.Pool(layout, "prefill", 0, k=k, v=v)
    tx = kvstage.Sender(layout, 0, pool, net.link("prefill", 0))
    refs = [weakref.ref(pool), weakref.ref(net)]
    del pool, net
    gc.collect()
    assert all(r() is not None for r in refs)
    tx.add_room(1, 8, [0, 1])
    del tx  # a live room: destroy drains it
    gc.collect()
    assert all(r() is None for r in refs)


class Interface:
    """An object with only an array interface dict (no buffer protocol), over a numpy array."""

    def __init__(self, a, name, strides=True):
        self.a = a
        d = dict(a.__array_interface__)
        if not strides:
            d["strides"] = None
        setattr(self, name, d)


def test_array_interface_objects(layout):
    """__array_interface__ alone (host), with explicit strides or None (C order)."""
    k, v = kv("NHD")
    kk = [Interface(a, "__array_interface__", strides=i == 0) for i, a in enumerate(k)]
    pool = kvstage.Pool(layout, "prefill", 0, k=kk, v=v)
    assert pool.region(1, 0)[0] == k[1].__array_interface__["data"][0]
    assert pool.region(1, 0)[1:4] == (4 * 2 * 8 * 2, 2 * 8 * 2, 8 * 2)
    assert pool.info()["device"] == -1
    ro = Interface(k[0], "__array_interface__")
    ro.__array_interface__["data"] = (ro.__array_interface__["data"][0], True)
    with pytest.raises(kvstage.InvalidError, match="read-only"):
        kvstage.Pool(layout, "prefill", 0, k=[ro, k[1]], v=v)


def test_cuda_array_interface_makes_a_device_pool(layout):
    """__cuda_array_interface__ marks the memory as a GPU's (parsed the same way; nothing here
    touches it): a device pool in CUDA builds, refused by name in others. Mixed kinds are
    refused either way."""
    k, v = kv("HND")
    kk = [Interface(a, "__cuda_array_interface__") for a in k]
    vv = [Interface(a, "__cuda_array_interface__", strides=False) for a in v]
    try:
        pool = kvstage.Pool(layout, "prefill", 0, k=kk, v=vv, order="HND", device=0)
    except kvstage.UnsupportedError as e:
        assert "device memory needs a CUDA build" in str(e)
    else:
        assert pool.info()["device"] == 0
        assert pool.region(0, 1)[1:4] == (2 * 4 * 4 * 2, 4 * 2, 4 * 4 * 2)
    with pytest.raises(kvstage.InvalidError, match="1 of 4 arrays are on a GPU"):
        kvstage.Pool(layout, "prefill", 0, k=[kk[0], k[1]], v=v, order="HND")


class DLPackOnly:
    """Only __dlpack__ (as a torch CPU tensor or a jax array offers), over a numpy array."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_objects(layout):
    k, v = kv("HND")
    wide = np.zeros((6, 2, 4, 12), np.uint16)
    v[1] = wide[..., 2:6]  # strided: DLPack carries strides in elements
    refs = [weakref.ref(a) for a in k + v]
    pool = kvstage.Pool(layout, "prefill", 0, k=[DLPackOnly(a) for a in k],
                        v=[DLPackOnly(a) for a in v], order="HND")
    assert pool.region(1, 1)[0] == wide.__array_interface__["data"][0] + 2 * 2
    assert pool.region(1, 1)[1:4] == (2 * 4 * 12 * 2, 12 * 2, 4 * 12 * 2)
    assert pool.region(0, 0)[1:4] == (2 * 4 * 8 * 2, 8 * 2, 4 * 8 * 2)
    assert pool.info()["device"] == -1
    del k, v, wide
    gc.collect()
    assert all(r() is not None for r in refs)  # the capsules own the memory now
    del pool
    gc.collect()
    assert all(r() is None for r in refs)


def test_dlpack_refusals(layout):
    k, v = kv("NHD")
    ro = k[0].copy()
    ro.setflags(write=False)
    with pytest.raises(kvstage.InvalidError, match=r"layer 0 K: __dlpack__\(\) failed"):
        kvstage.Pool(layout, "prefill", 0, k=[DLPackOnly(ro), k[1]], v=v)
    with pytest.raises(kvstage.InvalidError, match="DLPack tensor of 3 dimensions"):
        kvstage.Pool(layout, "prefill", 0, k=[DLPackOnly(k[0][0]), k[1]], v=v)

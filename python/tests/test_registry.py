"""The bootstrap registry and the net link from Python: registration over the wire, lookups
refused for a mismatched layout or timing out, and the net link's argument checks."""

import pytest

import kvstage


def layout(page_size=16):
    shape = kvstage.Shape(layers=2, kv_heads=2, head_dim=8, elem_bytes=2)
    return kvstage.Layout(shape, prefill_tp=2, decode_tp=1, page_size=page_size, chunk_tokens=32)


def test_register_and_lookup():
    reg = kvstage.Registry("tcp://127.0.0.1:0")
    reg.start_progress_thread()
    try:
        reg.add(layout(), 0, "tcp://127.0.0.1:7001")
        kvstage.Registry.register(reg.address, layout(), 1, "tcp://127.0.0.1:7002", timeout=5)
        assert reg.count() == 2
        assert kvstage.Registry.lookup(reg.address, layout(), 1, timeout=5) == \
            "tcp://127.0.0.1:7002"
        with pytest.raises(kvstage.IncompatibleError, match="page size") as e:
            kvstage.Registry.lookup(reg.address, layout(page_size=8), 0, timeout=5)
        assert e.value.status == kvstage.Status.ERR_INCOMPATIBLE
    finally:
        reg.stop_progress_thread()


def test_lookup_of_a_rank_never_registered_times_out():
    reg = kvstage.Registry("tcp://127.0.0.1:0")
    reg.start_progress_thread()
    try:
        with pytest.raises(kvstage.TimeoutError):
            kvstage.Registry.lookup(reg.address, layout(), 0, timeout=0.3)
        with pytest.raises(kvstage.InvalidError, match="timeout: -1 s is out of range"):
            kvstage.Registry.lookup(reg.address, layout(), 0, timeout=-1)
    finally:
        reg.stop_progress_thread()


def test_registry_refuses_a_second_tp_size():
    reg = kvstage.Registry("tcp://127.0.0.1:0")
    reg.add(layout(), 0, "tcp://127.0.0.1:7001")
    shape = kvstage.Shape(layers=2, kv_heads=2, head_dim=8, elem_bytes=2)
    other = kvstage.Layout(shape, prefill_tp=1, decode_tp=1, page_size=16, chunk_tokens=32)
    with pytest.raises(kvstage.IncompatibleError):
        reg.add(other, 0, "tcp://127.0.0.1:7003")


def test_net_link_arguments():
    with pytest.raises(kvstage.InvalidError, match="data: 'udp'"):
        kvstage.Link.net("prefill", 0, peer_tp=1, data="udp")
    with pytest.raises(kvstage.InvalidError, match="liveness_timeout: -2 s"):
        kvstage.Link.net("prefill", 0, peer_tp=1, liveness_timeout=-2)
    with pytest.raises(kvstage.InvalidError, match="side: 'both'"):
        kvstage.Link.net("both", 0, peer_tp=1)
    with pytest.raises(kvstage.InvalidError):
        kvstage.Link.net("prefill", 0, peer_tp=0)
    link = kvstage.Link.net("decode", 0, peer_tp=2)
    assert link.endpoint().startswith("tcp://127.0.0.1:")
    link.set_peer(1, "tcp://127.0.0.1:7009")
    assert link.stats()["writes"] == 0
    with pytest.raises(kvstage.Error):  # the endpoint is taken
        kvstage.Link.net("decode", 0, peer_tp=2, bind=link.endpoint())

"""Shape, Layout and plan: libkvstage's validation as kvstage.Error subclasses, the plan as
plain data."""

import pytest

import kvstage


def test_version_and_enums():
    assert kvstage.__version__.count(".") == 2
    assert kvstage.Status.OK == 0 and kvstage.Status.INPROGRESS == 1
    assert kvstage.Status.ERR_INVALID == -1 and kvstage.Status.ERR_CORRUPT == -12
    assert kvstage.RoomStatus.FAILED == 0 and kvstage.RoomStatus.SUCCESS == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(layers=0, kv_heads=4, head_dim=8, elem_bytes=2), "layers"),
    (dict(layers=2, kv_heads=4, head_dim=8, elem_bytes=3), "elem_bytes = 3, must be 1, 2 or 4"),
    (dict(layers=2, kv_heads=4, head_dim=0, elem_bytes=2), "head_dim"),
    (dict(layers=2, kv_heads=2, head_dim=8, elem_bytes=2, attn="mla"), "MLA"),
])
def test_shape_errors_are_the_libraries(kwargs, match):
    with pytest.raises(kvstage.InvalidError, match=match) as e:
        kvstage.Shape(**kwargs)
    assert e.value.status == kvstage.Status.ERR_INVALID
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvstage.Error)


def test_python_side_range_errors_name_the_field():
    with pytest.raises(kvstage.InvalidError, match=r"kv_heads: -1 is not an integer"):
        kvstage.Shape(layers=2, kv_heads=-1, head_dim=8, elem_bytes=2)
    with pytest.raises(kvstage.InvalidError, match="attn: 'gqa'"):
        kvstage.Shape(layers=2, kv_heads=2, head_dim=8, elem_bytes=2, attn="gqa")
    shape = kvstage.Shape(layers=2, kv_heads=4, head_dim=8, elem_bytes=2)
    with pytest.raises(kvstage.InvalidError, match="page_size: 2.5"):
        kvstage.Layout(shape, 1, 1, 2.5, 16)


def test_layout_errors():
    three = kvstage.Shape(layers=2, kv_heads=3, head_dim=8, elem_bytes=2)
    with pytest.raises(kvstage.InvalidError, match="3 KV heads cannot be split over TP 2"):
        kvstage.Layout(three, prefill_tp=2, decode_tp=1, page_size=8, chunk_tokens=32)
    shape = kvstage.Shape(layers=2, kv_heads=4, head_dim=8, elem_bytes=2)
    with pytest.raises(kvstage.InvalidError, match="page"):
        kvstage.Layout(shape, prefill_tp=1, decode_tp=1, page_size=0, chunk_tokens=32)
    with pytest.raises(kvstage.InvalidError, match="side: 'middle'"):
        kvstage.Layout(shape, 1, 1, 8, 32).heads("middle", 0)


def test_plan_tp2_to_tp1():
    shape = kvstage.Shape(layers=4, kv_heads=4, head_dim=16, elem_bytes=2)
    plan = kvstage.Layout(shape, 2, 1, 8, 32).plan(room=7)
    per_token = 4 * 2 * (16 + 16) * 2  # layers x heads x (Dk + Dv) x E
    assert plan.writers == [[kvstage.Writer(0, 0, 0, 2, per_token),
                             kvstage.Writer(1, 0, 2, 2, per_token)]]
    # regions of 32 tokens, aligned to 256: [K layers][V layers] per writer
    assert plan.slots[0].offsets == [0, 32 * per_token]
    assert plan.slots[0].bytes == 2 * 32 * per_token
    assert [[d.decode_rank for d in row] for row in plan.destinations] == [[0], [0]]
    assert plan.peers == [[0, 1]] and plan.decode_peers == [[0], [0]]


def test_plan_replicated_heads_ship_once():
    """TP4 over 2 heads: two replicas per head; each decode rank gets each head from one of
    them, and which one depends on the room."""
    shape = kvstage.Shape(layers=1, kv_heads=2, head_dim=8, elem_bytes=2)
    layout = kvstage.Layout(shape, prefill_tp=4, decode_tp=1, page_size=8, chunk_tokens=8)
    chosen = set()
    for room in range(8):
        w = layout.plan(room).writers[0]
        assert [x.dst_head for x in w] == [0, 1] and all(x.heads == 1 for x in w)
        assert w[0].prefill_rank in (0, 1) and w[1].prefill_rank in (2, 3)
        chosen.add((w[0].prefill_rank, w[1].prefill_rank))
        senders = [p for p, row in enumerate(layout.plan(room).destinations) if row]
        assert senders == sorted({x.prefill_rank for x in w})
    assert len(chosen) > 1


def test_plan_mla():
    shape = kvstage.Shape.mla(layers=2, latent=32, elem_bytes=2)
    plan = kvstage.Layout(shape, prefill_tp=2, decode_tp=2, page_size=4, chunk_tokens=8).plan(3)
    for row in plan.writers:
        assert len(row) == 1 and row[0].bytes_per_token == 2 * 32 * 2
    assert plan.peers == [[0, 1], [0, 1]]


def test_heads_of_a_rank():
    shape = kvstage.Shape(layers=1, kv_heads=8, head_dim=8, elem_bytes=2)
    layout = kvstage.Layout(shape, prefill_tp=4, decode_tp=2, page_size=8, chunk_tokens=8)
    assert layout.heads("prefill", 3) == (2, 6, 1)
    assert layout.heads("decode", 1) == (4, 4, 1)
    with pytest.raises(kvstage.InvalidError):
        layout.heads("decode", 2)



def test_chunks_are_whole_pages():
    shape = kvstage.Shape(layers=1, kv_heads=1, head_dim=64, elem_bytes=2)
    with pytest.raises(kvstage.InvalidError, match="multiple of the decode page size 16"):
        kvstage.Layout(shape, 1, 1, page_size=16, chunk_tokens=4)
    layout = kvstage.Layout(shape, 1, 1, page_size=16, chunk_tokens=32)
    assert layout.plan().slots[0].bytes == 32 * 2 * 64 * 2
    assert layout.plan(tokens=3).slots[0].bytes == 768  # 3 x 256 bytes, at 256-byte alignment


def test_libkvstage_logs_go_to_python_logging(caplog):
    """An error that becomes the exception is logged at debug level only; a room's failure
    found by progress is a warning."""
    import logging
    caplog.set_level(logging.DEBUG, logger="kvstage")
    with pytest.raises(kvstage.InvalidError):
        kvstage.Shape(layers=2, kv_heads=4, head_dim=8, elem_bytes=3)
    records = [r for r in caplog.records if r.name == "kvstage"]
    assert [r.levelno for r in records if "elem_bytes = 3" in r.getMessage()] == [logging.DEBUG]

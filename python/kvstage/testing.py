"""Known KV for tests and examples: the value of every element is a function of (position,
layer, component, global head, element), so any misplaced, stale or missing byte shows."""

import numpy as np


def values(positions, layer, comp, heads, dim):
    """[len(positions)][len(heads)][dim] uint16 values."""
    p = np.asarray(positions, dtype=np.int64)[:, None, None]
    h = np.asarray(heads, dtype=np.int64)[None, :, None]
    d = np.arange(dim, dtype=np.int64)[None, None, :]
    return ((p * 131 + layer * 31 + comp * 17 + h * 7 + d) % 65521).astype(np.uint16)


def arrays(layout, side, rank, pages, order="NHD"):
    """Zeroed per-layer K and V arrays of one rank, [pages][P][h][D] or [pages][h][P][D]."""
    shape = layout.shape
    heads = layout.heads(side, rank)[0]
    P = layout.page_size
    dims = [(pages, P, heads, shape.dim(c)) if order == "NHD" else (pages, heads, P, shape.dim(c))
            for c in range(shape.components)]
    return [[np.zeros(dims[c], dtype=np.uint16) for _ in range(shape.layers)]
            for c in range(shape.components)]


def _nhd(a, order):
    return a if order == "NHD" else a.transpose(0, 2, 1, 3)


def _where(table, start, stop, base, P):
    pos = np.arange(start, stop)
    return pos, np.asarray(table, dtype=np.int64)[(pos - base) // P], pos % P


def fill(layout, side, rank, kv, order, table, start, stop, base=0):
    """Writes the known values of positions [start, stop) (table: page ids from base on)."""
    P, first = layout.page_size, layout.heads(side, rank)[1]
    pos, pages, slots = _where(table, start, stop, base, P)
    for c, per_layer in enumerate(kv):
        for layer, a in enumerate(per_layer):
            v = _nhd(a, order)
            v[pages, slots] = values(pos, layer, c, first + np.arange(v.shape[2]), v.shape[3])


def mismatches(layout, side, rank, kv, order, table, start, stop, base=0):
    """How many elements of positions [start, stop) differ from the known values."""
    P, first = layout.page_size, layout.heads(side, rank)[1]
    pos, pages, slots = _where(table, start, stop, base, P)
    bad = 0
    for c, per_layer in enumerate(kv):
        for layer, a in enumerate(per_layer):
            v = _nhd(a, order)
            want = values(pos, layer, c, first + np.arange(v.shape[2]), v.shape[3])
            bad += int(np.count_nonzero(v[pages, slots] != want))
    return bad

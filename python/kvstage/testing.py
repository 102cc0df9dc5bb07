"""Known KV for tests and examples: the value of every element is a function of (position,
layer, component, global head, element), so any misplaced, stale or missing byte shows. Works
on numpy arrays and on torch tensors (CPU or GPU) of 2-byte elements."""

import numpy as np


def values(positions, layer, comp, heads, dim):
    """[len(positions)][len(heads)][dim] uint16 values."""
    p = np.asarray(positions, dtype=np.int64)[:, None, None]
    h = np.asarray(heads, dtype=np.int64)[None, :, None]
    d = np.arange(dim, dtype=np.int64)[None, None, :]
    return ((p * 131 + layer * 31 + comp * 17 + h * 7 + d) % 65521).astype(np.uint16)


def arrays(layout, side, rank, pages, order="NHD", device=None):
    """Zeroed per-layer arrays of one rank, [component][layer] -> [pages][P][h][D] (NHD) or
    [pages][h][P][D] (HND): numpy, or torch int16 tensors on `device` (e.g. "cuda:0")."""
    shape = layout.shape
    heads = layout.heads(side, rank)[0]
    P = layout.page_size
    dims = [(pages, P, heads, shape.dim(c)) if order == "NHD" else (pages, heads, P, shape.dim(c))
            for c in range(shape.components)]
    if device is None:
        return [[np.zeros(dims[c], dtype=np.uint16) for _ in range(shape.layers)]
                for c in range(shape.components)]
    import torch
    return [[torch.zeros(dims[c], dtype=torch.int16, device=device) for _ in range(shape.layers)]
            for c in range(shape.components)]


def _is_torch(a):
    return type(a).__module__.startswith("torch")


def _nhd(a, order):
    if order == "NHD":
        return a
    return a.permute(0, 2, 1, 3) if _is_torch(a) else a.transpose(0, 2, 1, 3)


def _where(table, start, stop, base, P):
    pos = np.arange(start, stop)
    return pos, np.asarray(table, dtype=np.int64)[(pos - base) // P], pos % P


def _get(v, pages, slots):
    if not _is_torch(v):
        return v[pages, slots]
    import torch
    idx = (torch.from_numpy(pages).to(v.device), torch.from_numpy(slots).to(v.device))
    return v[idx].cpu().numpy().view(np.uint16)


def _set(v, pages, slots, vals):
    if not _is_torch(v):
        v[pages, slots] = vals
        return
    import torch
    idx = (torch.from_numpy(pages).to(v.device), torch.from_numpy(slots).to(v.device))
    v[idx] = torch.from_numpy(vals.view(np.int16)).to(v.device)


def fill(layout, side, rank, kv, order, table, start, stop, base=0):
    """Writes the known values of positions [start, stop) (table: page ids from base on)."""
    P, first = layout.page_size, layout.heads(side, rank)[1]
    pos, pages, slots = _where(table, start, stop, base, P)
    for c, per_layer in enumerate(kv):
        for layer, a in enumerate(per_layer):
            v = _nhd(a, order)
            _set(v, pages, slots, values(pos, layer, c, first + np.arange(v.shape[2]), v.shape[3]))


def mismatches(layout, side, rank, kv, order, table, start, stop, base=0):
    """How many elements of positions [start, stop) differ from the known values."""
    P, first = layout.page_size, layout.heads(side, rank)[1]
    pos, pages, slots = _where(table, start, stop, base, P)
    bad = 0
    for c, per_layer in enumerate(kv):
        for layer, a in enumerate(per_layer):
            v = _nhd(a, order)
            want = values(pos, layer, c, first + np.arange(v.shape[2]), v.shape[3])
            bad += int(np.count_nonzero(_get(v, pages, slots) != want))
    return bad

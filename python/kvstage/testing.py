"""Known KV for tests and examples: the value of every element is a function of (position,
layer, component, global head, element), so any misplaced, stale or missing byte shows. Works
on numpy arrays, torch tensors (CPU or GPU) and, for GPUs without torch, CudaArray (device
memory through the CUDA runtime, with a host mirror), all of 2-byte elements."""

import ctypes
import ctypes.util

import numpy as np


def _cudart():
    for name in (ctypes.util.find_library("cudart"), "libcudart.so",
                 "/usr/local/cuda/lib64/libcudart.so"):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                pass
    raise OSError("the CUDA runtime (libcudart) is not found")


def cuda_devices():
    """GPUs the CUDA runtime sees (0 without one or without the runtime)."""
    try:
        n = ctypes.c_int(0)
        return n.value if _cudart().cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0
    except OSError:
        return 0


class CudaArray:
    """A zeroed device array with __cuda_array_interface__ and a host mirror: fill and
    mismatches work on .host and copy the whole array across."""

    class _Device:
        def __init__(self, index):
            self.index = index

    def __init__(self, shape, dtype, device):
        self.rt = _cudart()
        self.device = self._Device(device)
        self.host = np.zeros(shape, dtype)
        self.ptr = ctypes.c_void_p()
        self._check(self.rt.cudaSetDevice(device), "cudaSetDevice")
        self._check(self.rt.cudaMalloc(ctypes.byref(self.ptr), ctypes.c_size_t(self.host.nbytes)),
                    "cudaMalloc")
        self.upload()

    def _check(self, err, what):
        if err != 0:
            raise RuntimeError(f"{what} failed: CUDA error {err}")

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.host.shape, "typestr": self.host.dtype.str,
                "data": (self.ptr.value, False), "strides": None, "version": 3}

    @property
    def shape(self):
        return self.host.shape

    def upload(self):
        self.rt.cudaSetDevice(self.device.index)
        self._check(self.rt.cudaMemcpy(self.ptr, self.host.ctypes.data_as(ctypes.c_void_p),
                                       ctypes.c_size_t(self.host.nbytes), 1), "cudaMemcpy H2D")
        self._check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def download(self):
        self.rt.cudaSetDevice(self.device.index)
        self._check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        self._check(self.rt.cudaMemcpy(self.host.ctypes.data_as(ctypes.c_void_p), self.ptr,
                                       ctypes.c_size_t(self.host.nbytes), 2), "cudaMemcpy D2H")
        return self.host

    def __del__(self):
        if getattr(self, "ptr", None) and self.ptr.value:
            self.rt.cudaFree(self.ptr)


def values(positions, layer, comp, heads, dim):
    """[len(positions)][len(heads)][dim] uint16 values."""
    p = np.asarray(positions, dtype=np.int64)[:, None, None]
    h = np.asarray(heads, dtype=np.int64)[None, :, None]
    d = np.arange(dim, dtype=np.int64)[None, None, :]
    return ((p * 131 + layer * 31 + comp * 17 + h * 7 + d) % 65521).astype(np.uint16)


def arrays(layout, side, rank, pages, order="NHD", device=None):
    """Zeroed per-layer arrays of one rank, [component][layer] -> [pages][P][h][D] (NHD) or
    [pages][h][P][D] (HND): numpy, or on GPU `device` (e.g. "cuda:0") torch int16 tensors
    where torch is installed, CudaArray otherwise."""
    shape = layout.shape
    heads = layout.heads(side, rank)[0]
    P = layout.page_size
    dims = [(pages, P, heads, shape.dim(c)) if order == "NHD" else (pages, heads, P, shape.dim(c))
            for c in range(shape.components)]
    if device is None:
        return [[np.zeros(dims[c], dtype=np.uint16) for _ in range(shape.layers)]
                for c in range(shape.components)]
    try:
        import torch
    except ImportError:
        index = int(device.split(":")[1])
        return [[CudaArray(dims[c], np.uint16, index) for _ in range(shape.layers)]
                for c in range(shape.components)]
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


def _view(a, order):
    """An NHD view of a, and what makes changes to it land (a CudaArray's mirror goes up)."""
    if isinstance(a, CudaArray):
        return _nhd(a.download(), order), a.upload
    return _nhd(a, order), lambda: None


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
            v, land = _view(a, order)
            _set(v, pages, slots, values(pos, layer, c, first + np.arange(v.shape[2]), v.shape[3]))
            land()


def mismatches(layout, side, rank, kv, order, table, start, stop, base=0):
    """How many elements of positions [start, stop) differ from the known values."""
    P, first = layout.page_size, layout.heads(side, rank)[1]
    pos, pages, slots = _where(table, start, stop, base, P)
    bad = 0
    for c, per_layer in enumerate(kv):
        for layer, a in enumerate(per_layer):
            v, _ = _view(a, order)
            want = values(pos, layer, c, first + np.arange(v.shape[2]), v.shape[3])
            bad += int(np.count_nonzero(_get(v, pages, slots) != want))
    return bad


def synchronize():
    """Waits for torch's GPU work (the fake forward's writes) before kvstage's copies read it;
    CudaArray copies are synchronous already."""
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()

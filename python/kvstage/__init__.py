"""kvstage from Python: the handoff API of libkvstage (kvstage/pd.h) over the extension
kvstage._kvstage, one object per C handle. Plans and validation are libkvstage's own; this
module only names things (enums, errors, plain-data tuples) and fills in defaults.

    layout = kvstage.Layout(kvstage.Shape(layers=4, kv_heads=8, head_dim=64, elem_bytes=2),
                            prefill_tp=2, decode_tp=1, page_size=16, chunk_tokens=64)
    pool = kvstage.Pool(layout, "decode", 0, k=k_arrays, v=v_arrays)   # NHD or HND numpy
    rx = kvstage.Receiver(layout, 0, pool, link)
    rx.add_room(room, base=0, prompt_len=n, delta_pages=pages)
    while not rx.poll(room).done: rx.progress()

docs/python.md has the rest."""

import atexit
import enum
import weakref
from collections import namedtuple
from dataclasses import dataclass

from . import _kvstage

__version__ = _kvstage.VERSION
__all__ = [
    "Status", "RoomStatus", "Error", "Shape", "Layout", "Plan", "Writer", "Destination", "Slot",
    "plan", "Pool", "InprocNet", "Link", "Registry", "Sender", "Receiver", "RoomInfo",
    "MAX_TP", "FINAL_MAX",
]

MAX_TP = _kvstage.MAX_TP
FINAL_MAX = _kvstage.FINAL_MAX

Status = enum.IntEnum("Status", _kvstage.STATUSES)
Status.__doc__ = "kvs_status_t: OK, INPROGRESS and the negative errors."
RoomStatus = enum.IntEnum("RoomStatus", _kvstage.ROOM_STATUSES)
RoomStatus.__doc__ = "kvs_room_status_t; FAILED and SUCCESS conclude a room."


class Error(Exception):
    """A libkvstage call failed: .status (a Status) and .message (what libkvstage logged)."""

    def __init__(self, status, message):
        super().__init__(status, message)
        self.status = Status(status)
        self.message = message

    def __str__(self):
        return f"{self.message} ({self.status.name})"


def _error(name, status, *bases, doc):
    return type(name, (Error, *bases), {"__doc__": doc, "STATUS": status})


InvalidError = _error("InvalidError", Status.ERR_INVALID, ValueError,
                      doc="bad argument or configuration")
NoMemoryError = _error("NoMemoryError", Status.ERR_NOMEM, MemoryError, doc="allocation failed")
NoSpaceError = _error("NoSpaceError", Status.ERR_NOSPACE, doc="out of pages, ring space or slots")
NotFoundError = _error("NotFoundError", Status.ERR_NOT_FOUND, LookupError,
                       doc="unknown room, key or peer")
TimeoutError = _error("TimeoutError", Status.ERR_TIMEOUT, TimeoutError,
                      doc="a deadline passed")
ProtocolError = _error("ProtocolError", Status.ERR_PROTOCOL,
                       doc="a message failed validation")
UnsupportedError = _error("UnsupportedError", Status.ERR_UNSUPPORTED,
                          doc="valid request the build or layout cannot serve")
IoError = _error("IoError", Status.ERR_IO, doc="transport or system call failure")
AbortedError = _error("AbortedError", Status.ERR_ABORTED, doc="the room was aborted")
IncompatibleError = _error("IncompatibleError", Status.ERR_INCOMPATIBLE,
                           doc="peers disagree on shape, page size or layout")
StateError = _error("StateError", Status.ERR_STATE,
                    doc="call not valid in the object's current state (e.g. closed)")
CorruptError = _error("CorruptError", Status.ERR_CORRUPT,
                      doc="data failed its end-to-end checksum")
_ERRORS = [InvalidError, NoMemoryError, NoSpaceError, NotFoundError, TimeoutError,
           ProtocolError, UnsupportedError, IoError, AbortedError, IncompatibleError,
           StateError, CorruptError]
__all__ += [e.__name__ for e in _ERRORS]
_kvstage.set_errors({int(e.STATUS): e for e in _ERRORS})


_SIDES = {"prefill": 0, "decode": 1}


def _side(side):
    if side not in _SIDES:
        raise InvalidError(Status.ERR_INVALID, f"side: {side!r} is not 'prefill' or 'decode'")
    return _SIDES[side]


def _uint(name, value, low=0):
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2**32:
        raise InvalidError(Status.ERR_INVALID,
                           f"{name}: {value!r} is not an integer in [{low}, 4294967295]")
    return value


@dataclass(frozen=True)
class Shape:
    """kvs_kv_shape_t. MHA/GQA: head_dim sets both K and V widths unless head_dim_v is given.
    MLA: Shape.mla(layers, latent, elem_bytes)."""

    layers: int
    kv_heads: int
    head_dim: int
    elem_bytes: int
    head_dim_v: int = None
    attn: str = "mha"

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", 0 if self.attn == "mla" else self.head_dim)
        if self.attn not in ("mha", "mla"):
            raise InvalidError(Status.ERR_INVALID, f"attn: {self.attn!r} is not 'mha' or 'mla'")
        for name in ("layers", "kv_heads", "head_dim", "head_dim_v", "elem_bytes"):
            _uint(name, getattr(self, name))
        _kvstage.validate_shape(self._c())

    @classmethod
    def mla(cls, layers, latent, elem_bytes):
        return cls(layers, 1, latent, elem_bytes, head_dim_v=0, attn="mla")

    @property
    def components(self):
        """2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.attn == "mla" else 2

    def dim(self, component):
        return self.head_dim if component == 0 else self.head_dim_v

    def _c(self):
        return (self.layers, self.kv_heads, self.head_dim, self.head_dim_v, self.elem_bytes,
                1 if self.attn == "mla" else 0)


@dataclass(frozen=True)
class Layout:
    """kvs_pd_geometry_t: what both sides of a deployment agree on (checked at bootstrap)."""

    shape: Shape
    prefill_tp: int
    decode_tp: int
    page_size: int
    chunk_tokens: int
    checksum: bool = True

    def __post_init__(self):
        if not isinstance(self.shape, Shape):
            raise InvalidError(Status.ERR_INVALID, f"shape: {self.shape!r} is not a Shape")
        for name in ("prefill_tp", "decode_tp", "page_size", "chunk_tokens"):
            _uint(name, getattr(self, name))
        _kvstage.validate_geometry(self._c())

    def tp(self, side):
        return self.prefill_tp if _side(side) == 0 else self.decode_tp

    def heads(self, side, rank):
        """(heads held, first global head, replication) of that rank: kvs_tp_* of layout.h."""
        return _kvstage.validate_tp(self.shape._c(), self.tp(side), _uint("rank", rank))

    def plan(self, room=0, tokens=None):
        return plan(self, room, tokens)

    def _c(self):
        return (self.shape._c(), self.prefill_tp, self.decode_tp, self.page_size,
                self.chunk_tokens, 0 if self.checksum else 1)


Writer = namedtuple("Writer", "prefill_rank src_head dst_head heads bytes_per_token")
Writer.__doc__ = "kvs_writer_t: a run of heads one prefill rank writes into a decode slot."
Destination = namedtuple("Destination", "decode_rank writer w")
Slot = namedtuple("Slot", "offsets bytes")
Plan = namedtuple("Plan", "writers slots destinations peers decode_peers")
Plan.__doc__ = """The transfer plan of one room as plain data:
writers[d]: decode rank d's Writers; slots[d]: their region offsets and the slot size for
`tokens` tokens (a chunk, chunk_tokens, by default); destinations[p]: prefill rank p's
Destinations; peers[d] / decode_peers[p]: the ranks each exchanges metadata and status with."""


def plan(layout, room=0, tokens=None):
    """The plan of kvs_plan_writers/destinations/peers and kvs_slot_layout for one room."""
    tokens = layout.chunk_tokens if tokens is None else tokens
    w, s, d, p, dp = _kvstage.plan(layout.shape._c(), layout.prefill_tp, layout.decode_tp, room,
                                   tokens)
    return Plan([[Writer(*x) for x in row] for row in w], [Slot(*x) for x in s],
                [[Destination(r, i, Writer(*x)) for r, i, x in row] for row in d], p, dp)


class Pool(_kvstage.Pool):
    """A rank's paged KV pool over arrays the caller owns (kvs_pool_wrap); it keeps them alive
    and never frees them. k and v: one array per layer (a list, or one array with a leading
    layer axis), each [pages][page_size][heads][dim] for order="NHD" or
    [pages][heads][page_size][dim] for "HND", any strides with a contiguous last axis and the
    layout's element size. numpy (buffer protocol, __array_interface__) for host memory;
    torch or cupy on a GPU (__cuda_array_interface__) for device memory; otherwise DLPack
    (__dlpack__: torch CPU tensors, jax). MLA: k only."""

    def __init__(self, layout, side, rank, k, v=None, order="NHD", device=None):
        shape = layout.shape
        if order not in ("NHD", "HND"):
            raise InvalidError(Status.ERR_INVALID, f"order: {order!r} is not 'NHD' or 'HND'")
        if (v is None) != (shape.components == 1):
            raise InvalidError(Status.ERR_INVALID,
                               "v: MHA pools need k and v; MLA pools take the latent as k only")
        if len(k) != shape.layers or (v is not None and len(v) != shape.layers):
            raise InvalidError(Status.ERR_INVALID,
                               f"k/v: {len(k)}/{len(v) if v is not None else 0} layers; "
                               f"the shape has {shape.layers}")
        arrays = []
        for layer in range(shape.layers):
            arrays.append(k[layer])
            if v is not None:
                arrays.append(v[layer])
        if device is None:  # torch tensors say their GPU; others default to device 0
            index = getattr(getattr(arrays[0], "device", None), "index", None)
            device = index if isinstance(index, int) else -1
        super().__init__(shape._c(), layout.tp(side), _uint("rank", rank), layout.page_size,
                         arrays, order == "HND", device)
        self.layout = layout

    free_pages = property(lambda self: self.info()["free_pages"])
    total_pages = property(lambda self: self.info()["total_pages"])
    heads = property(lambda self: self.info()["heads"])


class InprocNet(_kvstage.InprocNet):
    """Every rank of one deployment in this process (kvstage/inproc.h), optionally under the
    seeded adversarial scheduler (delays, drops, duplicates). Links come from link()."""

    def __init__(self, prefill_tp, decode_tp, seed=0, delay_max_ns=0, drop_permille=0,
                 dup_permille=0, write_delay_max_ns=0):
        super().__init__(prefill_tp, decode_tp, seed, delay_max_ns, drop_permille, dup_permille,
                         write_delay_max_ns)

    def link(self, side, rank):
        return _kvstage.inproc_link(self, _side(side), rank)


_DATA = {"auto": 0, "shm": 1, "tcp": 2}


class Link:
    """Factories for kvs_link_t handles (the object they return is _kvstage.Link)."""

    @staticmethod
    def inproc(net, side, rank):
        return net.link(side, rank)

    @staticmethod
    def net(side, rank, peer_tp, bind="tcp://127.0.0.1:*", peers=(), data="auto",
            net_device=None, registry=None, device=-1, heartbeat=0.0, liveness_timeout=0.0,
            connect_timeout=0.0, write_timeout=0.0):
        """kvs_net_link_create: ZeroMQ control and UCX data (CUDA IPC with device >= 0).
        Times in seconds, 0 for the defaults (docs/transport.md)."""
        if data not in _DATA:
            raise InvalidError(Status.ERR_INVALID, f"data: {data!r} is not auto, shm or tcp")
        return _kvstage.net_link(_side(side), rank, peer_tp, bind, list(peers), _DATA[data],
                                 net_device, registry, device, heartbeat, liveness_timeout,
                                 connect_timeout, write_timeout)


class Registry(_kvstage.Registry):
    """The bootstrap registry a prefill instance serves (kvstage/registry.h)."""

    @property
    def address(self):
        return self.endpoint()

    def add(self, layout, rank, endpoint):
        super().add(layout._c(), rank, endpoint)

    @staticmethod
    def register(registry, layout, rank, endpoint, timeout=10.0):
        """A prefill rank of another process registers its link's endpoint."""
        _kvstage.registry_register(registry, layout._c(), rank, endpoint, timeout)

    @staticmethod
    def lookup(registry, layout, rank, timeout=10.0):
        """Decode: prefill rank `rank`'s endpoint, refused with IncompatibleError (naming the
        mismatch) unless its registration matches layout."""
        return _kvstage.registry_lookup(registry, layout._c(), rank, timeout)


class RoomInfo(namedtuple("RoomInfo", "status reason quiescent final")):
    """kvs_room_info_t: status (RoomStatus), reason (Status; why it failed), quiescent (no
    write or scatter can still touch the room's pages) and final (the final metadata bytes)."""

    __slots__ = ()

    @property
    def concluded(self):
        return self.status in (RoomStatus.SUCCESS, RoomStatus.FAILED)

    @property
    def done(self):
        """Concluded and quiescent: the room may be released."""
        return self.concluded and self.quiescent


def _info(t):
    return RoomInfo(RoomStatus(t[0]), Status(t[1]), t[2], t[3])


_threaded = weakref.WeakSet()


@atexit.register
def _stop_progress_threads():
    for obj in list(_threaded):
        obj.stop_progress_thread()


class _Rank:
    """What Sender and Receiver share: poll, abort, release, progress and the thread."""

    def poll(self, room):
        return _info(super().poll(room))

    def start_progress_thread(self, idle=0.0001):
        """Drives progress() from a thread of libkvstage's (no GIL), sleeping `idle` seconds
        after a call that found nothing to do; every other call still works meanwhile."""
        super().start_progress_thread(idle)
        _threaded.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_WRITE = {"auto": 0, "staged": 1, "direct": 2}


class Sender(_Rank, _kvstage.Sender):
    """A prefill rank's sender (kvs_sender_*). timeouts: seconds by name (retry, bootstrap,
    transfer, waiting, completion, release); the others keep libkvstage's defaults."""

    def __init__(self, layout, rank, pool, link, timeouts=None, window_chunks=4,
                 staging_buffers=4, write_mode="auto"):
        if write_mode not in _WRITE:
            raise InvalidError(Status.ERR_INVALID,
                               f"write_mode: {write_mode!r} is not auto, staged or direct")
        super().__init__(layout._c(), rank, pool, link, timeouts, window_chunks,
                         staging_buffers, _WRITE[write_mode])
        self.layout = layout

    def add_room(self, room, prompt_len, page_table):
        """page_table: the pool's page ids for tokens [0, prompt_len); copied."""
        super().add_room(room, prompt_len, page_table)

    def advance(self, room, computed, scheduled=None):
        super().advance(room, computed, computed if scheduled is None else scheduled)

    def finish(self, room, final=b""):
        super().finish(room, final)


class Receiver(_Rank, _kvstage.Receiver):
    """A decode rank's receiver (kvs_receiver_*). ring_bytes 0: four slots of a chunk."""

    def __init__(self, layout, rank, pool, link, timeouts=None, ring_bytes=0):
        if ring_bytes == 0:
            ring_bytes = 4 * max(s.bytes for s in plan(layout).slots)
        super().__init__(layout._c(), rank, pool, link, timeouts, ring_bytes)
        self.layout = layout

    def add_room(self, room, base, prompt_len, delta_pages):
        """base: tokens already held (a prefix hit, a multiple of page_size); delta_pages: page
        ids for [base, prompt_len); copied."""
        super().add_room(room, base, prompt_len, delta_pages)

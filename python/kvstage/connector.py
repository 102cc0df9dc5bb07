"""A connector-shaped adapter: the calls a paged engine's scheduler makes, mapped onto kvstage
rooms (one room per request, its id the router's). The engine keeps its own block allocator and
prefix cache; the connector only needs block ids, and holds a request's blocks from the call
that names them until release(). docs/python.md maps an engine's steps onto it.

Prefill engine                                  Decode engine
  register_kv_caches(k, v)                        register_kv_caches(k, v)
  request_started(room, prompt_len, blocks)       base = receivable_base(local_hit_tokens)
  request_computed(room, computed, scheduled)     request_allocated(room, base, prompt_len,
  ... each forward step                                             suffix_blocks)
  request_finished(room, first_token)             kv_ready(room): None / True / False
  kv_sent(room): None / True / False              first_token(room)
  release(room), then free the blocks             release(room), then use or free the blocks

kv_sent and kv_ready say None while the room is still moving, then True (it succeeded and
nothing can still touch its blocks) or False (it failed: reason(room) says why; the blocks are
free to reuse after release). step() drives progress from the scheduler loop; or pass
progress_thread=True and libkvstage's own thread does."""

from . import Pool, Receiver, RoomStatus, Sender


class _Connector:
    side = None

    def __init__(self, layout, rank, link, timeouts=None, progress_thread=False, **options):
        self.layout, self.rank, self.link = layout, rank, link
        self.timeouts, self.options = timeouts, options
        self.progress_thread = progress_thread
        self.pool = None
        self._rank = None

    def register_kv_caches(self, k, v=None, order="NHD"):
        """The engine's KV caches, per layer: [blocks][block_size][heads][dim] ("NHD") or
        [blocks][heads][block_size][dim] ("HND"); the engine keeps owning them."""
        self.pool = Pool(self.layout, self.side, self.rank, k=k, v=v, order=order)
        make = Sender if self.side == "prefill" else Receiver
        self._rank = make(self.layout, self.rank, self.pool, self.link, timeouts=self.timeouts,
                          **self.options)
        if self.progress_thread:
            self._rank.start_progress_thread()

    def step(self):
        """One progress call (from the scheduler loop); returns the work it did."""
        return self._rank.progress()

    def info(self, room):
        return self._rank.poll(room)

    def reason(self, room):
        return self._rank.poll(room).reason

    def _outcome(self, room):
        info = self._rank.poll(room)
        return info.status == RoomStatus.SUCCESS if info.done else None

    def abort(self, room):
        """The engine dropped the request: the room fails on both sides."""
        self._rank.abort(room)

    def release(self, room):
        """After kv_sent/kv_ready said True or False: the blocks are the engine's again."""
        self._rank.release(room)

    def close(self):
        if self._rank is not None:
            self._rank.close()


class PrefillConnector(_Connector):
    side = "prefill"

    def request_started(self, room, prompt_len, block_ids):
        """Blocks for the whole prompt, in order (block i holds tokens [i*P, (i+1)*P))."""
        self._rank.add_room(room, prompt_len, block_ids)

    def request_computed(self, room, computed, scheduled=None):
        """KV of [0, computed) is written; the forward now running reaches `scheduled`."""
        self._rank.advance(room, computed, scheduled)

    def request_finished(self, room, first_token=b""):
        """The prompt is done; first_token (bytes) rides with the last chunk to decode."""
        self._rank.finish(room, first_token)

    def kv_sent(self, room):
        """Has this request's KV left (None: not yet; False: the room failed)?"""
        return self._outcome(room)


class DecodeConnector(_Connector):
    side = "decode"

    def receivable_base(self, local_hit_tokens):
        """Of the tokens the engine's prefix cache holds, those the room can start from (whole
        blocks: a partial block is received again)."""
        P = self.layout.page_size
        return local_hit_tokens // P * P

    def request_allocated(self, room, base, prompt_len, block_ids):
        """Blocks for [base, prompt_len) only: the suffix the prefix cache does not hold."""
        self._rank.add_room(room, base, prompt_len, block_ids)

    def kv_ready(self, room):
        """Is this request's KV here (None: not yet; False: the room failed)?"""
        return self._outcome(room)

    def first_token(self, room):
        return self._rank.poll(room).final

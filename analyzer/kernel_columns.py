"""Every rank's ``KernelWindow`` of one window as flat columns, read from the protobuf wire format with numpy.

L3 (``l3_kernels.py``, step 1) and ``trainscope query kernels`` need every
rank's (kernel, stream) clusters as arrays. Reading them message by message
costs ~2 µs per ``KernelStats`` in Python (attribute reads, list appends):
2 s at 10,000 ranks × 100 kernels, 20 s at 100,000. Here the messages are
serialised once (upb, in C) and their bytes parsed for all ranks at once;
no Python object is made per rank, kernel or cluster.

1. Bytes: each rank's message serialised into one buffer, in rank order,
   padded with zeros, and seen as overlapping 8-byte little-endian words (a
   word at every byte offset: one gather reads a varint or a double anywhere).
2. Varints from words: a varint ends at its first byte without the top bit;
   the lowest such bit gives its length, and three mask-and-shift steps pack
   its 7-bit groups into the value (varints of up to 8 bytes, 2^56; a longer
   one, which these records never hold, raises and the caller reads the
   messages instead).
3. Fields of all messages of one nesting level at once (``scan``): per round,
   every message with bytes left reads its next tag and value, so there are as
   many rounds as the most fields in one message, each a few passes over the
   messages still open. A repeated field keeps wire order; a scalar seen twice
   keeps the last (proto3); unknown fields are skipped.
4. Levels: KernelWindow field 3 (``KernelStats``) → name (1), stream (2),
   clusters (4), total_ns (6) → ``KernelCluster`` count (1), p50 (2), p99 (3),
   min (4), max (5), shape (6, fixed64: p10..p90, ``proto/cluster_shape.py``).
5. Keys: (name, stream) numbered in order of first appearance (ranks in
   order, kernels in wire order). Names of one length are hashed to 64 bits
   as rows of bytes; every name is then compared byte for byte with the first
   name of its hash, so a hash collision is caught, never trusted (it raises
   and the caller reads the messages). A ``KernelStats`` with a kernel id (7,
   fixed64) and no name is keyed by (id, stream) and named from the job's
   dictionary (``names``: id → name; ``kernel#<id>`` when it has no entry);
   keys of named and id-only records with one (name, stream) are one key.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from trainscope.processor.kernel_names import label

_WIRE_OK = np.array([True, True, True, False, False, True, False, False])   # groups (3, 4) unsupported
_TOP = np.uint64(0x8080808080808080)
_ONE = np.uint64(1)


class WireError(ValueError):
    """Bytes this reader does not handle (a varint over 8 bytes, a group, truncation, a hash collision)."""


class _Buffer:
    """Step 1: the bytes and their 8-byte words at every offset (zero padded)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self.size = len(data)
        if isinstance(data, bytearray):
            data += bytes(16)                       # padded in place: no copy of the records
            self.bytes = np.frombuffer(data, dtype=np.uint8)
        else:
            self.bytes = np.zeros(self.size + 16, dtype=np.uint8)
            self.bytes[:self.size] = np.frombuffer(data, dtype=np.uint8)
        self.words = np.ndarray((self.size + 9,), dtype="<u8", buffer=self.bytes, strides=(1,))
        self.doubles = np.ndarray((self.size + 9,), dtype="<f8", buffer=self.bytes, strides=(1,))

    def varints(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step 2: (value, length in bytes, ok) of the varints at ``pos``; ok False: longer than 8 bytes."""
        x = self.words[pos]
        stop = ~x & _TOP
        ok = stop != 0
        low = stop & (~stop + _ONE)                       # the terminating byte's top bit
        y = x & ((low << _ONE) - _ONE)
        y = (y & np.uint64(0x007F007F007F007F)) | ((y & np.uint64(0x7F007F007F007F00)) >> np.uint64(1))
        y = (y & np.uint64(0x00003FFF00003FFF)) | ((y & np.uint64(0x3FFF00003FFF0000)) >> np.uint64(2))
        y = (y & np.uint64(0x000000000FFFFFFF)) | ((y & np.uint64(0x0FFFFFFF00000000)) >> np.uint64(4))
        length = np.frexp(low.astype(np.float64))[1] >> 3   # low = 2^(8k-1) -> k bytes (exact)
        return y.astype(np.int64), length.astype(np.int64), ok

    def small_varints(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
        """(value, length) of the varints at ``pos``: one byte read when all are below 128 (tags, counts)."""
        b = self.bytes[pos]
        long = np.flatnonzero(b & 0x80)
        if not long.size:
            return b.astype(np.int64), 1
        v, n = b.astype(np.int64), np.ones(pos.size, dtype=np.int64)
        if long.size:
            v[long], n[long], ok = self.varints(pos[long])
            if not ok.all():
                raise WireError("a varint longer than 8 bytes")
        return v, n


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One field ``scan`` collects: its number, wire type (0 varint, 1 fixed64, 2 bytes) and whether repeated."""

    number: int
    wire: int
    repeated: bool = False


def scan(buf: _Buffer, start: np.ndarray, end: np.ndarray, fields: tuple[Field, ...]) -> dict:
    """Step 3: the ``fields`` of the messages ``buf[start[i]:end[i]]``, all messages at once.

    Per scalar field: an array per message (varint: the value, default 0;
    fixed64: the value's byte offset, −1 when absent; bytes: (start, end),
    (0, 0) when absent). Per repeated field: (message, start, end) of every
    occurrence, grouped by message in wire order.
    """
    n = start.size
    out: dict = {}
    seen = {f.number: np.zeros(n, dtype=np.int64) for f in fields if f.repeated}
    for f in fields:
        if f.repeated:
            out[f.number] = ([], [], [], [])
        elif f.wire == 2:
            out[f.number] = (np.zeros(n, np.int64), np.zeros(n, np.int64))
        else:
            out[f.number] = np.full(n, 0 if f.wire == 0 else -1, dtype=np.int64)
    pos = np.asarray(start, dtype=np.int64).copy()
    end = np.asarray(end, dtype=np.int64)
    live = np.flatnonzero(pos < end)
    while live.size:
        p = pos[live]
        tag, tl = buf.small_varints(p)
        q = p + tl
        wt = tag & 7
        if not _WIRE_OK[wt].all():
            raise WireError("a group or an unknown wire type")
        a = q                                              # fixed64/fixed32: the value starts at q
        b = q + np.where(wt == 5, 4, 8)
        sub = np.flatnonzero((wt == 0) | (wt == 2))
        v = np.zeros(p.size, dtype=np.int64)
        if sub.size:
            vs, vl = buf.small_varints(q[sub])
            v[sub] = vs
            ln = wt[sub] == 2
            a = q.copy()
            a[sub] = np.where(ln, q[sub] + vl, q[sub])
            b[sub] = q[sub] + vl + np.where(ln, vs, 0)
        if (b > end[live]).any():
            raise WireError("a field past its message's end")
        for f in fields:
            sel = tag == (f.number << 3 | f.wire)
            if not sel.any():
                continue
            m = live[sel]
            if f.repeated:
                occ = seen[f.number]
                out[f.number][0].append(m)
                out[f.number][1].append(a[sel])
                out[f.number][2].append(b[sel])
                out[f.number][3].append(occ[m].copy())           # its place among the message's own
                occ[m] += 1
            elif f.wire == 2:
                out[f.number][0][m], out[f.number][1][m] = a[sel], b[sel]
            else:
                out[f.number][m] = v[sel] if f.wire == 0 else a[sel]
        pos[live] = b
        live = live[b < end[live]]
    for f in fields:
        if f.repeated:      # grouped by message, wire order within it: placed by counts, no sort
            m, a, b, occ = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in out[f.number])
            at = (np.cumsum(seen[f.number]) - seen[f.number])[m] + occ
            res = [np.empty_like(x) for x in (m, a, b)]
            for r, x in zip(res, (m, a, b)):
                r[at] = x
            out[f.number] = tuple(res)
    return out


_CHUNK_WORDS = 1 << 16
_HASH_K = np.random.default_rng(0x7A3).integers(1, 2**63, 512, dtype=np.int64).astype(np.uint64) | _ONE


def _name_words(buf: _Buffer, a: np.ndarray, length: int) -> np.ndarray:
    """The bytes ``a[i]:a[i] + length`` as rows of 8-byte words (the last one zero padded)."""
    width = -(-length // 8)
    w = buf.words[a[:, None] + 8 * np.arange(width)]
    tail = length - 8 * (width - 1)
    if tail < 8:
        w[:, -1] &= np.uint64((1 << (8 * tail)) - 1)
    return w


def _keys(buf: _Buffer, name_a: np.ndarray, name_b: np.ndarray, stream: np.ndarray, kid_pos: np.ndarray,
          names: Mapping[int, str] | None) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """Step 5 over named and id-only records: a key id per item (order of first appearance) and
    the keys as (name, stream)."""
    def text(i: int) -> str:
        return bytes(buf.bytes[name_a[i]:name_b[i]]).decode("utf-8", "replace")

    named = name_b > name_a
    if named.all() or not (kid_pos >= 0).any():
        key_id, first = _name_ids(buf, name_a, name_b, stream)
        return key_id, [(text(i), int(stream[i])) for i in first.tolist()]
    local = np.empty(named.size, dtype=np.int64)
    cand: list[tuple[int, tuple[str, int]]] = []           # (first item, key) per local key
    sel = np.flatnonzero(named)
    if sel.size:
        kn, fn = _name_ids(buf, name_a[sel], name_b[sel], stream[sel])
        local[sel] = kn
        cand += [(int(sel[f]), (text(int(sel[f])), int(stream[sel[f]]))) for f in fn.tolist()]
    sel = np.flatnonzero(~named)
    kid = np.where(kid_pos[sel] >= 0, buf.words[np.maximum(kid_pos[sel], 0)], np.uint64(0))
    # (id, stream) pairs numbered by two 1-D sorts: ids, then (id number, stream number)
    ukid, kinv = np.unique(kid, return_inverse=True)
    ustream, sinv = np.unique(stream[sel], return_inverse=True)
    dense = kinv.reshape(-1).astype(np.int64) * ustream.size + sinv.reshape(-1)
    upair, fi, inv = np.unique(dense, return_index=True, return_inverse=True)
    local[sel] = len(cand) + inv.reshape(-1)
    lookup = names.get if names is not None else (lambda k: None)
    for k, sid, f in zip(ukid[upair // ustream.size].tolist(), ustream[upair % ustream.size].tolist(), fi.tolist()):
        cand.append((int(sel[f]), (lookup(k) or label(k) if k else "", int(sid))))
    order = sorted(range(len(cand)), key=lambda c: cand[c][0])
    number: dict[tuple[str, int], int] = {}
    remap = np.empty(len(cand), dtype=np.int64)
    for c in order:
        remap[c] = number.setdefault(cand[c][1], len(number))
    return remap[local], list(number)


def _name_ids(buf: _Buffer, a: np.ndarray, b: np.ndarray, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 5: per item a key id for (bytes a:b, stream), ids in order of first appearance, and the
    first item of each key."""
    n = a.size
    length = b - a
    h = np.zeros(n, dtype=np.uint64)
    groups = [(L, np.flatnonzero(length == L)) for L in np.unique(length).tolist() if L > 0]
    for L, sel in groups:
        step = max(1, _CHUNK_WORDS // -(-L // 8))            # rows per chunk: the words stay in cache
        for c in range(0, sel.size, step):
            part = sel[c:c + step]
            with np.errstate(over="ignore"):
                w = _name_words(buf, a[part], L)
                w ^= w >> np.uint64(29)
                w *= _HASH_K[:w.shape[1]] if w.shape[1] <= _HASH_K.size else _HASH_K[np.arange(w.shape[1]) % _HASH_K.size]
                w ^= w >> np.uint64(32)
                h[part] = w.sum(axis=1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = h * np.uint64(0x9E3779B97F4A7C15) + length.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F) \
            + stream.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rep = first[inv]
    # a collision is caught, never trusted: every name equals its key's first name byte for byte
    if (length[rep] != length).any() or (stream[rep] != stream).any():
        raise WireError("hash collision between kernel names")
    for L, sel in groups:
        sel = sel[rep[sel] != sel]
        step = max(1, _CHUNK_WORDS // -(-L // 8))
        for c in range(0, sel.size, step):
            part = sel[c:c + step]
            if (_name_words(buf, a[part], L) != _name_words(buf, a[rep[part]], L)).any():
                raise WireError("hash collision between kernel names")
    by_first = np.argsort(first, kind="stable")
    renumber = np.empty_like(by_first)
    renumber[by_first] = np.arange(by_first.size)
    return renumber[inv], first[by_first]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KernelColumns:
    """Distribution ``d`` (one (rank, kernel, stream) with at least one cluster) is key
    ``keys[dist_key[d]]`` on rank ``dist_rank[d]``; its clusters are ``cl_*[cl_start[d]:cl_start[d+1]]``,
    in wire order. Clusters are as sent (no validity filter)."""

    keys: list[tuple[str, int]]
    dist_rank: np.ndarray
    dist_key: np.ndarray
    dist_total_ns: np.ndarray
    dist_count: np.ndarray       # KernelStats.count as sent
    cl_start: np.ndarray
    cl_count: np.ndarray
    cl_p50: np.ndarray
    cl_p99: np.ndarray
    cl_max: np.ndarray
    cl_min: np.ndarray
    cl_shape: np.ndarray         # uint64 words, 0 when not sent


KERNELS = (Field(3, 2, repeated=True),)
STATS = (Field(1, 2), Field(2, 0), Field(4, 2, repeated=True), Field(5, 0), Field(6, 1), Field(7, 1))
CLUSTER = (Field(1, 0), Field(2, 1), Field(3, 1), Field(4, 1), Field(5, 1), Field(6, 1))


def kernel_columns(kernels: Mapping[int, object], names: Mapping[int, str] | None = None) -> KernelColumns:
    """Steps 1-5 for {rank: KernelWindow} (ranks in ascending order); ``names``: the job's kernel-name
    dictionary, for records with ids and no names. Raises ``WireError`` on bytes it does not handle."""
    ranks = sorted(kernels)
    data = bytearray()
    bounds = [0]
    for r in ranks:
        data += kernels[r].SerializeToString()
        bounds.append(len(data))
    return columns_from_bytes(data, np.asarray(ranks, dtype=np.int64), np.asarray(bounds, dtype=np.int64), names)


def columns_from_bytes(data, ranks: np.ndarray, bounds: np.ndarray,
                       names: Mapping[int, str] | None = None) -> KernelColumns:
    """Steps 2-5 on serialised KernelWindows: message ``i`` (rank ``ranks[i]``) is ``data[bounds[i]:bounds[i+1]]``."""
    buf = _Buffer(data)
    ks_msg, ks_a, ks_b = scan(buf, bounds[:-1], bounds[1:], KERNELS)[3]
    st = scan(buf, ks_a, ks_b, STATS)
    cl_ks, cl_a, cl_b = st[4]
    n_cl = np.bincount(cl_ks, minlength=ks_a.size)
    has = n_cl > 0                                        # a KernelStats without clusters is no distribution
    name_a, name_b = st[1][0][has], st[1][1][has]
    stream = st[2][has]
    key_id, keys = _keys(buf, name_a, name_b, stream, st[7][has], names)
    cl = scan(buf, cl_a, cl_b, CLUSTER)

    def double(p):
        return np.where(p >= 0, buf.doubles[np.maximum(p, 0)], 0.0)

    total = double(st[6])[has]
    return KernelColumns(
        keys=keys, dist_rank=ranks[ks_msg][has], dist_key=key_id, dist_total_ns=total,
        dist_count=st[5][has], cl_start=np.r_[0, np.cumsum(n_cl[has])].astype(np.int64),
        cl_count=cl[1].astype(np.float64), cl_p50=double(cl[2]), cl_p99=double(cl[3]), cl_max=double(cl[5]),
        cl_min=double(cl[4]), cl_shape=np.where(cl[6] >= 0, buf.words[np.maximum(cl[6], 0)], np.uint64(0)))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KernelTotals:
    """Per ``KernelStats`` of the messages (ranks in order, kernels in wire order): its name's index into
    ``names`` (streams merged), its message, and its count and total_ns as sent."""

    names: list[str]
    name_id: np.ndarray
    message: np.ndarray
    count: np.ndarray
    total_ns: np.ndarray


def totals_from_bytes(data, bounds: np.ndarray, names: Mapping[int, str] | None = None) -> KernelTotals:
    """Steps 2-5 without the clusters: what ``trainscope query kernels`` sums per (kernel, rank);
    ``names``: the kernel-name dictionary of the records' job."""
    buf = _Buffer(data)
    bounds = np.asarray(bounds, dtype=np.int64)
    msg, a, b = scan(buf, bounds[:-1], bounds[1:], KERNELS)[3]
    st = scan(buf, a, b, (Field(1, 2), Field(5, 0), Field(6, 1), Field(7, 1)))
    name_a, name_b = st[1]
    name_id, keys = _keys(buf, name_a, name_b, np.zeros(name_a.size, dtype=np.int64), st[7], names)
    names = [k for k, _ in keys]
    total = np.where(st[6] >= 0, buf.doubles[np.maximum(st[6], 0)], 0.0)
    return KernelTotals(names, name_id, msg, st[5], total)

"""A bounded on-disk spool: an ordered log of records waiting for delivery.

The Kafka sink writes every record here first and a sender thread replays the
log in order, releasing frames only once the broker has acknowledged them. So
an outage, a slow broker or a restart of the processor never reorders or
loses records (up to ``max_bytes``), and ``export`` never waits on the
network: while anything is spooled, new records simply go behind it.

Layout of ``directory``:

* ``<id>.seg``: append-only segment files (ids increase; the last one is the
  active segment). Each holds frames::

      frame = magic u16 | body length u32 | crc32(body) u32 | body
      body  = version u8 | topic (u16 len + utf-8) | key (i32 len, -1 = None)
              | value (u32 len) | n headers u16 | n * (name u16+utf-8, value i32)

  All integers little-endian.
* ``HEAD``: where the first undelivered frame starts (segment id, offset,
  frame index), rewritten atomically on every commit so a restart does not
  resend what was already delivered from a partly consumed segment.
* ``LOCK``: held with ``flock`` so two processes never share a spool.

Crash behaviour: frames are written with one ``write`` each, without fsync
(a process crash keeps them in the page cache; an OS crash can lose the
tail). On open every segment is scanned; a torn or corrupt frame ends the
readable part of its segment, is counted in :attr:`DiskSpool.corrupt`, and the
file is truncated there, so appends continue cleanly. Corruption is never
fatal and never hides the good frames before it.
"""
from __future__ import annotations

import collections
import dataclasses
import fcntl
import os
import struct
import threading
import zlib
from typing import Iterator, Sequence

from trainscope.proto.errors import SinkError
from trainscope.proto.securefs import private_dir

_MAGIC = 0x5453  # "TS"
_VERSION = 1
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_HEADER = struct.Struct("<HII")  # magic, body length, crc32(body)
_HEAD = struct.Struct("<QQQ")  # segment id, byte offset, frame index
_U8, _U16, _U32, _I32 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<i"))
_MIN_BODY = 1 + 2 + 4 + 4 + 2  # an empty topic/key/value, no headers
_MAX_BODY = 256 << 20  # a sanity bound: a longer "length" is garbage
_CHUNK = 1 << 20  # read-ahead when scanning or replaying a segment

Headers = Sequence[tuple[str, "bytes | None"]]


@dataclasses.dataclass(frozen=True, slots=True)
class SpoolFrame:
    """One spooled record, exactly as it will be produced."""

    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes | None], ...] = ()

    def header(self, name: str) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


def encode_frame(topic: str, key: bytes | None, value: bytes, headers: Headers = ()) -> bytes:
    """The on-disk bytes of one frame, header and checksum included."""
    t = topic.encode()
    parts = [_U8.pack(_VERSION), _U16.pack(len(t)), t]
    parts += [_I32.pack(-1)] if key is None else [_I32.pack(len(key)), key]
    parts += [_U32.pack(len(value)), value, _U16.pack(len(headers))]
    for name, val in headers:
        n = name.encode()
        parts += [_U16.pack(len(n)), n]
        parts += [_I32.pack(-1)] if val is None else [_I32.pack(len(val)), val]
    body = b"".join(parts)
    return _HEADER.pack(_MAGIC, len(body), zlib.crc32(body)) + body


def decode_body(body: bytes) -> SpoolFrame:
    """Parse a checksummed body; ``ValueError`` if it is not a well-formed frame."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(body):
            raise ValueError("frame body truncated")
        pos += n
        return body[pos - n:pos]

    def num(s: struct.Struct) -> int:
        return s.unpack(take(s.size))[0]

    def opt() -> bytes | None:
        n = num(_I32)
        return None if n == -1 else take(n)

    if num(_U8) != _VERSION:
        raise ValueError("unknown frame version")
    topic = take(num(_U16)).decode()
    key = opt()
    value = take(num(_U32))
    headers = []
    for _ in range(num(_U16)):
        name = take(num(_U16)).decode()
        headers.append((name, opt()))
    if pos != len(body):
        raise ValueError("trailing bytes in frame body")
    return SpoolFrame(topic, key, value, tuple(headers))


def _scan(fd: int, pos: int, end: int, max_frames: int, max_bytes: int):
    """Read whole, valid frames from ``pos`` up to ``end``.

    Returns ``(frames, next_pos, problem)``: ``frames`` is a list of
    ``(SpoolFrame, end_offset)``; ``problem`` is ``None`` when it stopped
    cleanly (at ``end`` or at a limit), else ``"torn"`` or ``"corrupt"`` and
    ``next_pos`` is where the bad frame starts.
    """
    frames: list[tuple[SpoolFrame, int]] = []
    taken = 0
    buf, buf_pos = b"", pos
    while pos < end and len(frames) < max_frames and taken < max_bytes:
        rel = pos - buf_pos
        if rel + _HEADER.size > len(buf):
            buf, buf_pos, rel = os.pread(fd, min(_CHUNK, end - pos), pos), pos, 0
        if rel + _HEADER.size > len(buf):
            return frames, pos, "torn"
        magic, length, crc = _HEADER.unpack_from(buf, rel)
        if magic != _MAGIC or not _MIN_BODY <= length <= _MAX_BODY:
            return frames, pos, "corrupt"
        stop = pos + _HEADER.size + length
        if stop > end:
            return frames, pos, "torn"
        if rel + _HEADER.size + length > len(buf):
            buf, buf_pos, rel = os.pread(fd, max(min(_CHUNK, end - pos), stop - pos), pos), pos, 0
            if _HEADER.size + length > len(buf):
                return frames, pos, "torn"
        body = buf[rel + _HEADER.size:rel + _HEADER.size + length]
        if zlib.crc32(body) != crc:
            return frames, pos, "corrupt"
        try:
            frame = decode_body(body)
        except (ValueError, UnicodeDecodeError):
            return frames, pos, "corrupt"
        frames.append((frame, stop))
        taken += length
        pos = stop
    return frames, pos, None


@dataclasses.dataclass(slots=True)
class _Segment:
    id: int
    path: str
    size: int  # bytes of whole, valid frames (the file is truncated to this)
    frames: int


class DiskSpool:
    """Append-only, bounded, ordered, restart-safe record log (thread-safe).

    A reader calls :meth:`read` to take frames in order (a cursor moves past
    them), :meth:`commit` to release the first ``n`` taken frames once they
    are delivered, and :meth:`rewind` to take the uncommitted ones again after
    a failed delivery. :meth:`append` returns ``False`` when the spool is full
    (``max_bytes`` of segment files) or the disk refuses the write; nothing
    already spooled is ever evicted (drop-newest), so order has no gaps.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int, *, segment_bytes: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = os.fspath(directory)
        self.max_bytes = int(max_bytes)
        # A quarter of the bound per segment: space comes back in steps of at
        # most a quarter when a long backlog drains; capped so a replay never
        # keeps a huge file half-consumed.
        self.segment_bytes = int(segment_bytes or min(max(self.max_bytes // 4, 1), 64 << 20))
        #: Torn or corrupt regions found and skipped (each loses >= 1 frame).
        self.corrupt = 0
        #: HEAD updates the disk refused (full): the old HEAD stays, so a crash re-sends, never loses.
        self.head_write_failed = 0
        self._lock = threading.RLock()
        self._closed = False
        # 0700 and ours, files 0600 never opened through a link: the spool holds job ids,
        # kernel names and stacks, and a planted link must not make us truncate its target
        private_dir(self.directory, "spool directory")
        self._lock_fd = os.open(os.path.join(self.directory, "LOCK"), os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            raise SinkError(f"spool directory {self.directory} is in use by another spool: {e}") from e
        self._segments: list[_Segment] = []
        self._head = (0, 0, 0)  # segment id, offset, frame index of the first undelivered frame
        self._cursor = (0, 0, 0)  # same, for the next frame read() returns
        self._taken: collections.deque[tuple[int, int, int]] = collections.deque()
        try:
            self._open_existing()
            self._wfd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
        except BaseException:
            os.close(self._lock_fd)  # closing releases the flock
            raise

    # -- opening -----------------------------------------------------------
    def _seg_path(self, seg_id: int) -> str:
        return os.path.join(self.directory, f"{seg_id:020d}.seg")

    def _open_existing(self) -> None:
        ids = []
        for name in os.listdir(self.directory):
            if name.endswith(".seg") and name[:-4].isdigit():
                ids.append(int(name[:-4]))
            elif name.endswith(".tmp"):
                os.unlink(os.path.join(self.directory, name))
        ids.sort()
        head = self._read_head()
        for seg_id in ids:
            path = self._seg_path(seg_id)
            if head is not None and seg_id < head[0]:
                os.unlink(path)  # consumed; the commit that released it was cut short
                continue
            self._segments.append(self._scan_segment(seg_id, path))
        # Empty segments other than the last (the active one) hold nothing.
        for seg in self._segments[:-1]:
            if not seg.frames:
                os.unlink(seg.path)
        self._segments = [s for s in self._segments[:-1] if s.frames] + self._segments[-1:]
        if not self._segments:
            next_id = max(ids + [head[0] if head else 0]) + 1
            self._segments.append(_Segment(next_id, self._seg_path(next_id), 0, 0))
            os.close(os.open(self._segments[0].path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o600))
        first = self._segments[0]
        if head is not None and head[0] == first.id and head[1] <= first.size and head[2] <= first.frames:
            self._head = head
        else:
            self._head = (first.id, 0, 0)
        self._cursor = self._head
        self._frames = sum(s.frames for s in self._segments) - self._head[2]
        self._release_consumed()

    def _scan_segment(self, seg_id: int, path: str) -> _Segment:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
        try:
            end = os.fstat(fd).st_size
            pos, count = 0, 0
            while True:  # in batches, so opening a big spool does not hold it all in memory
                frames, pos, problem = _scan(fd, pos, end, 4096, 64 << 20)
                count += len(frames)
                if problem or pos >= end:
                    break
            if problem:
                self.corrupt += 1
                os.ftruncate(fd, pos)  # appends must start on a frame boundary
            return _Segment(seg_id, path, pos, count)
        finally:
            os.close(fd)

    def _read_head(self) -> tuple[int, int, int] | None:
        try:
            with open(os.path.join(self.directory, "HEAD"), "rb") as f:
                data = f.read()
            return _HEAD.unpack(data) if len(data) == _HEAD.size else None
        except FileNotFoundError:
            return None

    # -- writing -----------------------------------------------------------
    def append(self, topic: str, key: bytes | None, value: bytes, headers: Headers = ()) -> bool:
        """Add one record at the end; ``False`` (nothing written) if full or closed."""
        data = encode_frame(topic, key, value, headers)
        with self._lock:
            if self._closed:
                self.refused = "closed"
                return False
            if self.bytes + len(data) > self.max_bytes:
                self.refused = "full"  # the configured bound
                return False
            active = self._segments[-1]
            try:
                if active.size and active.size + len(data) > self.segment_bytes:
                    active = self._rotate()
                written = 0
                while written < len(data):
                    written += os.write(self._wfd, data[written:])
            except OSError as e:
                try:
                    os.ftruncate(self._wfd, active.size)  # never leave half a frame behind
                except OSError:
                    pass
                self.refused = "disk"  # the file system said no (ENOSPC, EDQUOT, EIO)
                self.disk_error = e.strerror or str(e)
                return False
            active.size += len(data)
            active.frames += 1
            self._frames += 1
            return True

    #: Why the last ``append`` returned False: "full" (max_bytes), "disk" (the file system
    #: refused the write) or "closed".
    refused: str = ""
    disk_error: str = ""

    def _rotate(self) -> _Segment:
        os.close(self._wfd)
        seg_id = self._segments[-1].id + 1
        seg = _Segment(seg_id, self._seg_path(seg_id), 0, 0)
        self._wfd = os.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
        self._segments.append(seg)
        return seg

    # -- reading -----------------------------------------------------------
    def _index(self, seg_id: int) -> int:
        for i, s in enumerate(self._segments):
            if s.id == seg_id:
                return i
        raise LookupError(seg_id)

    def _collect(self, pos: tuple[int, int, int], max_frames: int, max_bytes: int, mutate: bool):
        """Frames from ``pos`` on, as ``[(frame, (seg, end, index_after))]``.

        With ``mutate`` a bad region found at run time (the file changed
        under us) is applied: counted, the segment cut there, its lost
        frames subtracted. Without it (``peek``) bad regions are skipped.
        """
        out: list[tuple[SpoolFrame, tuple[int, int, int]]] = []
        taken = 0
        i = self._index(pos[0])
        _, off, idx = pos
        while len(out) < max_frames and taken < max_bytes:
            seg = self._segments[i]
            if off < seg.size:
                fd = os.open(seg.path, os.O_RDONLY)
                try:
                    frames, off2, problem = _scan(fd, off, seg.size, max_frames - len(out), max_bytes - taken)
                finally:
                    os.close(fd)
                for frame, stop in frames:
                    idx += 1
                    out.append((frame, (seg.id, stop, idx)))
                    taken += len(frame.value)
                off = off2
                if problem and mutate:
                    self.corrupt += 1
                    self._frames -= seg.frames - idx
                    seg.frames, seg.size = idx, off
                    if seg is self._segments[-1]:
                        os.ftruncate(self._wfd, off)
                elif problem:
                    off = seg.size
                if off < seg.size:
                    break  # a limit was reached inside this segment
            if i + 1 >= len(self._segments):
                break
            i, off, idx = i + 1, 0, 0
        return out

    def read(self, max_frames: int = 1000, max_bytes: int = 1 << 20) -> list[SpoolFrame]:
        """Take the next frames after the read cursor, in order (at least one if any)."""
        with self._lock:
            if self._closed:
                return []
            got = self._collect(self._cursor, max_frames, max(max_bytes, 1), mutate=True)
            for _, position in got:
                self._taken.append(position)
            if got:
                self._cursor = got[-1][1]
            return [f for f, _ in got]

    def rewind(self) -> None:
        """Forget what was taken but not committed; :meth:`read` starts at the head again."""
        with self._lock:
            self._taken.clear()
            self._cursor = self._head

    def peek(self, n: int = 1) -> list[SpoolFrame]:
        """The first ``n`` undelivered frames, without moving any cursor."""
        with self._lock:
            return [f for f, _ in self._collect(self._head, n, 1 << 62, mutate=False)]

    def __iter__(self) -> Iterator[SpoolFrame]:
        """Every undelivered frame in order (a snapshot taken now)."""
        return iter(self.peek(self._frames))

    def commit(self, n: int) -> None:
        """Release the first ``n`` taken frames: they were delivered."""
        if n <= 0:
            return
        with self._lock:
            if n > len(self._taken):
                raise ValueError(f"commit({n}) but only {len(self._taken)} frames were read")
            for _ in range(n):
                position = self._taken.popleft()
            self._head = position
            self._frames -= n
            self._release_consumed()

    def _release_consumed(self) -> None:
        """Delete segments before the head; reset when everything is delivered."""
        while len(self._segments) > 1 and (
            self._segments[0].id < self._head[0] or self._head[1] >= self._segments[0].size
        ):
            done = self._segments.pop(0)
            os.unlink(done.path)
            if self._head[0] <= done.id:
                self._head = (self._segments[0].id, 0, 0)
        if self._cursor[0] < self._head[0]:
            self._cursor = self._head
        last = self._segments[-1]
        if (self._frames == 0 and not self._taken and last.size
                and self._head[0] == last.id and self._head[1] >= last.size):
            # Drained: start a fresh segment so disk use drops to zero.
            self._rotate()
            self._segments.pop(0)
            os.unlink(last.path)
            self._head = self._cursor = (self._segments[0].id, 0, 0)
        self._write_head()

    def _write_head(self) -> None:
        tmp = os.path.join(self.directory, "HEAD.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(*self._head))
            os.replace(tmp, os.path.join(self.directory, "HEAD"))
        except OSError:
            # A full disk must stop neither delivery nor a restart (bench_faults: a processor
            # restarted on a full 8 KiB spool refused to start): the old HEAD stays, and after a
            # crash the frames since it are sent again (duplicates, never loss).
            self.head_write_failed += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass

    # -- state -------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """Disk bytes held by segment files (what ``max_bytes`` bounds)."""
        with self._lock:
            return sum(s.size for s in self._segments)

    @property
    def frames(self) -> int:
        """Undelivered frames (taken but uncommitted ones included)."""
        with self._lock:
            return self._frames

    def __len__(self) -> int:
        return self.frames

    def close(self) -> None:
        """Sync and release the directory; undelivered frames stay for the next open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                os.fsync(self._wfd)
            except OSError:
                pass
            os.close(self._wfd)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)

    def __enter__(self) -> "DiskSpool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

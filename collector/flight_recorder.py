"""PyTorch's Flight Recorder dumps as collective records (Mycroft §4.2 state records, §6 "dump PyTorch
CollOps collected by Flight Recorder").

What torch 2.13 (CPU build, gloo) supports, found on the installed wheel:

* the recorder holds ``TORCH_FR_BUFFER_SIZE`` (or the older
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``) entries, 2,000 when unset (on by default
  in torch 2.13; 0 turns it off), read once when the process creates its first
  process group; gloo records into it too (``profiling_name`` ``gloo:all_reduce``...);
* in-process dumps: ``torch._C._distributed_c10d._dump_fr_trace`` (pickle) and
  ``_dump_fr_trace_json`` (JSON, no stack frames); on files the same pickle
  (``TORCH_FR_DUMP_TEMP_FILE`` + rank, read by ``torch.distributed.flight_recorder``);
* the writer is ``torch/include/torch/csrc/distributed/c10d/FlightRecorderDetail.hpp``
  (``getCollectiveTrace``, ``dump_json``, ``getPgConfig``, ``getPgStatus``) with
  the keys of ``FlightRecorder.hpp`` (``version`` "2.10", ``entries``,
  ``pg_config``, ``pg_status``, per entry ``process_group`` = (name, desc),
  ``collective_seq_id``, ``profiling_name``, ``time_created_ns``,
  ``input_sizes``/``input_dtypes``, ``state``, ``time_discovered_started_ns``/
  ``_completed_ns`` (None in the pickle, 0 in the JSON), ``retired``, ``is_p2p``...);
* on gloo ``state`` stays ``scheduled`` and the discovered times stay unset
  (gloo's work has no start/end events to query); ``retired`` is set when the
  work completes and ``pg_status`` counts ``last_completed_collective`` per
  process-group id; ``pg_config`` is empty (only NCCL registers the ranks). So a
  gloo entry is *completed* when retired or at most its group's last completed
  sequence number, but has no completion time.

Steps:

1. ``parse`` (bytes → :class:`FrDump`): JSON when the data starts with ``{``,
   else a pickle read by an unpickler that refuses every global (a dump holds
   only dicts, lists, tuples and scalars: a crafted pickle cannot run code).
   Every field used is type-checked; a truncated, foreign or malformed dump
   raises :class:`FlightRecorderError` with one line naming the entry and field.
2. Per entry: the op from ``profiling_name`` (``gloo:all_reduce`` → ``allreduce``,
   ``nccl:_allgather_base`` → ``allgather``), bytes from the input sizes and
   dtypes, the state ``scheduled``/``started``/``completed`` (gloo: see above).
3. ``to_batch``: the entries of collectives (not point-to-point) as a
   ``CollectiveBatch``: group id = torch's group name (the one the collective
   wrappers use, so records from both join by (group, seq) when the seqs agree),
   members from ``pg_config`` or from the caller; in flight → a state record
   (``end_ns = 0``), completed with a time → a completed record, completed
   without one (gloo) → left out and counted (a record needs an end time).
4. ``snapshot`` (in-process, for a rank's collector): the JSON dump of this
   process's recorder and its groups' members from ``torch.distributed``;
   ``None`` when torch or the recorder is absent. Never raises.
5. ``view`` / ``take_view`` (the stack grid's evidence, Mycroft §5): at a
   ``StackDumpCommand`` the collector's stack dumper takes this process's
   recorder and keeps, per process group, the newest seq it entered, torch's
   last completed seq and its last ``VIEW_ENTRIES`` entries (seq, op, state as
   torch wrote it, retired, bytes, sizes), at most ``VIEW_GROUPS`` groups; the
   analyzer compares the ranks' newest seqs (who is behind). ``take_view`` says
   why there is no view (torch not loaded, recorder off, dump failed).
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import sys
from typing import Any, Mapping

from trainscope.proto.errors import BadInput
from trainscope.proto.v1 import telemetry_pb2

#: Dumps larger than this are refused (a 2,000-entry buffer with stack frames is ~2 MB).
MAX_DUMP_BYTES = 256 * 2**20
#: Versions of the format understood ("2.x": torch 2.4 wrote "2.2", torch 2.13 writes "2.10").
MAJOR_VERSION = "2"
STATES = ("scheduled", "started", "completed")
#: Environment variables that size (and so turn on) torch's recorder, newest name first.
FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: Step 5's bounds: entries kept per group, groups per view, characters of an entry's sizes.
VIEW_ENTRIES = 8
VIEW_GROUPS = 16
MAX_SIZES_CHARS = 64
#: c10::toString(ScalarType) -> (torch dtype name, bytes per element)
DTYPES = {
    "Float": ("float32", 4), "Double": ("float64", 8), "Half": ("float16", 2), "BFloat16": ("bfloat16", 2),
    "Long": ("int64", 8), "Int": ("int32", 4), "Short": ("int16", 2), "Char": ("int8", 1),
    "Byte": ("uint8", 1), "Bool": ("bool", 1), "ComplexFloat": ("complex64", 8),
    "ComplexDouble": ("complex128", 16), "ComplexHalf": ("complex32", 4), "UInt16": ("uint16", 2),
    "UInt32": ("uint32", 4), "UInt64": ("uint64", 8),
}


class FlightRecorderError(BadInput):
    """A dump that cannot be read: truncated, not a Flight Recorder dump, or a field of the wrong type."""

    def __init__(self, source: str, detail: str) -> None:
        super().__init__("bad_flight_recorder_dump", f"{source}: {detail}")
        self.source = source


@dataclasses.dataclass(frozen=True, slots=True)
class FrEntry:
    """One collective of one rank as the Flight Recorder saw it (step 2)."""

    record_id: int
    pg_id: int
    group: str              # torch's process-group name ("0", "1", ...)
    group_desc: str         # "default_pg", "undefined", ...
    seq: int                # collective_seq_id: per group, the same collective on every member
    p2p_seq: int
    is_p2p: bool
    op: str                 # allreduce, allgather, reducescatter, ...
    backend: str            # gloo, nccl, ...
    nbytes: int             # the rank's input
    dtype: str              # torch name of the first input's dtype ("" when none)
    state: str              # scheduled | started | completed
    created_ns: int
    started_ns: int         # 0: unknown
    completed_ns: int       # 0: unknown (always on gloo) or not completed
    retired: bool
    timeout_ms: int
    duration_ms: float      # NaN: not measured
    torch_state: str = ""   # the state as torch wrote it (``state`` above is the reading of it)
    sizes: str = ""         # input sizes as written, e.g. "[[66568]]"


@dataclasses.dataclass(frozen=True, slots=True)
class FrDump:
    version: str
    comm_lib_version: str
    groups: Mapping[str, tuple[str, tuple[int, ...]]]      # name -> (desc, ranks) from pg_config
    status: Mapping[int, tuple[int, int, int]]             # pg id -> last (enqueued, started, completed) seq
    entries: tuple[FrEntry, ...]
    ring_entries: int = 0   # entries torch's dump held (``entries`` above may be only each group's newest)

    def in_flight(self) -> list[FrEntry]:
        return [e for e in self.entries if e.state != "completed"]


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):   # step 1: data only
        raise pickle.UnpicklingError(f"refuses the pickled object {module}.{name}")


# ------------------------------------------------------------------ step 1
def parse(data: bytes, source: str = "flight recorder dump", last_per_group: int = 0) -> FrDump:
    """Step 1-2: a dump's bytes (pickle or JSON) as an :class:`FrDump`; ``FlightRecorderError`` if malformed.
    ``last_per_group`` > 0 reads only each process group's newest entries (step 5: a 2,000-entry ring costs
    ~50 ms of Python to read whole)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FlightRecorderError(source, f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise FlightRecorderError(source, "empty")
    if len(data) > MAX_DUMP_BYTES:
        raise FlightRecorderError(source, f"{len(data)} bytes (limit {MAX_DUMP_BYTES} bytes)")
    if data.lstrip()[:1] == b"{":
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise FlightRecorderError(source, f"truncated or invalid JSON ({e})") from None
    else:
        try:
            raw = _NoGlobals(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise FlightRecorderError(source, f"not a Flight Recorder pickle ({e})") from None
        except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, RecursionError,
                MemoryError, OverflowError) as e:
            raise FlightRecorderError(source, f"truncated or corrupt pickle ({type(e).__name__}: {e})") from None
    return _from_raw(raw, source, last_per_group)


def _last_per_group(entries: list, n: int) -> list:
    """The newest ``n`` entries of each (group, pg_id), in order; entries not shaped as torch writes them
    are kept, so that step 1 still names them."""
    seen: dict = {}
    keep = []
    for e in reversed(entries):
        pg = e.get("process_group") if isinstance(e, dict) else None
        key = (tuple(pg) if isinstance(pg, (list, tuple)) else repr(pg), repr(e.get("pg_id"))) \
            if isinstance(e, dict) else None
        if key is None or seen.get(key, 0) < n:
            keep.append(e)
            if key is not None:
                seen[key] = seen.get(key, 0) + 1
    return keep[::-1]


def read(path: str) -> FrDump:
    """A dump file (torch writes ``TORCH_FR_DUMP_TEMP_FILE`` + rank); errors name the path."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_DUMP_BYTES + 1)
    except OSError as e:
        raise FlightRecorderError(path, f"cannot read ({e.strerror or e})") from None
    return parse(data, path)


def _from_raw(raw: Any, source: str, last_per_group: int = 0) -> FrDump:
    if not isinstance(raw, dict):
        raise FlightRecorderError(source, f"top level is {type(raw).__name__}, not a dict")
    version = raw.get("version")
    if not isinstance(version, str):
        raise FlightRecorderError(source, "no 'version' string: not a Flight Recorder dump")
    if version.split(".")[0] != MAJOR_VERSION:
        raise FlightRecorderError(source, f"version {version!r} not understood (major {MAJOR_VERSION} expected)")
    groups: dict[str, tuple[str, tuple[int, ...]]] = {}
    pg_config = raw.get("pg_config", {})
    if not isinstance(pg_config, dict):
        raise FlightRecorderError(source, "'pg_config' is not a dict")
    for name, info in pg_config.items():
        if not isinstance(info, dict):
            raise FlightRecorderError(source, f"pg_config[{name!r}] is not a dict")
        ranks = _ranks(info.get("ranks", "[]"), f"pg_config[{name!r}].ranks", source)
        if name and ranks:   # gloo leaves one empty placeholder ('': ranks '[]')
            groups[str(name)] = (str(info.get("desc", "")), ranks)
    status: dict[int, tuple[int, int, int]] = {}
    pg_status = raw.get("pg_status", {})
    if not isinstance(pg_status, dict):
        raise FlightRecorderError(source, "'pg_status' is not a dict")
    for pg, st in pg_status.items():
        where = f"pg_status[{pg!r}]"
        if not isinstance(st, dict):
            raise FlightRecorderError(source, f"{where} is not a dict")
        status[_int(pg, where, source)] = tuple(      # the JSON writes these as strings
            _int(st.get(k, -1), f"{where}.{k}", source)
            for k in ("last_enqueued_collective", "last_started_collective", "last_completed_collective"))
    entries = raw.get("entries", [])   # absent when dumped with includeCollectives=False
    if not isinstance(entries, list):
        raise FlightRecorderError(source, "'entries' is not a list")
    ring = len(entries)
    if last_per_group > 0:
        entries = _last_per_group(entries, last_per_group)
    out = tuple(_entry(i, e, status, source) for i, e in enumerate(entries))
    return FrDump(version=version, comm_lib_version=str(raw.get("comm_lib_version", "")), groups=groups,
                  status=status, entries=out, ring_entries=ring)


def _int(v: Any, where: str, source: str) -> int:
    if isinstance(v, bool):
        raise FlightRecorderError(source, f"{where} must be an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    raise FlightRecorderError(source, f"{where} must be an integer, got {v!r:.60}")


def _ranks(v: Any, where: str, source: str) -> tuple[int, ...]:
    if isinstance(v, str):   # ranks_str (TraceUtils.h): "[0, 1, 2]"
        body = v.strip()
        if not (body.startswith("[") and body.endswith("]")):
            raise FlightRecorderError(source, f"{where} must look like '[0, 1]', got {v!r:.60}")
        v = [x for x in body[1:-1].split(",") if x.strip()]
    if not isinstance(v, (list, tuple)):
        raise FlightRecorderError(source, f"{where} must be a list of ranks, got {v!r:.60}")
    return tuple(_int(x.strip() if isinstance(x, str) else x, where, source) for x in v)


def _op(profiling_name: str) -> tuple[str, str]:
    """Step 2: ``gloo:all_reduce`` → (``gloo``, ``allreduce``); ``nccl:send 0->1`` → (``nccl``, ``send``)."""
    backend, _, name = profiling_name.rpartition(":")
    name = name.split(" ")[0].strip("_").lower()
    changed = True
    while changed:
        changed = False
        for suffix in ("_coalesced", "_base", "_into_tensor", "_tensor", "_single"):
            if name.endswith(suffix) and len(name) > len(suffix):
                name, changed = name[: -len(suffix)], True
    return backend, name.replace("_", "") or "unknown"


def _entry(i: int, e: Any, status: Mapping[int, tuple[int, int, int]], source: str) -> FrEntry:
    where = f"entry {i}"
    if not isinstance(e, dict):
        raise FlightRecorderError(source, f"{where} is {type(e).__name__}, not a dict")

    def need(key: str):
        if key not in e:
            raise FlightRecorderError(source, f"{where} has no {key!r}")
        return e[key]

    pg = need("process_group")
    if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and all(isinstance(x, str) for x in pg)):
        raise FlightRecorderError(source, f"{where}: 'process_group' must be (name, desc), got {pg!r:.60}")
    name = need("profiling_name")
    if not isinstance(name, str):
        raise FlightRecorderError(source, f"{where}: 'profiling_name' must be a string, got {name!r:.60}")
    state = need("state")
    raw_state = state
    if state not in STATES:
        raise FlightRecorderError(source, f"{where}: 'state' must be one of {STATES}, got {state!r:.60}")
    sizes, dtypes = need("input_sizes"), need("input_dtypes")
    if not (isinstance(sizes, list) and all(isinstance(s, list) for s in sizes)):
        raise FlightRecorderError(source, f"{where}: 'input_sizes' must be a list of lists")
    if not (isinstance(dtypes, list) and all(isinstance(d, str) for d in dtypes)):
        raise FlightRecorderError(source, f"{where}: 'input_dtypes' must be a list of strings")
    nbytes = 0
    for j, dims in enumerate(sizes):
        n = math.prod(_int(d, f"{where}.input_sizes[{j}]", source) for d in dims)
        width = DTYPES.get(dtypes[j] if j < len(dtypes) else "", ("", 0))[1]
        nbytes += max(n, 0) * width
    dtype = DTYPES.get(dtypes[0], (dtypes[0].lower(), 0))[0] if dtypes else ""
    pg_id, seq = _int(need("pg_id"), f"{where}.pg_id", source), _int(need("collective_seq_id"), f"{where}.seq", source)
    retired = need("retired")
    is_p2p = e.get("is_p2p", False)
    if not isinstance(retired, bool) or not isinstance(is_p2p, bool):
        raise FlightRecorderError(source, f"{where}: 'retired' and 'is_p2p' must be booleans")

    def opt_ns(key: str) -> int:   # None in the pickle, 0 in the JSON when unknown
        v = e.get(key)
        return 0 if v is None else max(_int(v, f"{where}.{key}", source), 0)

    created = _int(need("time_created_ns"), f"{where}.time_created_ns", source)
    started, completed = opt_ns("time_discovered_started_ns"), opt_ns("time_discovered_completed_ns")
    last_done = status.get(pg_id, (-1, -1, -1))[2]
    if state != "completed" and (retired or completed or (not is_p2p and 0 < seq <= last_done)):
        state = "completed"   # gloo: retired (or counted completed by its group) without events
    backend, op = _op(name)
    dur = e.get("duration_ms")
    return FrEntry(record_id=_int(need("record_id"), f"{where}.record_id", source), pg_id=pg_id, group=pg[0],
                   group_desc=pg[1], seq=seq, p2p_seq=_int(e.get("p2p_seq_id", 0), f"{where}.p2p_seq_id", source),
                   is_p2p=is_p2p, op=op, backend=backend, nbytes=nbytes, dtype=dtype, state=state,
                   created_ns=created, started_ns=started, completed_ns=completed, retired=retired,
                   timeout_ms=_int(e.get("timeout_ms", 0), f"{where}.timeout_ms", source),
                   duration_ms=float(dur) if isinstance(dur, (int, float)) and not isinstance(dur, bool) else math.nan,
                   torch_state=raw_state, sizes=_sizes(sizes))


def _sizes(sizes: list) -> str:
    """``[[66568], [2, 3]]`` → ``[66568] [2,3]`` (at most ``MAX_SIZES_CHARS``)."""
    text = " ".join("[" + ",".join(str(d) for d in dims) + "]" for dims in sizes)
    return text if len(text) <= MAX_SIZES_CHARS else text[: MAX_SIZES_CHARS - 3] + "..."


# ------------------------------------------------------------------ step 3
def to_batch(dump: FrDump, members: Mapping[str, tuple[int, ...]] | None = None, now_ns: int = 0,
             iteration: int = 0) -> tuple[telemetry_pb2.CollectiveBatch, dict[str, int]]:
    """Step 3: (batch, counts) where counts says what was left out and why
    (``p2p``, ``untimed_completed``: gloo's completions carry no time, ``no_members``)."""
    members = members or {}
    counts = {"records": 0, "p2p": 0, "untimed_completed": 0, "no_members": 0}
    names: list[str] = []
    index: dict[str, int] = {}
    rows = []
    for e in dump.entries:
        if e.is_p2p or e.seq <= 0:
            counts["p2p"] += 1
            continue
        if e.state == "completed" and not e.completed_ns:
            counts["untimed_completed"] += 1
            continue
        ranks = dump.groups.get(e.group, (None, None))[1] or members.get(e.group)
        if not ranks:
            counts["no_members"] += 1
            continue
        if e.group not in index:
            index[e.group] = len(names)
            names.append(e.group)
        rows.append((index[e.group], e))
    batch = telemetry_pb2.CollectiveBatch(now_ns=now_ns or max((e.created_ns for _, e in rows), default=0))
    for g in names:
        batch.groups.add(id=g, members=dump.groups.get(g, (None, None))[1] or members[g])
    for gi, e in rows:
        batch.records.add(group=gi, seq=e.seq, op=e.op, bytes=e.nbytes, dtype=e.dtype, enqueue_ns=e.created_ns,
                          start_ns=e.started_ns or e.created_ns,
                          end_ns=e.completed_ns if e.state == "completed" else 0, iteration=iteration)
    counts["records"] = len(rows)
    return batch, counts


# ------------------------------------------------------------------ step 4
def snapshot(only_active: bool = False) -> tuple[FrDump, dict[str, tuple[int, ...]]] | None:
    """Step 4: this process's recorder as (dump, members by group name); ``None`` without one. Never raises."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d_C
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_available() or not dist.is_initialized():
            return None
        dump = parse(c10d_C._dump_fr_trace_json(includeCollectives=True, onlyActive=only_active),
                     "in-process flight recorder")
        members = {}
        for pg, name in list(c10d._world.pg_names.items()):
            try:
                members[str(name)] = tuple(int(r) for r in dist.get_process_group_ranks(pg))
            except Exception:
                continue
        return dump, members
    except Exception:
        return None


# ------------------------------------------------------------------ step 5
def view(dump: FrDump, entries: int = VIEW_ENTRIES, groups: int = VIEW_GROUPS) -> list[telemetry_pb2.FlightRecorderGroup]:
    """Step 5: the compact per-group view a stack-grid dump carries (Mycroft §5 evidence).

    Per process group (torch's group name) of the dump's collectives (point-to-point
    entries left out: they have no group-wide seq): the newest seq this rank entered
    (its newest entry, or torch's ``last_enqueued_collective`` when the ring already
    dropped it), torch's ``last_completed_collective``, and its newest ``entries``
    entries oldest first, each with the state as torch wrote it. At most ``groups``
    groups, those with the newest entries first; listed by group name.
    """
    live: dict[str, int] = {}   # group name -> its newest pg_id: a group destroyed and made again keeps
    for e in dump.entries:      # its name, not its id (a process-wide counter), and counts seqs from 1
        if not e.is_p2p and e.seq > 0:
            live[e.group] = max(live.get(e.group, e.pg_id), e.pg_id)
    by_group: dict[str, list[FrEntry]] = {}
    for e in dump.entries:
        if not e.is_p2p and e.seq > 0 and e.pg_id == live[e.group]:
            by_group.setdefault(e.group, []).append(e)
    newest = sorted(by_group, key=lambda g: -max(e.created_ns for e in by_group[g]))[:max(groups, 0)]
    out = []
    for g in sorted(newest, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g)):
        rows = sorted(by_group[g], key=lambda e: e.seq)
        status = dump.status.get(rows[-1].pg_id, (-1, -1, -1))
        v = telemetry_pb2.FlightRecorderGroup(group=g, desc=rows[-1].group_desc,
                                              newest_seq=max(rows[-1].seq, status[0], 0),
                                              last_completed_seq=status[2])
        for e in rows[-entries:] if entries > 0 else ():
            v.entries.add(seq=e.seq, op=e.op, state=e.torch_state or e.state, retired=e.retired, bytes=e.nbytes,
                          sizes=e.sizes, created_unix_ns=max(e.created_ns, 0))
        out.append(v)
    return out


#: Step 5's outcomes of one read (the processor counts them: ``flight_recorder_views{outcome}``).
READ_OUTCOMES = ("ok", "off", "error")


@dataclasses.dataclass(frozen=True, slots=True)
class FrRead:
    """Step 5: one read of this process's recorder by the stack dumper."""

    groups: list            # FlightRecorderGroup views (empty: none, ``why`` says why)
    why: str = ""
    outcome: str = "ok"     # ok | off: nothing to read | error: the dump or its parse failed
    entries: int = 0        # entries torch's dump held (0: no dump taken)


def read_view(entries: int = VIEW_ENTRIES, groups: int = VIEW_GROUPS) -> FrRead:
    """Step 5 in process (the stack dumper's thread): the view, or why there is none, with the read's
    outcome and the entries torch's dump held. Never raises, never imports torch into a process that
    has not (a job without torch has no recorder)."""
    try:
        if "torch" not in sys.modules:
            return FrRead([], "torch is not loaded in this process", "off")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return FrRead([], "torch.distributed is not initialised in this process", "off")
        from torch._C import _distributed_c10d as c10d_C

        dump_json = getattr(c10d_C, "_dump_fr_trace_json", None)
        if dump_json is None:
            return FrRead([], "this torch has no in-process Flight Recorder dump (_dump_fr_trace_json)", "off")
        dump = parse(dump_json(includeCollectives=True, onlyActive=False), "in-process flight recorder",
                     last_per_group=max(entries, 1))
        out = view(dump, entries, groups)
        if out:
            return FrRead(out, "", "ok", dump.ring_entries)
        name = next((k for k in FR_ENV if os.environ.get(k) is not None), None)
        if name is not None and not _positive(os.environ[name]):
            return FrRead([], f"Flight Recorder off ({name}={os.environ[name][:20]})", "off", dump.ring_entries)
        return FrRead([], "the Flight Recorder holds no collective of this process (none issued yet, or the "
                          "recorder was off when the first process group was created)", "off", dump.ring_entries)
    except FlightRecorderError as e:
        return FrRead([], str(e)[:200], "error")
    except Exception as e:   # evidence only: never into the dumper, never into training
        return FrRead([], f"Flight Recorder dump failed: {type(e).__name__}: {e}"[:200], "error")


def take_view(entries: int = VIEW_ENTRIES, groups: int = VIEW_GROUPS) -> tuple[list, str]:
    """Step 5 as (view, "") or ([], why there is none); ``read_view`` without the read's figures."""
    r = read_view(entries, groups)
    return r.groups, r.why


def _positive(v: str | None) -> bool:
    try:
        return v is not None and int(v) > 0
    except ValueError:
        return False


__all__ = ["FR_ENV", "FlightRecorderError", "FrDump", "FrEntry", "FrRead", "READ_OUTCOMES", "parse", "read",
           "read_view", "snapshot", "take_view",
           "to_batch", "view", "DTYPES"]

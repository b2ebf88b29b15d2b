"""Structural validation of Perfetto TrackEvent traces, without TraceProcessor.

TraceProcessor (the reference importer) downloads a native binary, which
these machines cannot do, so traces are checked here against the rules of
https://perfetto.dev/docs/reference/synthetic-track-event and
https://perfetto.dev/docs/concepts/clock-sync, parsing with the protos that
the ``perfetto`` package ships:

1. Every track uuid an event uses (and every parent uuid) was declared by a
   TrackDescriptor earlier in the trace.
2. Packets that need incremental state come after the sequence cleared it;
   every interned id (event names, debug-annotation names and string values)
   was defined on the same sequence before use.
3. Timestamps resolve: packet clock, else the sequence's packet defaults,
   else BOOTTIME; sequence-scoped clocks (64..127) need a ClockSnapshot on the
   same sequence; incremental clocks add each delta to the previous value.
4. Per track, begin/end slices are balanced (an end never closes nothing,
   nothing stays open at the end) and timestamps never go backwards in the
   order the events appear.
"""
from __future__ import annotations

import collections
import dataclasses

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

_BOOTTIME = pb.BUILTIN_CLOCK_BOOTTIME
_CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
_NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE


@dataclasses.dataclass(frozen=True, slots=True)
class Slice:
    """One complete slice as a viewer would show it (trace-time ns)."""

    track_uuid: int
    name: str
    start_ns: int
    dur_ns: int
    depth: int
    args: dict


@dataclasses.dataclass(frozen=True, slots=True)
class TraceCheck:
    """What ``validate_trace`` found; ``ok`` when ``errors`` is empty."""

    packets: int
    errors: tuple[str, ...]
    tracks: dict[int, str]                 # uuid -> track (or process) name
    slices_by_kind: dict[str, int]         # first word of the track name, or "process"
    slices_by_track: dict[int, int]
    instants: int
    names: collections.Counter             # slice and instant names
    slices: tuple[Slice, ...] = ()         # only with collect_slices=True

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclasses.dataclass(slots=True)
class _Seq:
    cleared: bool = False
    default_clock: int = 0
    names: dict = dataclasses.field(default_factory=dict)
    ann_names: dict = dataclasses.field(default_factory=dict)
    ann_strings: dict = dataclasses.field(default_factory=dict)
    # clock id -> (incremental, unit ns, clock value, trace value at snapshot)
    clocks: dict = dataclasses.field(default_factory=dict)
    last: dict = dataclasses.field(default_factory=dict)  # incremental clock -> last value


def _kind_of(desc: pb.TrackDescriptor) -> str:
    if desc.HasField("process") and not desc.name:
        return "process"
    return (desc.name.split() or ["unnamed"])[0]


def _annotation(a: pb.DebugAnnotation, seq: _Seq, errors: list[str]) -> tuple[str, object]:
    name = a.name
    if a.HasField("name_iid"):
        name = seq.ann_names.get(a.name_iid)
        if name is None:
            errors.append(f"debug annotation name iid {a.name_iid} not interned")
    for field in ("bool_value", "uint_value", "int_value", "double_value", "string_value"):
        if a.HasField(field):
            return name, getattr(a, field)
    if a.HasField("string_value_iid"):
        value = seq.ann_strings.get(a.string_value_iid)
        if value is None:
            errors.append(f"debug annotation string iid {a.string_value_iid} not interned")
        return name, value
    if a.dict_entries:
        return name, dict(_annotation(d, seq, errors) for d in a.dict_entries)
    return name, [_annotation(v, seq, errors)[1] for v in a.array_values]


def validate_trace(data: bytes, *, collect_slices: bool = False, max_errors: int = 50) -> TraceCheck:
    """Parse ``data`` as a Perfetto Trace and check it (module docstring, 1–4)."""
    trace = pb.Trace()
    try:
        trace.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError; keep the reason
        return TraceCheck(0, (f"not a Trace proto: {exc}",), {}, {}, {}, 0, collections.Counter())
    errors: list[str] = []
    seqs: dict[int, _Seq] = collections.defaultdict(_Seq)
    descs: dict[int, pb.TrackDescriptor] = {}
    open_: dict[int, list] = collections.defaultdict(list)
    last_ts: dict[int, int] = {}
    by_track: collections.Counter = collections.Counter()
    names: collections.Counter = collections.Counter()
    slices: list[Slice] = []
    instants = 0

    def err(i: int, msg: str) -> None:
        errors.append(f"packet {i}: {msg}")

    for i, p in enumerate(trace.packet):
        if len(errors) >= max_errors:
            break
        seq = seqs[p.trusted_packet_sequence_id]
        if p.incremental_state_cleared or p.sequence_flags & _CLEARED:
            seqs[p.trusted_packet_sequence_id] = seq = _Seq(cleared=True)
        elif p.sequence_flags & _NEEDS and not seq.cleared:
            err(i, "needs incremental state before the sequence cleared it")
        if p.HasField("trace_packet_defaults"):
            seq.default_clock = p.trace_packet_defaults.timestamp_clock_id
        if p.HasField("interned_data"):
            d = p.interned_data
            seq.names.update((e.iid, e.name) for e in d.event_names)
            seq.ann_names.update((e.iid, e.name) for e in d.debug_annotation_names)
            seq.ann_strings.update((e.iid, e.str.decode("utf-8", "replace")) for e in d.debug_annotation_string_values)
        if p.HasField("clock_snapshot"):
            clocks = p.clock_snapshot.clocks
            boot = [c.timestamp for c in clocks if c.clock_id == _BOOTTIME]
            for c in clocks:
                unit = c.unit_multiplier_ns or 1
                seq.clocks[c.clock_id] = (c.is_incremental, unit, c.timestamp,
                                          boot[0] if boot else c.timestamp * unit)
                if c.is_incremental:
                    seq.last[c.clock_id] = c.timestamp
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.parent_uuid and d.parent_uuid not in descs:
                err(i, f"track {d.uuid} has undeclared parent {d.parent_uuid}")
            if d.uuid in descs and descs[d.uuid] != d:
                err(i, f"track {d.uuid} declared twice, differently")
            descs[d.uuid] = d
        if not p.HasField("track_event"):
            continue
        ev = p.track_event
        uuid = ev.track_uuid
        if uuid not in descs:
            err(i, f"event on undeclared track {uuid}")
            continue
        clock = p.timestamp_clock_id or seq.default_clock or _BOOTTIME
        ts = p.timestamp
        if clock != _BOOTTIME:
            spec = seq.clocks.get(clock)
            if spec is None:
                err(i, f"clock {clock} has no ClockSnapshot on sequence {p.trusted_packet_sequence_id}")
                continue
            incremental, unit, snap_value, snap_trace = spec
            if incremental:
                ts = seq.last[clock] = seq.last[clock] + ts
            ts = snap_trace + (ts - snap_value) * unit
        if ts < last_ts.get(uuid, ts):
            err(i, f"timestamp {ts} goes back on track {uuid} (last {last_ts[uuid]})")
        last_ts[uuid] = ts
        if ev.type in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_INSTANT):
            name = ev.name
            if ev.HasField("name_iid"):
                name = seq.names.get(ev.name_iid)
                if name is None:
                    err(i, f"event name iid {ev.name_iid} not interned")
                    name = ""
            if not name:
                err(i, "slice without a name")
            names[name] += 1
            if ev.type == pb.TrackEvent.TYPE_INSTANT:
                instants += 1
                continue
            args = dict(_annotation(a, seq, errors) for a in ev.debug_annotations) if collect_slices else {}
            open_[uuid].append((name, ts, args))
        elif ev.type == pb.TrackEvent.TYPE_SLICE_END:
            if not open_[uuid]:
                err(i, f"slice end with nothing open on track {uuid}")
                continue
            name, start, args = open_[uuid].pop()
            by_track[uuid] += 1
            if collect_slices:
                slices.append(Slice(uuid, name, start, ts - start, len(open_[uuid]), args))
    for uuid, stack in open_.items():
        if stack:
            errors.append(f"track {uuid}: {len(stack)} slices never ended")
    kinds: collections.Counter = collections.Counter()
    for uuid, n in by_track.items():
        kinds[_kind_of(descs[uuid])] += n
    tracks = {u: (d.name or d.process.process_name) for u, d in descs.items()}
    return TraceCheck(len(trace.packet), tuple(errors), tracks, dict(kinds), dict(by_track),
                      instants, names, tuple(slices))

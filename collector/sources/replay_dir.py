"""Replay directories: which file holds which rank, and the job's topology.

Implements the directory half of the replay contract (ARCHITECTURE.md, "Replay
contract"): a directory of ``rank-<N>.json`` / ``rank-<N>.json.gz`` files plus an
optional ``topology.json`` becomes a :class:`ReplayJob`, found without parsing
the files; ``replay`` loads each file into a :class:`RankTrace`.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import zlib
from pathlib import Path

from trainscope.collector.sources.replay import _GZIP_MAGIC, RANK_FILE_RE, RankTrace, load_rank_trace
from trainscope.proto.errors import ConfigError, TraceFileError
from trainscope.proto.model import (
    DEFAULT_ORDER, DIMS, NIC_ATTRIBUTE, SWITCH_ATTRIBUTE, ParallelCoords, Resource, coords_for_rank,
)


TOPOLOGY_FILE = "topology.json"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReplayTopology:
    """Parallel layout of a replayed job, as in ``topology.json``."""

    #: Number of ranks in the job.
    world_size: int
    #: Tensor-, pipeline-, expert- and context-parallel degrees; dp is the rest.
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    #: Rank order, fastest-varying dimension first (Megatron-LM).
    order: str = DEFAULT_ORDER
    #: Ranks per host (consecutive ranks share one: ``host<rank // ranks_per_host>``); 0: one host
    #: called "replay" for every rank (traces do not say where they ran).
    ranks_per_host: int = 0
    #: Consecutive ranks of a host sharing one NIC (``host3/nic1``); 0: NICs not known.
    ranks_per_nic: int = 0
    #: Consecutive hosts behind one network switch (``switch0``); 0: switches not known.
    hosts_per_switch: int = 0

    def __post_init__(self) -> None:
        for f in ("ranks_per_host", "ranks_per_nic", "hosts_per_switch"):
            v = getattr(self, f)
            if type(v) is not int or v < 0:
                raise ConfigError(f"topology.{f}", v, "must be an integer >= 0")
        if (self.ranks_per_nic or self.hosts_per_switch) and not self.ranks_per_host:
            raise ConfigError("topology.ranks_per_host", 0, "must be set when ranks_per_nic or hosts_per_switch is")
        if self.ranks_per_nic and self.ranks_per_host % self.ranks_per_nic:
            raise ConfigError("topology.ranks_per_nic", self.ranks_per_nic, "must divide ranks_per_host")
        for f in ("world_size", "tp", "pp", "ep", "cp"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ConfigError(f"topology.{f}", v, "must be a positive integer")
        if type(self.order) is not str or sorted(self.order.split("-")) != sorted(DIMS):
            raise ConfigError("topology.order", self.order, f"must be a permutation of {'-'.join(DIMS)}")
        model = self.tp * self.pp * self.ep * self.cp
        if self.world_size % model:
            raise ConfigError(
                "topology.world_size", self.world_size,
                f"must be a multiple of tp*pp*ep*cp = {model}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.ep * self.cp)

    @classmethod
    def from_json(cls, path: str | os.PathLike, *, world_size: int | None = None) -> "ReplayTopology":
        """Read and validate ``topology.json``; ``world_size`` fills a missing field.

        An extra ``dp`` field is accepted when it agrees with the others; any
        other unknown field is rejected, so a typo cannot silently be ignored.
        """
        path = str(path)
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except OSError as e:
            raise ConfigError("topology.json", path, f"cannot read: {e.strerror or e}") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError("topology.json", path, f"not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise ConfigError("topology.json", path, "must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in doc.items():
            if key not in known and key != "dp":
                raise ConfigError(f"topology.{key}", value, f"unknown field; expected some of {sorted(known)}")
        fields = {k: v for k, v in doc.items() if k in known}
        if "world_size" not in fields:
            if world_size is None:
                raise ConfigError("topology.world_size", None, "missing, and no rank files to infer it from")
            fields["world_size"] = world_size
        topo = cls(**fields)
        if "dp" in doc and doc["dp"] != topo.dp:
            raise ConfigError("topology.dp", doc["dp"], f"world_size/(tp*pp*ep*cp) is {topo.dp}")
        return topo

    def coords(self, rank: int) -> ParallelCoords:
        return coords_for_rank(
            rank, self.world_size, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, order=self.order)

    def host(self, rank: int) -> str:
        return f"host{rank // self.ranks_per_host}" if self.ranks_per_host else "replay"

    def shared(self, rank: int) -> dict[str, str]:
        """The NIC and switch ``rank`` shares with others (``Resource.attributes``), when known."""
        out = {}
        if self.ranks_per_nic:
            out[NIC_ATTRIBUTE] = f"{self.host(rank)}/nic{(rank % self.ranks_per_host) // self.ranks_per_nic}"
        if self.hosts_per_switch:
            out[SWITCH_ATTRIBUTE] = f"switch{rank // self.ranks_per_host // self.hosts_per_switch}"
        return out


@dataclasses.dataclass
class ReplayJob:
    """A replay directory: where each rank's file is, and the job's topology."""

    root: str
    job_id: str
    topology: ReplayTopology
    #: Rank -> trace file path.
    files: dict[int, str]
    #: ``distributedInfo`` when the files' own ranks are used, ``filename`` when
    #: they were missing or collided (e.g. copies of one rank's trace).
    rank_source: str = "distributedInfo"
    #: ``topology.json``, ``distributedInfo`` or ``file_count``.
    world_size_source: str = TOPOLOGY_FILE
    #: Decisions taken while scanning that a user may want to see.
    notes: list[str] = dataclasses.field(default_factory=list)

    def load(self, rank: int) -> RankTrace:
        """Load one rank's trace, with the rank this job assigned to it."""
        trace = load_rank_trace(self.files[rank], rank=rank, job_id=self.job_id)
        if trace.rank != rank:
            trace = dataclasses.replace(trace, rank=rank, rank_source="filename")
        return trace

    def load_all(self) -> list[RankTrace]:
        return [self.load(r) for r in sorted(self.files)]


def scan_replay_dir(path: str | os.PathLike) -> ReplayJob:
    """Find the rank files of a replay directory without parsing them.

    1. List ``rank-<N>.json[.gz]``; a rank named twice is an error.
    2. Peek at each file's head for ``distributedInfo`` (Kineto writes it before
       ``traceEvents``), so no big file is parsed twice.
    3. Ranks are the files' ``distributedInfo.rank`` when every file has one and
       they are distinct, else the file names' (copies of one trace share one
       ``distributedInfo.rank``).
    4. World size: ``topology.json``, else the larger of the peeked
       ``distributedInfo.world_size`` and the number of files.
    """
    root = Path(path)
    if not root.is_dir():
        raise TraceFileError(str(path), "not a directory (expected a folder of rank-<N>.json[.gz] files)")
    by_name: dict[int, str] = {}
    for entry in sorted(root.iterdir()):
        m = RANK_FILE_RE.match(entry.name)
        if not m or not entry.is_file():
            continue
        r = int(m.group(1))
        if r in by_name:
            raise TraceFileError(str(entry), f"rank {r} already comes from {by_name[r]}")
        by_name[r] = str(entry)
    if not by_name:
        raise TraceFileError(str(root), "no rank-<N>.json or rank-<N>.json.gz files")
    notes: list[str] = []
    peeks = {r: _peek_distributed_info(p) for r, p in by_name.items()}
    info_ranks = [pk[0] for pk in peeks.values()]
    if None not in info_ranks and len(set(info_ranks)) == len(info_ranks):
        files = {pk[0]: by_name[r] for r, pk in peeks.items()}
        rank_source = "distributedInfo"
    else:
        files = dict(by_name)
        rank_source = "filename"
        if any(x is not None for x in info_ranks):
            notes.append("distributedInfo ranks missing or repeated across files; using file-name ranks")
    worlds = [pk[1] for pk in peeks.values() if pk[1]]
    inferred = max(worlds + [len(files)])
    topo_path = root / TOPOLOGY_FILE
    if topo_path.exists():
        topology = ReplayTopology.from_json(topo_path, world_size=inferred)
        world_source = TOPOLOGY_FILE
        if worlds and max(worlds) != topology.world_size:
            notes.append(f"topology.json world_size {topology.world_size} overrides "
                         f"distributedInfo.world_size {max(worlds)}")
    else:
        topology = ReplayTopology(world_size=inferred)
        world_source = "distributedInfo" if worlds and max(worlds) >= len(files) else "file_count"
    bad = sorted(r for r in files if r >= topology.world_size)
    if bad:
        msg = f"rank {bad[0]} ({files[bad[0]]}) is not below world_size {topology.world_size}"
        if world_source == TOPOLOGY_FILE:
            raise ConfigError("topology.world_size", topology.world_size, msg)
        raise TraceFileError(str(root), msg + f" (from {world_source}); add a topology.json")
    job_id = root.resolve().name or "replay"
    return ReplayJob(root=str(root), job_id=job_id, topology=topology, files=files,
                     rank_source=rank_source, world_size_source=world_source, notes=notes)


_INFO_RE = re.compile(rb'"distributedInfo"\s*:\s*\{')
_INFO_FIELD_RE = re.compile(rb'"(rank|world_size)"\s*:\s*(\d+)')


def _peek_distributed_info(path: str, head: int = 1 << 16) -> tuple[int | None, int | None]:
    """(rank, world_size) from the first ``head`` bytes of a trace, or Nones.

    Reads only the scalar fields before any nested value of the block
    (Kineto writes ``rank`` and ``world_size`` first); never raises: the full
    load reports unreadable files properly.
    """
    try:
        with open(path, "rb") as f:
            text = f.read(head)
            if text[:2] == _GZIP_MAGIC:
                f.seek(0)
                with gzip.open(f) as g:
                    text = g.read(head)
    except (OSError, EOFError, zlib.error):
        return None, None
    m = _INFO_RE.search(text)
    if not m:
        return None, None
    block = text[m.end():]
    cut = min((i for i in (block.find(b"}"), block.find(b"["), block.find(b"{")) if i >= 0), default=len(block))
    found = {k.decode(): int(v) for k, v in _INFO_FIELD_RE.findall(block[:cut])}
    return found.get("rank"), found.get("world_size") or None


def resource_for(trace: RankTrace, job: ReplayJob, host: str | None = None) -> Resource:
    """The ``Resource`` that replayed batches of ``trace`` carry.

    ``local_rank`` and ``device`` come from the kernels' ``args.device`` (the
    GPU index on its host); coordinates and host from the job's topology.
    """
    dev = trace.kernels.device
    return Resource(
        job_id=job.job_id, rank=trace.rank, world_size=job.topology.world_size,
        host=host if host is not None else job.topology.host(trace.rank),
        pid=0, local_rank=dev, device=f"cuda:{dev}", coords=job.topology.coords(trace.rank),
        attributes={"source": "replay", "trace_path": trace.path, "rank_source": trace.rank_source,
                    **job.topology.shared(trace.rank)})

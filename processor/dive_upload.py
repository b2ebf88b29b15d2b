"""Deep-dive traces to object storage, one object per rank (issue #14 item 3; ARGUS §6.3 L4).

A rank's profiling window ends with a Kineto trace in its host's dive directory
(``<root>/<job>/<dive>/rank-<R>.json``, 0600, written by the collector off the
training thread). Without object storage a multi-host job's dive can be analysed
only where a shared file system holds every rank's trace. With a destination
URL (``--deep-dive-url``: any fsspec URL, ``file://``, ``s3://``, ``gs://``,
``memory://``, or a local directory) the processor of each host uploads its ranks'
traces there, and the analyzer of any host reads them back
(``analyzer/deepdive/results.py``).

Layout under the URL (``dive_prefix``: the job made one safe path component, as
``proto/env.deep_dive_trace_dir`` makes it)::

    <job>/<dive>/rank-<R>.json.gz          one rank's trace, gzipped (the reader detects gzip by magic)
    <job>/<dive>/rank-<R>.summary.json     its columnar summary (``control.summarize_trace``), when made
    <job>/<dive>/manifest-<host tag>.json  one per processor: its ranks' reports and their objects

Steps (:class:`DiveUploader`; one worker thread per processor, fed by ``ControlHub``):
1. A rank reports its window done (``Report`` on the control path): the hub queues
   its trace (only a regular file directly in the dive's directory, as for the
   summary); the summarizer queues the summary once written. The queue is bounded
   (``max_pending``); beyond it an upload is dropped and counted. The training
   process never uploads: its only work was writing the local file.
2. The worker checks the size cap (``max_bytes``, on the local file before reading
   it: a larger one is not uploaded, counted ``too_large``), gzips the trace, and
   writes the object (a local ``file://`` destination through ``write_private``:
   0600, whole or absent; an object store publishes a whole object at once).
3. A failed write is retried ``retries`` times, ``backoff_s`` doubled each time;
   then counted ``failed`` and named in the manifest. Every outcome is counted
   (``trainscope_processor_deep_dive_uploads_total{what,outcome}``, bytes in
   ``..._deep_dive_upload_bytes_total{what}``, retries in ``..._deep_dive_upload_retries_total{what}``).
4. After each object, and whenever the hub's manifest changes, this processor's
   manifest object is rewritten: the hub's ``manifest.json`` plus ``objects`` (per
   rank: key, state, bytes), with ``complete`` true only once the dive is complete
   on this host *and* none of its uploads is pending. The reader merges the
   manifests of one dive (one per host) and analyses it when all say complete.
5. ``keep_local=False`` removes the local trace once its object is written (only a
   file this dive's directory holds under the name its report gave, that this
   processor created the directory of in this run; never anything else).

Security: credentials come only from the environment or fsspec's config (a URL
with ``user:password@`` is refused), URLs are logged without user information,
and the manifest names objects by their key under the URL, not by the URL: each
reader joins the key to its own configured URL.
"""
from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import logging
import os
import re
import socket
import stat
import threading
import time
from typing import Callable, Iterable, Iterator

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from prometheus_client.core import CounterMetricFamily, Metric

from trainscope.proto.errors import ConfigError, redact_url
from trainscope.proto.securefs import write_private

log = logging.getLogger(__name__)

TRACE_SUFFIX = ".json.gz"
MANIFEST_PREFIX = "manifest-"
#: What is uploaded (a bounded label set) and how each upload ended.
WHATS = ("trace", "summary", "manifest")
OUTCOMES = ("ok", "failed", "too_large", "dropped", "missing")


def check_url(url: object, setting: str = "deep_dive.url") -> str:
    """``url`` if it names a usable fsspec destination, else a ``ConfigError`` naming ``setting``.

    Refused: empty, an unknown protocol, user information with a password (credentials come
    from the environment or fsspec's config, never from a URL that ends up in logs and ps).
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(setting, url, "must be a directory path or an fsspec URL (file://, s3://, gs://, memory://)")
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol is not None and protocol not in fsspec.available_protocols() and protocol not in fsspec.registry:
        raise ConfigError(setting, url, f"unknown fsspec protocol {protocol!r}")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]*:[^/@\s]*@", url):
        raise ConfigError(setting, url, "credentials in the URL: give them in the environment or fsspec's "
                                        "config (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, ~/.config/fsspec)")
    try:
        url_to_fs(url)
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigError(setting, url, f"no usable filesystem: {str(exc).splitlines()[0][:120]}") from None
    return url


def open_fs(url: str, setting: str = "deep_dive.url"):
    """``(filesystem, root without a trailing slash)`` of a checked URL."""
    check_url(url, setting)
    fs, root = url_to_fs(url)
    return fs, root.rstrip("/")


def job_component(job_id: str) -> str:
    """The job as one safe path component (the rule of ``proto/env.deep_dive_trace_dir``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:64].lstrip(".") or "job"


def dive_prefix(job_id: str, dive_id: str) -> str:
    """Key prefix of one dive's objects under the URL: ``<job>/<dive>``."""
    return f"{job_component(job_id)}/{dive_id}"


def trace_key(job_id: str, dive_id: str, rank: int) -> str:
    return f"{dive_prefix(job_id, dive_id)}/rank-{rank}{TRACE_SUFFIX}"


def summary_key(job_id: str, dive_id: str, rank: int) -> str:
    return f"{dive_prefix(job_id, dive_id)}/rank-{rank}.summary.json"


def manifest_key(job_id: str, dive_id: str, tag: str) -> str:
    return f"{dive_prefix(job_id, dive_id)}/{MANIFEST_PREFIX}{tag}.json"


def object_url(url: str, key: str) -> str:
    """The URL of ``key`` under ``url``, shown to people (user information removed)."""
    return redact_url(url.rstrip("/") + "/" + key)


def default_host_tag() -> str:
    """This processor's name in its manifest object: host name and process id (two processors of one
    host, or a restarted one, never write each other's manifest)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:48].lstrip(".") or "host"
    return f"{host}-{os.getpid()}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DiveUploadConfig:
    url: str
    """Destination: a local directory or an fsspec URL (``s3://bucket/dives``, ``file:///srv/dives``)."""
    max_bytes: int = 256 << 20
    """Largest local trace uploaded (bytes, before gzip); a larger one stays local, counted ``too_large``."""
    retries: int = 3
    """Attempts after the first failed write of one object."""
    backoff_s: float = 0.5
    """Wait before the first retry, doubled for each next one."""
    keep_local: bool = True
    """False: remove the local trace once its object is written (see step 5)."""
    max_pending: int = 256
    """Uploads queued at most; beyond it one is dropped and counted ``dropped``."""
    compress_level: int = 5
    """gzip level of traces (5: a 5 MB Kineto JSON in ~0.1 s, ~10x smaller)."""
    host_tag: str = dataclasses.field(default_factory=default_host_tag)
    """This processor's manifest is ``manifest-<host_tag>.json``."""

    def __post_init__(self) -> None:
        check_url(self.url)
        for name, low in (("max_bytes", 1), ("retries", 0), ("max_pending", 1), ("compress_level", 0)):
            v = getattr(self, name)
            if type(v) is not int or v < low:
                raise ConfigError(f"deep_dive.{name}", v, f"must be an integer >= {low}")
        if self.compress_level > 9:
            raise ConfigError("deep_dive.compress_level", self.compress_level, "must be 0-9")
        if not (isinstance(self.backoff_s, (int, float)) and self.backoff_s >= 0):
            raise ConfigError("deep_dive.backoff_s", self.backoff_s, "must be >= 0")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.host_tag or ""):
            raise ConfigError("deep_dive.host_tag", self.host_tag, "must be 1-64 of [A-Za-z0-9_.-]")


@dataclasses.dataclass(slots=True)
class _Item:
    what: str               # trace | summary | manifest
    job: str
    dive: str
    rank: int = -1
    path: str = ""          # local file (trace, summary)
    directory: str = ""     # the dive's local directory (trace: removal is allowed only inside it)


class UploadMetrics:
    """Scrape-time families over the uploader's counts (bounded labels: ``WHATS`` x ``OUTCOMES``),
    named like ``processor/selfmetrics.py``'s: ``trainscope_processor_<name>_total``."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter = collections.Counter()   # (what, outcome)
        self.bytes: collections.Counter = collections.Counter()      # what
        self.retries: collections.Counter = collections.Counter()    # what
        self._lock = threading.Lock()

    def count(self, what: str, outcome: str, n_bytes: int = 0) -> None:
        with self._lock:
            self.outcomes[(what, outcome)] += 1
            if n_bytes:
                self.bytes[what] += n_bytes

    def retried(self, what: str) -> None:
        with self._lock:
            self.retries[what] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            outcomes, sizes, retries = dict(self.outcomes), dict(self.bytes), dict(self.retries)
        fam = CounterMetricFamily("trainscope_processor_deep_dive_uploads",
                                  "Deep-dive objects written to object storage, by what (trace, summary, manifest) "
                                  "and outcome (ok; failed: after the retries; too_large: over the size cap, kept "
                                  "local; dropped: upload queue full; missing: the local file was gone)",
                                  labels=["what", "outcome"])
        for w in WHATS:
            for o in OUTCOMES:
                fam.add_metric([w, o], float(outcomes.get((w, o), 0)))
        yield fam
        fam = CounterMetricFamily("trainscope_processor_deep_dive_upload_bytes",
                                  "Bytes written to object storage for deep dives (after gzip), by what",
                                  labels=["what"])
        for w in WHATS:
            fam.add_metric([w], float(sizes.get(w, 0)))
        yield fam
        fam = CounterMetricFamily("trainscope_processor_deep_dive_upload_retries",
                                  "Deep-dive object writes retried after an error, by what", labels=["what"])
        for w in WHATS:
            fam.add_metric([w], float(retries.get(w, 0)))
        yield fam

    def describe(self) -> Iterable[Metric]:
        return []


class DiveUploader:
    """Steps 1-5 on one worker thread. Thread-safe; never raises into its callers."""

    def __init__(self, config: DiveUploadConfig, *, sleep: Callable[[float], None] | None = None) -> None:
        self.config = config
        self.metrics = UploadMetrics()
        self._fs, self._root = open_fs(config.url)
        self._local = isinstance(self._fs, LocalFileSystem)
        self._manifest_of: Callable[[str], dict | None] = lambda dive: None
        self._on_change: Callable[[str], None] | None = None
        self._queue: collections.deque[_Item] = collections.deque()
        self._manifests_queued: set[tuple[str, str]] = set()
        self._pending: collections.Counter = collections.Counter()   # dive -> trace/summary uploads not settled
        self._objects: dict[str, dict[str, dict]] = {}               # dive -> rank -> {what: state}
        self._cv = threading.Condition()
        self._busy = self._closed = False
        self._stop = threading.Event()
        self._sleep = sleep or (lambda s: self._stop.wait(s))
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------- the hub's side
    def bind(self, manifest_of: Callable[[str], dict | None],
             on_change: Callable[[str], None] | None = None) -> None:
        """``manifest_of(dive_id)``: the hub's current manifest document of a dive (None: forgotten);
        ``on_change(dive_id)``: called after each object settles (the hub rewrites its local manifest,
        which queues this processor's manifest object)."""
        self._manifest_of = manifest_of
        self._on_change = on_change

    def upload(self, job: str, dive: str, rank: int, path: str, what: str = "trace", directory: str = "") -> None:
        """Step 1: queue one rank's local file (``what``: trace or summary)."""
        item = _Item(what, job, dive, rank, path, directory or os.path.dirname(path))
        with self._cv:
            if self._closed or len(self._queue) >= self.config.max_pending:
                self.metrics.count(what, "dropped")
                self._state(dive, rank, what, {"state": "dropped"})
                log.warning("deep dive %s rank %d: %s not uploaded (upload queue full)", dive, rank, what)
                return
            self._pending[dive] += 1
            key = (trace_key if what == "trace" else summary_key)(job, dive, rank)
            self._state(dive, rank, what, {"key": key, "url": self.url_of(key), "state": "pending"})
            self._queue.append(item)
            self._ensure_worker()
            self._cv.notify_all()
        self.manifest(job, dive)

    def manifest(self, job: str, dive: str) -> None:
        """Step 4: (re)write this processor's manifest object of a dive, once per change (coalesced)."""
        with self._cv:
            if self._closed or (job, dive) in self._manifests_queued:
                return
            if len(self._queue) >= self.config.max_pending:
                self.metrics.count("manifest", "dropped")
                return
            self._manifests_queued.add((job, dive))
            self._queue.append(_Item("manifest", job, dive))
            self._ensure_worker()
            self._cv.notify_all()

    def objects(self, dive: str) -> dict[str, dict]:
        """rank (str) -> {what: {"key", "url", "state", "bytes", "detail"}} of one dive (copies)."""
        with self._cv:
            return {r: {w: dict(s) for w, s in v.items()} for r, v in self._objects.get(dive, {}).items()}

    def pending(self, dive: str) -> int:
        with self._cv:
            return self._pending.get(dive, 0)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the queue is empty and the worker idle (bounded); True when it is."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._worker is None or not self._worker.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        self._stop.set()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=timeout_s)

    def url_of(self, key: str) -> str:
        return object_url(self.config.url, key)

    # ------------------------------------------------------------------ worker
    def _state(self, dive: str, rank: int, what: str, state: dict) -> None:
        """Under ``_cv``: one object's state in the dive's table (bounded by the hub's ``max_dives``)."""
        if dive not in self._objects and len(self._objects) >= 1024:
            self._objects.pop(next(iter(self._objects)))
        self._objects.setdefault(dive, {}).setdefault(str(rank), {})[what] = state

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="deep-dive-upload", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                if item.what == "manifest":
                    self._manifests_queued.discard((item.job, item.dive))
                self._busy = True
            try:
                if item.what == "manifest":
                    self._write_manifest(item)
                else:
                    self._upload_file(item)
            except Exception:  # a bug must not end the worker: counted, logged
                log.exception("deep dive %s: upload of %s failed", item.dive, item.what)
                self.metrics.count(item.what, "failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _put(self, key: str, data: bytes, what: str) -> str | None:
        """Step 3: write one object with bounded retries; None when written, else the last error (one line)."""
        path = f"{self._root}/{key}"
        err = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.metrics.retried(what)
                self._sleep(self.config.backoff_s * 2 ** (attempt - 1))
            try:
                if self._local:  # mkstemp + rename: 0600, never half a file, no planted link followed
                    self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                    write_private(path, data)
                else:
                    self._fs.pipe_file(path, data)
                return None
            except Exception as exc:  # fsspec backends raise many types
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                log.warning("deep dive: cannot write %s (attempt %d of %d): %s", self.url_of(key), attempt + 1,
                            self.config.retries + 1, redact_url(err))
        return redact_url(err or "unknown error")

    def _upload_file(self, item: _Item) -> None:
        cfg = self.config
        key = (trace_key if item.what == "trace" else summary_key)(item.job, item.dive, item.rank)
        state = {"key": key, "url": self.url_of(key), "state": "failed", "bytes": 0}
        try:
            try:
                fd = os.open(item.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except OSError as e:
                state.update(state="missing", detail=f"local file unreadable: {e.strerror}")
                self.metrics.count(item.what, "missing")
                return
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    state.update(state="missing", detail="not a regular file")
                    self.metrics.count(item.what, "missing")
                    return
                if st.st_size > cfg.max_bytes:   # step 2: the cap, before reading anything
                    state.update(state="too_large", local_bytes=st.st_size,
                                 detail=f"{st.st_size} B over the upload cap of {cfg.max_bytes} B: kept local")
                    self.metrics.count(item.what, "too_large")
                    return
                data = f.read(cfg.max_bytes + 1)
            if item.what == "trace":
                data = gzip.compress(data, compresslevel=cfg.compress_level, mtime=0)
            err = self._put(key, data, item.what)
            if err is not None:
                state["detail"] = err
                self.metrics.count(item.what, "failed")
                return
            state.update(state="uploaded", bytes=len(data), local_bytes=st.st_size)
            self.metrics.count(item.what, "ok", len(data))
            if item.what == "trace" and not cfg.keep_local:
                state["local"] = self._remove_local(item)
        finally:
            with self._cv:
                self._state(item.dive, item.rank, item.what, state)
                self._pending[item.dive] -= 1
                if self._pending[item.dive] <= 0:
                    del self._pending[item.dive]
            if self._on_change is not None:
                self._on_change(item.dive)
            else:
                self.manifest(item.job, item.dive)

    def _remove_local(self, item: _Item) -> str:
        """Step 5: the local trace removed, only as the dive's own ``rank-<R>.json`` (no link, our uid)."""
        p = item.path
        try:
            st = os.lstat(p)
            if (os.path.realpath(os.path.dirname(p)) != os.path.realpath(item.directory)
                    or os.path.basename(p) != f"rank-{item.rank}.json" or not stat.S_ISREG(st.st_mode)
                    or st.st_uid != os.geteuid()):
                return "kept (not the dive's own trace file)"
            os.unlink(p)
            return "removed"
        except OSError as e:
            return f"kept ({e.strerror})"

    def _write_manifest(self, item: _Item) -> None:
        doc = self._manifest_of(item.dive)
        if doc is None:
            return
        doc = dict(doc)
        with self._cv:
            pending = self._pending.get(item.dive, 0)
            doc["objects"] = {r: {w: dict(s) for w, s in v.items()} for r, v in self._objects.get(item.dive, {}).items()}
        doc["host_tag"] = self.config.host_tag
        doc["uploads_pending"] = pending
        doc["complete"] = bool(doc.get("complete")) and pending == 0
        data = json.dumps(doc, indent=1).encode()
        key = manifest_key(item.job, item.dive, self.config.host_tag)
        err = self._put(key, data, "manifest")
        self.metrics.count("manifest", "ok" if err is None else "failed", len(data) if err is None else 0)


__all__ = ["DiveUploadConfig", "DiveUploader", "MANIFEST_PREFIX", "TRACE_SUFFIX", "UploadMetrics", "check_url",
           "dive_prefix", "job_component", "manifest_key", "object_url", "open_fs", "summary_key", "trace_key"]

"""Fixtures for a real Prometheus server on 127.0.0.1 (integration tier).

``PrometheusServer`` runs the ``prometheus`` binary with a config and TSDB in
a temporary directory, scraping the given targets every second and accepting
remote write (``--web.enable-remote-write-receiver``). Start-up is awaited by
polling ``/-/ready`` under a timeout; the process is always stopped (SIGTERM,
then SIGKILL) by the fixture, also when a test fails.

The scrape job sets ``honor_labels: true``: trainscope's series carry the
training job in their own ``job`` label, which Prometheus would otherwise
rename to ``exported_job``.

``synthetic_output`` and ``Clock`` build the processor output that the
Prometheus tests (unit and integration) export.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Sequence

import pytest

from support.ports import free_port
from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2, telemetry_pb2

INSTALL_HINT = (
    "Prometheus is not installed: integration tests that need a real Prometheus "
    "are skipped. Install it with `apt-get install -y prometheus` (Debian/Ubuntu) "
    "or point PROMETHEUS_BIN at a prometheus binary."
)


MS = 1_000_000


def synthetic_output(
    rank: int,
    *,
    job: str = "j",
    window: int = 0,
    iter_ms: float | None = 100.0,
    phases: dict[str, float] | None = None,
    kernels: dict[str, int] | None = None,
    world: int = 4,
) -> WindowOutput:
    """One rank's closed window as the summariser would hand it to the sinks.

    Four iterations of ``iter_ms`` (max 1.5x), each phase of ``phases``
    ({name: mean ms}) run 4 times (p99 1.2x, max 1.3x), kernel summaries
    ``kernels`` ({name: count}); host ``node<rank // 2>``, tp=2 coordinates.
    """
    res = Resource(job_id=job, rank=rank, world_size=world,
                   host=f"node{rank // 2}", coords=coords_for_rank(rank, world, tp=2))
    res_pb = res.to_pb()
    start = window * 10_000 * MS
    win = records_pb2.Window(index=window, start_ns=start, end_ns=start + 10_000 * MS)
    it = ph = kw = None
    if iter_ms is not None:
        d = int(iter_ms * MS)
        marks = [telemetry_pb2.IterationMark(iteration=window * 4 + i, start_ns=start + i * d,
                                             end_ns=start + (i + 1) * d) for i in range(4)]
        it = records_pb2.IterationWindow(resource=res_pb, window=win, marks=marks,
                                         mean_ns=d, p50_ns=d, max_ns=d * 1.5)
    if phases:
        ph = records_pb2.PhaseWindow(resource=res_pb, window=win, phases=[
            records_pb2.PhaseStats(phase=name, count=4, mean_ns=ms * MS, p50_ns=ms * MS,
                                   p99_ns=ms * 1.2 * MS, max_ns=ms * 1.3 * MS,
                                   total_ns=4 * ms * MS)
            for name, ms in phases.items()])
    if kernels:
        kw = records_pb2.KernelWindow(
            resource=res_pb, window=win, events=sum(kernels.values()),
            kernels=[records_pb2.KernelStats(kernel=k, stream=7, count=n)
                     for k, n in kernels.items()])
    raw = ClosedWindow(resource=res, window=win, kernels=KernelColumns.empty())
    return WindowOutput(raw=raw, iterations=it, phases=ph, kernels=kw)


class Clock:
    """A settable monotonic clock (``clock.t += 60``) for expiry tests."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def find_prometheus() -> str | None:
    """``$PROMETHEUS_BIN``, else ``prometheus`` on PATH, else /usr/bin/prometheus."""
    env = os.environ.get("PROMETHEUS_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


class PrometheusServer:
    """One Prometheus process; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        binary: str,
        workdir: pathlib.Path,
        targets: Sequence[str] = (),
        *,
        scrape_interval_s: float = 1.0,
        job_name: str = "trainscope",
    ) -> None:
        self.binary = binary
        self.workdir = pathlib.Path(workdir)
        self.targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self.job_name = job_name
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def remote_write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def _write_config(self) -> pathlib.Path:
        # JSON is YAML: no YAML library needed to write the config.
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{
                "job_name": self.job_name,
                "honor_labels": True,
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": self.targets}],
            }] if self.targets else [],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))
        return path

    def start(self, timeout_s: float = 30.0) -> "PrometheusServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        # A free port can be taken between probe and bind; try a few.
        for _ in range(3):
            self.port = free_port()
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    [
                        self.binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={self.workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--web.enable-remote-write-receiver",
                        "--log.level=warn",
                    ],
                    stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                )
            finally:
                log.close()
            if self._wait_ready(timeout_s):
                return self
            self.stop()
            if "address already in use" not in self.log_tail():
                break
        raise RuntimeError(f"Prometheus did not become ready:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP API ---------------------------------------------------------
    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; returns ``data`` or raises with Prometheus' error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10.0) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus API {path} failed: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query at now; the ``result`` list (``metric`` + ``value``)."""
        return self.api("query", query=promql)["result"]

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[dict]], bool] = bool,
        timeout_s: float = 20.0,
        poll_s: float = 0.2,
    ) -> list[dict]:
        """Poll ``query(promql)`` until ``predicate(result)``; fail with the last result."""
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() >= deadline:
                targets = [(t["scrapeUrl"], t["health"], t["lastError"])
                           for t in self.api("targets").get("activeTargets", [])]
                raise AssertionError(
                    f"timed out after {timeout_s}s waiting on {promql!r}: last result "
                    f"{result}; targets {targets}"
                    f"\nlog:\n{self.log_tail()}"
                )
            time.sleep(poll_s)


_missing: list[str] = []  # tests skipped for want of the binary


@pytest.fixture(scope="session")
def prometheus_bin(request) -> str:
    """Path of the prometheus binary, or a loud skip saying how to install it."""
    path = find_prometheus()
    if path is None:
        _missing.append(request.node.nodeid)
        pytest.skip(INSTALL_HINT)
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    """Say so at the end of the run, not only in ``-rs``: a skipped tier is easy to miss."""
    if _missing:
        terminalreporter.section("Prometheus not installed", yellow=True, bold=True)
        terminalreporter.line(INSTALL_HINT, yellow=True)


@pytest.fixture
def prometheus_server(prometheus_bin, tmp_path_factory):
    """Factory: ``prometheus_server(["127.0.0.1:PORT"])`` starts a scraping server.

    Every server started by the factory is stopped at teardown.
    """
    started: list[PrometheusServer] = []

    def start(targets: Sequence[str] = (), **kwargs) -> PrometheusServer:
        workdir = tmp_path_factory.mktemp("prometheus")
        server = PrometheusServer(prometheus_bin, workdir, targets, **kwargs)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()

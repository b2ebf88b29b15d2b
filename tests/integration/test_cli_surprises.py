"""Issue #12 item 4, "a CLI that never surprises": each command tried as a new user would.

Real processes (`python -m trainscope.deploy.cli`), real sockets on 127.0.0.1 and
unix paths under tmp_path. Every wrong input must give exit 2 and one line on
stderr, never a traceback; nothing the run did not create is deleted.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


CLI = [sys.executable, "-m", "trainscope.deploy.cli"]


def _env(tmp_path, **extra) -> dict:
    """The user's environment without trainscope's settings; a private TMPDIR (the default socket's
    directory and every temporary directory the run makes, checked to be left empty)."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("TRAINSCOPE_") and k not in ("KAFKA_BOOTSTRAP", "XDG_RUNTIME_DIR")}
    e.update(TMPDIR=str(tmp_path / "tmp"), **extra)
    os.makedirs(e["TMPDIR"], exist_ok=True)
    return e


def cli(tmp_path, *args, timeout=120, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), cwd=tmp_path, env=_env(tmp_path, **extra), capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_exit_2(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]  # gRPC's C-core log lines included
    assert "Traceback" not in res.stderr, res.stderr
    assert len(lines) == 1 and lines[0].startswith("trainscope"), res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


class Daemon:
    """A daemon subprocess whose stdout is read until a line says it is up."""

    def __init__(self, tmp_path, *args, ready="listening on", **extra) -> None:
        self.p = subprocess.Popen(CLI + list(args), cwd=tmp_path, env=_env(tmp_path, **extra),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            self.out.append(line)
            if ready in line:
                return
        self.p.kill()
        raise AssertionError(f"not started: {self.out} {self.p.stderr.read()}")

    def stop(self, timeout=60) -> tuple[int, str]:
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise
        return rc, self.p.stderr.read()


@pytest.mark.parametrize("args", [(), ("--kafka-bootstrap", "127.0.0.1:1")], ids=["bare", "readme-kafka"])
def test_processor_starts_with_defaults_only(tmp_path, args):
    """`trainscope processor` exactly as the README shows it (no --listen) starts, listens on the
    documented default socket, and stops cleanly on SIGTERM (it died with an AttributeError)."""
    d = Daemon(tmp_path, "processor", *args)
    out = "".join(d.out)
    assert "listening on unix://" in out and out.strip().endswith("processor.sock"), out  # the documented default
    rc, err = d.stop()
    assert rc == 0, err
    assert "Traceback" not in err
    assert os.path.exists(tmp_path / ".trainscope" / "store.sqlite")


def test_analyzer_starts_with_defaults_only(tmp_path):
    """`trainscope analyzer` with no flags tails the default home's store once a processor made one."""
    sock = f"unix://{tmp_path}/p.sock"
    proc = Daemon(tmp_path, "processor", "--listen", sock)
    try:
        an = Daemon(tmp_path, "analyzer", ready="trainscope analyzer reading")
        assert "store.sqlite" in "".join(an.out)
        rc, err = an.stop()
        assert rc == 0 and "Traceback" not in err, err
    finally:
        proc.stop()


def test_second_processor_on_a_live_socket_refuses(tmp_path):
    sock = f"unix://{tmp_path}/p.sock"
    first = Daemon(tmp_path, "processor", "--listen", sock, "--home", str(tmp_path / "a"))
    try:
        res = cli(tmp_path, "processor", "--listen", sock, "--home", str(tmp_path / "b"), timeout=60)
        assert_one_line_exit_2(res, "another processor is listening")
        assert os.path.exists(tmp_path / "p.sock")  # the live one keeps its socket
        assert first.p.poll() is None
    finally:
        rc, _ = first.stop()
    assert rc == 0
    # a stale socket (nobody answers) is still taken over
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    d = Daemon(tmp_path, "processor", "--listen", f"unix://{tmp_path}/stale.sock")
    assert d.stop()[0] == 0


@pytest.fixture
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_taken_prometheus_port_is_one_line(tmp_path, taken_port):
    res = cli(tmp_path, "processor", "--listen", f"unix://{tmp_path}/p.sock", "--prometheus-port",
              str(taken_port), timeout=60)
    assert_one_line_exit_2(res, "--prometheus-port", "in use")
    store = tmp_path / "s.sqlite"
    from trainscope.processor.store import SqliteStore
    SqliteStore(str(store)).close()  # a processor's (empty) store
    res = cli(tmp_path, "analyzer", "--store", str(store), "--prometheus-port", str(taken_port), timeout=60)
    assert_one_line_exit_2(res, "--prometheus-port", "in use")


@pytest.mark.parametrize("listen", ["taken", "127.0.0.1:notaport", "nonsense", "unix:///proc/1/nope/p.sock",
                                    "127.0.0.1:99999", "127.0.0.1:-5", ":50051"])
def test_bad_listen_is_one_line(tmp_path, taken_port, listen):
    listen = f"127.0.0.1:{taken_port}" if listen == "taken" else listen
    res = cli(tmp_path, "processor", "--listen", listen, timeout=60)
    assert_one_line_exit_2(res, "processor.listen")


def test_demo_on_an_unwritable_home_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    res = cli(tmp_path, "demo", "--home", str(tmp_path / "file" / "home"))
    assert_one_line_exit_2(res, "--home")


def test_run_of_a_missing_command_is_one_line(tmp_path):
    res = cli(tmp_path, "run", "--no-processor", "--", "nosuchcmd-trainscope", "--flag")
    assert_one_line_exit_2(res, "nosuchcmd-trainscope", "not found")


def test_query_on_a_file_that_is_not_a_store(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("my notes\n")
    res = cli(tmp_path, "query", "jobs", "--store", str(f))
    assert_one_line_exit_2(res, "not a trainscope store")
    assert f.read_text() == "my notes\n"  # opened for nothing, written never


SIM = ("sim", "--ranks", "8", "--tp", "2", "--iterations", "4", "--no-analyze")


def test_sim_never_replaces_an_earlier_store_unasked(tmp_path):
    """The store in HOME may be a real job's (run and processor share the default home):
    sim refuses to touch it, says how to go on, and replaces it only with --force."""
    home = tmp_path / ".trainscope"
    home.mkdir()
    (home / "store.sqlite").write_bytes(b"a real job's data")
    res = cli(tmp_path, *SIM)
    assert_one_line_exit_2(res, "store.sqlite", "--force")
    assert (home / "store.sqlite").read_bytes() == b"a real job's data"
    res = cli(tmp_path, *SIM, "--force")
    assert res.returncode == 0, res.stderr
    assert (home / "store.sqlite").read_bytes()[:16] == b"SQLite format 3\x00"
    assert not os.listdir(tmp_path / "tmp"), "the private socket directory was left behind"


@pytest.fixture(scope="module")
def sim_traces(tmp_path_factory):
    """One small simulated job's traces, read (never written) by the replay tests below: one sim, not one each."""
    base = tmp_path_factory.mktemp("sim-traces")
    traces = base / "traces"
    res = cli(base, *SIM, "--home", str(base / "h0"), "--traces-out", str(traces))
    assert res.returncode == 0, res.stderr
    assert os.listdir(traces) and not os.listdir(base / "tmp"), "sim left its private socket directory behind"
    return traces


def test_replay_never_replaces_an_earlier_store_unasked(tmp_path, sim_traces):
    traces = sim_traces
    home = tmp_path / "h1"
    home.mkdir()
    (home / "store.sqlite").write_bytes(b"precious")
    res = cli(tmp_path, "replay", str(traces), "--no-analyze", "--home", str(home))
    assert_one_line_exit_2(res, "store.sqlite")
    assert (home / "store.sqlite").read_bytes() == b"precious"
    res = cli(tmp_path, "replay", str(traces), "--no-analyze", "--home", str(tmp_path / "h2"))
    assert res.returncode == 0, res.stderr
    assert not os.listdir(tmp_path / "tmp")


def test_replay_to_an_unreachable_kafka_is_bounded_and_says_what_was_not_delivered(tmp_path, sim_traces):
    """`replay --kafka-bootstrap 127.0.0.1:1` hung ~6 min in the final flush and exited 0; later it
    took 57 s (final drain, pipeline stop and close each waited their own timeout: 15 + 30 + 10 s).
    Now the flushes share the sink's close timeout: it gives up once, saying how many records stay
    spooled, the run says how much was not delivered and exits 1, and the local store is kept.
    (The subprocess timeout only guards the hang.)"""
    res = cli(tmp_path, "replay", str(sim_traces), "--no-analyze", "--home", str(tmp_path / "h"),
              "--kafka-bootstrap", "127.0.0.1:1", timeout=180)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert "not delivered to Kafka 127.0.0.1:1" in res.stderr and "kafka-spool" in res.stderr
    gave_up = [ln for ln in res.stderr.splitlines() if "giving up" in ln]
    assert len(gave_up) == 1 and "records" in gave_up[0] and "stay in the spool" in gave_up[0], res.stderr
    assert os.listdir(tmp_path / "h" / "kafka-spool")
    assert "summarised into" in res.stdout and (tmp_path / "h" / "store.sqlite").stat().st_size > 0


def test_analyzer_on_an_unreachable_kafka_logs_a_few_lines_not_hundreds(tmp_path):
    """librdkafka printed ~190 raw `%3|...|FAIL|` lines in 10 s; now they go through logging, rate-limited.
    3 s are enough to tell: without the logger 74 lines (69 raw) came in 3 s, without the rate limit 142."""
    d = Daemon(tmp_path, "analyzer", "--kafka-bootstrap", "127.0.0.1:1", ready="trainscope analyzer reading")
    time.sleep(3)
    rc, err = d.stop()
    assert rc == 0, err
    assert not [ln for ln in err.splitlines() if ln.startswith("%")], err  # no raw librdkafka lines
    assert "Connection refused" in err  # still said, once
    assert len(err.splitlines()) < 20, err


def _foreign_db(path) -> bytes:
    """Someone else's SQLite database (rollback journal, one table of theirs); its bytes."""
    import sqlite3
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (t TEXT)")
    db.execute("INSERT INTO notes VALUES ('mine')")
    db.commit()
    db.close()
    return path.read_bytes()


@pytest.mark.parametrize("args", [("query", "jobs"), ("query", "verdict"), ("report", "-o", "r.html"),
                                  ("analyzer",)], ids=lambda a: "-".join(a))
def test_a_foreign_sqlite_database_is_refused_and_left_as_it_was(tmp_path, args):
    """query/report/analyzer --store other.sqlite switched it to WAL and added trainscope's tables."""
    other = tmp_path / "other.sqlite"
    before = _foreign_db(other)
    res = cli(tmp_path, *args, "--store", str(other), timeout=60)
    assert_one_line_exit_2(res, "not a trainscope store")
    assert other.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["other.sqlite", "tmp"]  # no -wal, -shm, report or home


@pytest.mark.parametrize("store", ["/etc/passwd", "dir"])
def test_analyzer_store_that_is_not_a_database_is_one_line(tmp_path, store):
    if store == "dir":
        store = str(tmp_path / "d")
        os.mkdir(store)
    res = cli(tmp_path, "analyzer", "--store", store, timeout=60)
    assert_one_line_exit_2(res, "--store")


def test_query_opens_a_real_store_read_only(tmp_path):
    """A trainscope store is answered from without a byte of the store file changed."""
    from trainscope.processor.store import SqliteStore
    store = tmp_path / "s.sqlite"
    SqliteStore(str(store)).close()
    before = store.read_bytes()
    res = cli(tmp_path, "query", "jobs", "--store", str(store), timeout=60)
    assert res.returncode == 1 and "no jobs yet" in res.stderr, res.stderr  # no data yet: exit 1
    assert store.read_bytes() == before


@pytest.mark.parametrize("target", ["garbage", "127.0.0.1:99999", "127.0.0.1:-1", "unix://"])
def test_sim_to_a_malformed_processor_address_is_one_line(tmp_path, target):
    res = cli(tmp_path, *SIM, "--processor", target, timeout=60)
    assert_one_line_exit_2(res, "--processor")
    assert not os.path.exists(tmp_path / ".trainscope")  # refused before the home was made


def test_sim_to_a_processor_nobody_runs_exits_1_at_once(tmp_path):
    """`sim --processor 127.0.0.1:1` retried until the exporter's 300 s shutdown timeout."""
    t0 = time.monotonic()
    res = cli(tmp_path, *SIM, "--processor", "127.0.0.1:1", timeout=60)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert "no processor answers at 127.0.0.1:1" in res.stderr and "nothing was sent" in res.stderr
    assert time.monotonic() - t0 < 30


def test_sim_final_flush_to_a_processor_that_never_answers_is_bounded():
    """A listener that accepts connections but never speaks gRPC (a processor gone mid-run): the
    final flush gives up at its bound, and what was not confirmed is counted as dropped."""
    import threading

    from support.sim_homes import sim_home
    from trainscope.collector.sim import run_sim, sim_config

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(16)], daemon=True).start()
    try:
        t0 = time.monotonic()
        res = run_sim(sim_config(ranks=8, tp=2, iterations=2, home=sim_home()), f"127.0.0.1:{srv.getsockname()[1]}",
                      final_flush_s=1.0)
        assert time.monotonic() - t0 < 20
        assert res.dropped > 0 and res.exporter["dropped"].get("shutdown", 0) > 0, res.exporter
    finally:
        srv.close()


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_analyzer_prometheus_port_out_of_range_is_one_line(tmp_path, port):
    from trainscope.processor.store import SqliteStore
    SqliteStore(str(tmp_path / "s.sqlite")).close()
    res = cli(tmp_path, "analyzer", "--store", str(tmp_path / "s.sqlite"), "--prometheus-port", port, timeout=60)
    assert_one_line_exit_2(res, "--prometheus-port", "0..65535")


def _run_dirs(tmp_path) -> list[str]:
    return [n for n in os.listdir(tmp_path / "tmp") if n.startswith("trainscope-run-")]


@pytest.mark.parametrize("args,words", [
    (("--run-dir", "/proc/x"), ("--run-dir",)),
    (("--processor", "garbage"), ("--processor",)),
    (("--processor", "127.0.0.1:99999"), ("--processor", "1..65535")),
], ids=["run-dir", "processor-garbage", "processor-port"])
def test_run_with_a_bad_setting_is_one_line_and_leaves_no_temporary_directory(tmp_path, args, words):
    res = cli(tmp_path, "run", *args, "--", "true", timeout=60)
    assert_one_line_exit_2(res, *words)
    assert not _run_dirs(tmp_path)


def test_run_whose_processor_cannot_start_leaves_no_temporary_directory(tmp_path):
    """start_processor raised before the clean-up's try: $TMPDIR/trainscope-run-XXXX stayed."""
    (tmp_path / "file").write_text("x")
    res = cli(tmp_path, "run", "--processor", f"unix://{tmp_path}/p.sock", "--home", str(tmp_path / "file" / "h"),
              "--", "true", timeout=90)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert not _run_dirs(tmp_path)


def test_sim_outputs_are_checked_before_the_run(tmp_path):
    """--traces-out /proc/x failed with a traceback after the simulation; a non-empty directory was
    written into; --ground-truth and --json replaced files without --force."""
    res = cli(tmp_path, *SIM, "--traces-out", "/proc/x/traces", timeout=60)
    assert_one_line_exit_2(res, "--traces-out")
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "rank-0.json.gz").write_bytes(b"an older run's trace")
    res = cli(tmp_path, *SIM, "--traces-out", str(tmp_path / "traces"), timeout=60)
    assert_one_line_exit_2(res, "--traces-out", "not empty")
    assert (tmp_path / "traces" / "rank-0.json.gz").read_bytes() == b"an older run's trace"
    for flag in ("--ground-truth", "--json"):
        (tmp_path / "notes.json").write_text("mine")
        res = cli(tmp_path, *SIM, flag, str(tmp_path / "notes.json"), timeout=60)
        assert_one_line_exit_2(res, flag, "--force")
        assert (tmp_path / "notes.json").read_text() == "mine"
    assert not os.path.exists(tmp_path / ".trainscope")  # refused before the home was made
    res = cli(tmp_path, *SIM, "--ground-truth", str(tmp_path / "notes.json"), "--force", timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "notes.json").read_text() != "mine"


@pytest.mark.parametrize("flag", ["--json", "--stats-out"])
def test_replay_outputs_are_checked_before_the_replay(tmp_path, flag):
    """replay --json /proc/x/out.json failed only after the whole replay had run and written the store."""
    traces = tmp_path / "traces"
    traces.mkdir()
    home = tmp_path / "h"
    res = cli(tmp_path, "replay", str(traces), "--home", str(home), flag, "/proc/x/out.json", timeout=60)
    assert_one_line_exit_2(res, flag)
    (tmp_path / "notes.json").write_text("mine")
    res = cli(tmp_path, "replay", str(traces), "--home", str(home), flag, str(tmp_path / "notes.json"), timeout=60)
    assert_one_line_exit_2(res, flag, "--force")
    assert (tmp_path / "notes.json").read_text() == "mine"
    assert not os.path.exists(home)


def test_demo_on_a_small_world_places_its_fault_inside_it(tmp_path):
    """`demo --ranks 8` (the help says a multiple of 4) failed: 'bad value for sim.faults[0].rank: 13'."""
    res = cli(tmp_path, "demo", "--ranks", "8", "--home", str(tmp_path / "h"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "gpu_throttle:rank=5" in res.stdout and "top-1 rank right" in res.stdout, res.stdout


@pytest.mark.parametrize("ranks", ["4", "6"])
def test_demo_refuses_a_world_too_small_before_making_its_home(tmp_path, ranks):
    res = cli(tmp_path, "demo", "--ranks", ranks, "--home", str(tmp_path / "h"), timeout=60)
    assert_one_line_exit_2(res, "--ranks", "at least 8")
    assert not os.path.exists(tmp_path / "h")


def _two_job_store(path) -> None:
    """A store with jobs 'a' (ranks 0-1, windows 0-1, a verdict for window 0) and 'b' (rank 0)."""
    from trainscope.analyzer.store import DiagnosisStore
    from trainscope.processor.store import SqliteStore
    from trainscope.proto.model import Resource
    from trainscope.proto.v1 import records_pb2, telemetry_pb2

    records, diagnoses = SqliteStore(str(path)), DiagnosisStore(str(path))
    for job, ranks in (("a", 2), ("b", 1)):
        for w in range(2):
            win = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=w, start_ns=w * 10**9,
                                     end_ns=(w + 1) * 10**9, first_iteration=w * 5, last_iteration=w * 5 + 4)
            for r in range(ranks):
                res = Resource(job_id=job, rank=r, world_size=ranks, host=f"node{r}")
                marks = [telemetry_pb2.IterationMark(iteration=w * 5 + i, start_ns=win.start_ns + i * 10**8,
                                                     end_ns=win.start_ns + (i + 1) * 10**8) for i in range(5)]
                records.put("iterations", records_pb2.IterationWindow(resource=res.to_pb(), window=win, marks=marks,
                                                                      mean_ns=10**8, p50_ns=10**8, max_ns=10**8))
    diagnoses.put([], records_pb2.Verdict(job_id="a", window=records_pb2.Window(
        kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0), summary="job a: healthy", state="healthy"))
    records.close()
    diagnoses.close()


@pytest.mark.parametrize("args,words", [
    (("verdict",), ("--job is needed: the store holds 2 jobs: a, b",)),
    (("verdict", "--job", "nosuch"), ("--job", "unknown job", "a, b")),
    (("verdict", "--job", "a", "--window", "-1"), ("--window",)),
    (("verdict", "--job", "a", "--window", "7"), ("--window", "windows 0-0")),
    (("kernels", "--job", "a", "--rank", "999"), ("--rank", "ranks 0-1")),
    (("iterations", "--job", "a", "--rank", "999"), ("--rank",)),
    (("ranks", "--job", "a", "--host", "nosuch"), ("--host", "node0, node1")),
], ids=lambda a: "-".join(a) if isinstance(a, tuple) and a and a[0] in ("verdict", "kernels", "iterations", "ranks") else "")
def test_query_wrong_input_is_exit_2_and_says_what_there_is(tmp_path, args, words):
    """Unknown job/window/rank exited 1 like missing data; two jobs and no --job said 'bad value for --job: None'."""
    _two_job_store(tmp_path / "s.sqlite")
    res = cli(tmp_path, "query", *args, "--store", str(tmp_path / "s.sqlite"), timeout=60)
    assert_one_line_exit_2(res, *words)
    assert "None" not in res.stderr


def test_query_without_data_yet_is_exit_1(tmp_path):
    _two_job_store(tmp_path / "s.sqlite")
    res = cli(tmp_path, "query", "verdict", "--job", "b", "--store", str(tmp_path / "s.sqlite"), timeout=60)
    assert res.returncode == 1 and "has no verdict yet" in res.stderr, res.stderr
    res = cli(tmp_path, "query", "kernels", "--job", "a", "--rank", "1", "--store", str(tmp_path / "s.sqlite"),
              timeout=60)
    assert res.returncode == 1 and "no kernel records" in res.stderr, res.stderr


def test_query_iterations_headers_and_a_job_without_iterations(tmp_path):
    """Columns named *_S held ms values; a job whose windows hold no iteration printed a row of zeros."""
    from trainscope.processor.store import SqliteStore
    from trainscope.proto.model import Resource
    from trainscope.proto.v1 import records_pb2

    store = tmp_path / "s.sqlite"
    _two_job_store(store)
    res = cli(tmp_path, "query", "iterations", "--job", "a", "--store", str(store), timeout=60)
    assert res.returncode == 0, res.stderr
    header, first = res.stdout.splitlines()[:2]
    assert not [h for h in header.split() if h.endswith("_S")], header
    assert "100 ms" in first, res.stdout
    records = SqliteStore(str(store))
    records.put("iterations", records_pb2.IterationWindow(
        resource=Resource(job_id="c", rank=0, world_size=1).to_pb(),
        window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=0, start_ns=0, end_ns=10**10)))
    records.close()
    res = cli(tmp_path, "query", "iterations", "--job", "c", "--store", str(store), timeout=60)
    assert res.returncode == 1 and "no iterations recorded" in res.stderr, (res.stdout, res.stderr)
    assert res.stdout == ""

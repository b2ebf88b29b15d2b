"""`replay --force` never pulls a live processor's store from under it (issue #11 audit).

Real processes: `trainscope processor` holds HOME/store.sqlite; `trainscope replay --force`
with that home used to unlink the live store (the processor went on writing to a deleted
file). Now it refuses with one line and exit 2 while the store is open anywhere, and
replaces the store once that processor has stopped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "trainscope.deploy.cli"]
SIM = ("sim", "--ranks", "4", "--tp", "2", "--iterations", "4", "--no-analyze")


def _env(tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("TRAINSCOPE_") and k not in ("KAFKA_BOOTSTRAP", "XDG_RUNTIME_DIR")}
    e["TMPDIR"] = str(tmp_path / "tmp")
    os.makedirs(e["TMPDIR"], exist_ok=True)
    return e


def cli(tmp_path, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


def test_replay_force_refuses_the_store_of_a_running_processor(tmp_path):
    traces, home = tmp_path / "traces", tmp_path / "home"
    res = cli(tmp_path, *SIM, "--home", str(tmp_path / "h0"), "--traces-out", str(traces))
    assert res.returncode == 0, res.stderr
    proc = subprocess.Popen(CLI + ["processor", "--listen", f"unix://{tmp_path}/p.sock", "--home", str(home)],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "listening on" not in (line := proc.stdout.readline()):
            assert line, proc.stderr.read()
        store = home / "store.sqlite"
        assert store.exists()
        inode = store.stat().st_ino
        res = cli(tmp_path, "replay", str(traces), "--no-analyze", "--home", str(home), "--force")
        assert res.returncode == 2, (res.stdout, res.stderr)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("E")]
        assert len(lines) == 1 and "running trainscope process" in lines[0], res.stderr
        assert "Traceback" not in res.stderr
        assert store.stat().st_ino == inode  # the live store is the one still there
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0
    # stopped: --force replaces it
    res = cli(tmp_path, "replay", str(traces), "--no-analyze", "--home", str(home), "--force")
    assert res.returncode == 0, res.stderr
    assert not os.listdir(tmp_path / "tmp")


def test_a_store_is_in_use_while_another_process_holds_it_and_free_once_it_dies(tmp_path):
    """The store's lock is the kernel's (flock): a process SIGKILLed while holding the store lets go
    of it, so a later ``--force`` is not refused for ever (moved from the unit tier: it starts one)."""
    from trainscope.processor.store import store_in_use

    path = str(tmp_path / "store.sqlite")
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "from trainscope.processor.store import SqliteStore\n"
                              f"s = SqliteStore({path!r}); print('open', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "open"
        assert store_in_use(path)
    finally:
        child.kill()
        child.wait()
    assert not store_in_use(path)

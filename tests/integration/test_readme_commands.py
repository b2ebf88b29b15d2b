"""Every command the README shows, run as written with defaults only (issue #12 item 4, part 2).

The commands are extracted from README.md (its shell blocks and every inline
`trainscope ...` span, with optional `[...]` flags dropped), so a command added
to the README fails :func:`test_every_readme_command_is_run_or_says_why_not`
until it is run here. Placeholders (`DIR`, `J`, `N`) are filled with what a
new user would have at hand. Each command runs in a temporary working
directory with a temporary HOME and TMPDIR and no TRAINSCOPE_* variables, so
nothing of the user's is read or touched. Daemons are started, awaited until
they say they listen, sent SIGTERM, and must exit 0 without a traceback.

Not run, each said in PLAN: `pip install .` (it would change the interpreter
under test; `tests/run.sh` installs the same package editable), `bash
tests/run.sh` (this suite), Docker/compose (no Docker engine runs here; the
compose file is validated offline in tests/unit/test_deploy_manifests.py).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from test_cli_surprises import Daemon, _env, assert_one_line_exit_2
from trainscope.processor.store import SqliteStore
from trainscope.proto.contracts import Signal

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAMS = ("trainscope", "python3", "python", "bash", "docker", "kubectl", "export")

#: every command the README shows (defaults-only form) -> the test that runs it, or "SKIP: why".
PLAN = {
    "python3 -m pip install .": "SKIP: would reinstall the interpreter under test; tests/run.sh installs it",
    "bash tests/run.sh": "SKIP: it runs this suite",
    "export GRAFANA_ADMIN_PASSWORD=...": "SKIP: a variable for docker compose",
    "docker compose -f deploy/compose/compose.yaml up -d": "SKIP: no Docker engine here; validated offline",
    "trainscope demo": "test_quick_start_demo_then_every_query_and_report",
    "trainscope query jobs|verdict|stragglers|kernels|iterations|ranks":
        "test_quick_start_demo_then_every_query_and_report",
    "trainscope report --job J -o report.html": "test_quick_start_demo_then_every_query_and_report",
    "trainscope report": "test_quick_start_demo_then_every_query_and_report",
    "trainscope processor": "test_daemons_with_defaults_only",
    "trainscope processor --kafka-bootstrap broker1:9092,broker2:9092": "test_daemons_with_defaults_only",
    "trainscope analyzer": "test_daemons_with_defaults_only",
    "trainscope processor --collective-raw triggered": "test_daemons_with_defaults_only",
    "trainscope sim --collective-steps": "SKIP: a default-size simulation; tests/integration/test_sim_link_faults.py "
                                         "runs the simulator with collective_steps through the embedded pipeline",
    "trainscope sim --ranks N --tp T --pp P --ep E --fault TYPE:scope,onset=60s,... --duration 300s":
        "test_sim_and_replay",
    "trainscope replay DIR": "test_sim_and_replay",
    "trainscope run -- torchrun --nproc-per-node 4 train.py": "test_run_a_torchrun_job",
    "trainscope run -- torchrun ... train.py": "test_run_a_torchrun_job",
    "trainscope run": "test_run_a_torchrun_job",
    "trainscope run --install-pth": "test_install_pth_in_a_throwaway_venv",
    "trainscope profile --job J": "SKIP: needs a running job; tests/integration/test_deep_dive.py runs it on one",
    "trainscope profile": "SKIP: named in prose (a dive without it: the degradation trigger); "
                          "tests/integration/test_deep_dive.py runs it on a job",
    "trainscope profile --job J --iterations 5 --wait 60":
        "SKIP: needs a running job; tests/integration/test_deep_dive.py runs it on one",
    "trainscope query deep-dive --job J":
        "SKIP: needs a deep dive; tests/integration/test_deep_dive.py runs it on a real job's",
    "trainscope nccl-plugin build": "SKIP: tests/integration/test_nccl_plugin.py builds with it (--out in tmp_path) "
                                    "and loads the library",
}

#: placeholders of the README's synopses -> what a new user would type
FILL = {"--ranks N": "--ranks 16", "--tp T": "--tp 2", "--pp P": "--pp 2", "--ep E": "--ep 1",
        "TYPE:scope,onset=60s,...": "gpu_throttle:rank=5,onset=60s", "--job J": "--job demo",
        "torchrun ... train.py": "torchrun --nproc-per-node 4 train.py"}


def readme_commands(text: str) -> list[str]:
    """Shell lines of the README's fences (no language or sh/bash) and inline `trainscope ...` spans,
    `&&` split, optional `[...]` flags dropped (defaults only), in order, once each."""
    found: list[str] = []
    lang = None  # inside a fence: its language ("" for none)
    for raw in text.splitlines():
        if raw.strip().startswith("```"):
            lang = raw.strip()[3:].strip() if lang is None else None
            continue
        line = raw.split("  #", 1)[0].strip()
        if lang in ("", "sh", "bash", "shell") and line.split(" ", 1)[0] in PROGRAMS:
            found += [part.strip() for part in line.split("&&")]
    found += re.findall(r"`(trainscope [a-z][^`]*)`", text)
    out: list[str] = []
    for c in found:
        c = " ".join(re.sub(r"\[[^\]]*\]", "", c.replace("\\|", "|")).split())
        if c not in out:
            out.append(c)
    return out


COMMANDS = readme_commands((ROOT / "README.md").read_text())


def test_every_readme_command_is_run_or_says_why_not():
    assert "trainscope demo" in COMMANDS and "trainscope processor" in COMMANDS  # the extraction works
    unplanned = [c for c in COMMANDS if c not in PLAN]
    assert not unplanned, f"README commands no test runs (add them to PLAN): {unplanned}"
    stale = [c for c in PLAN if c not in COMMANDS]
    assert not stale, f"PLAN names commands the README no longer shows: {stale}"


def _filled(command: str, **fill: str) -> list[str]:
    for k, v in {**FILL, **fill}.items():
        command = command.replace(k, v)
    return shlex.split(command)


def _argv(command: str, **fill: str) -> list[str]:
    """``trainscope ...`` as the installed console script, as the user types it."""
    argv = _filled(command, **fill)
    exe = shutil.which("trainscope")
    return ([exe] if exe else [sys.executable, "-m", "trainscope.deploy.cli"]) + argv[1:]


def _user_env(tmp_path) -> dict:
    e = _env(tmp_path, HOME=str(tmp_path / "home"))
    os.makedirs(e["HOME"], exist_ok=True)
    return e


def run_readme(command: str, cwd, tmp_path, timeout=300, env=None, **fill) -> subprocess.CompletedProcess:
    assert command in COMMANDS, f"not a README command: {command}"
    res = subprocess.run(_argv(command, **fill), cwd=cwd, env={**_user_env(tmp_path), **(env or {})},
                         capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in res.stderr, (command, res.stderr)
    return res


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, (res.args, res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    return res.stdout


def test_quick_start_demo_then_every_query_and_report(tmp_path):
    """`trainscope demo`, then each `trainscope query ...` and `trainscope report` of the README in the same
    directory (the demo's default home ./.trainscope is what they read by default)."""
    out = ok(run_readme("trainscope demo", tmp_path, tmp_path))
    assert re.search(r"window \d+ \(iterations \d+-\d+\): job demo", out), out  # window ids a person reads
    assert "next: trainscope query verdict" in out
    assert not os.listdir(tmp_path / "tmp"), "demo left temporary files behind"
    store = tmp_path / ".trainscope" / "store.sqlite"
    stored = store.stat().st_mtime_ns, store.stat().st_size
    assert_one_line_exit_2(run_readme("trainscope demo", tmp_path, tmp_path), "--force")  # a second demo
    assert (store.stat().st_mtime_ns, store.stat().st_size) == stored  # ...left the first one's store as it was

    query = "trainscope query jobs|verdict|stragglers|kernels|iterations|ranks"
    verdict = json.loads(ok(run_readme(query, tmp_path, tmp_path, **{"jobs|verdict|stragglers|kernels|iterations|ranks":
                                                                     "verdict --json"})))
    culprit = verdict["suspects"][0]["rank"]
    assert verdict["window_span"] is None and verdict["stacks"].startswith("stack sampling (py-spy)")
    for what in query.split(" ", 2)[2].split("|"):
        text = ok(run_readme(query, tmp_path, tmp_path, **{"jobs|verdict|stragglers|kernels|iterations|ranks":
                                                           what + (f" --rank {culprit}" if what == "kernels" else "")}))
        assert text.strip(), what
        if what == "verdict":
            assert re.search(r"since window \d+ \(iterations \d+-\d+\)", text) and "stack sampling" in text, text
        if what in ("iterations", "stragglers", "kernels"):  # every duration column carries its unit
            first = text.splitlines()[1]
            assert re.search(r"\d (s|ms|us|ns)\b", first), (what, first)
        if what == "kernels":  # ...and the ratio to the peers says it is one
            assert re.search(r"\d\.\d\dx\b", text), text

    pytest.importorskip("plotly", reason="trainscope report needs the report extra (plotly)")
    ok(run_readme("trainscope report --job J -o report.html", tmp_path, tmp_path, timeout=120))
    report = tmp_path / "report.html"
    assert report.stat().st_size > 100_000 and (report.stat().st_mode & 0o777) == 0o600
    before = report.read_bytes()
    again = run_readme("trainscope report", tmp_path, tmp_path, timeout=120)  # defaults only: same file
    assert_one_line_exit_2(again, "--force")  # never replaced unasked
    assert report.read_bytes() == before


@pytest.mark.parametrize("command", ["trainscope processor",
                                     "trainscope processor --kafka-bootstrap broker1:9092,broker2:9092",
                                     "trainscope processor --collective-raw triggered",
                                     "trainscope analyzer"])
def test_daemons_with_defaults_only(tmp_path, command):
    """Started as written, ready, SIGTERM, exit 0, no traceback. The analyzer tails the default home's store,
    so a processor (defaults only) runs first in the same directory, as a user would start them."""
    first = None
    if command == "trainscope analyzer":
        first = Daemon(tmp_path, *_filled("trainscope processor")[1:], HOME=str(tmp_path))
    try:
        d = Daemon(tmp_path, *_filled(command)[1:], HOME=str(tmp_path),
                   ready="trainscope analyzer reading" if "analyzer" in command else "listening on")
        rc, err = d.stop()
        assert rc == 0 and "Traceback" not in err, (command, rc, err)
    finally:
        if first is not None:
            rc, err = first.stop()
            assert rc == 0 and "Traceback" not in err, err


def test_sim_and_replay(tmp_path):
    """The sim synopsis with its placeholders filled, then `trainscope replay DIR` on traces a sim wrote."""
    sim = ok(run_readme("trainscope sim --ranks N --tp T --pp P --ep E --fault TYPE:scope,onset=60s,... "
                        "--duration 300s", tmp_path, tmp_path))
    assert "simulated job" in sim and "against the ground truth" in sim
    traces = tmp_path / "traces"
    ok(subprocess.run(_argv(f"trainscope sim --ranks 8 --iterations 20 --no-analyze --home {tmp_path / 'h'} "
                            f"--traces-out {traces}"), cwd=tmp_path, env=_user_env(tmp_path),
                      capture_output=True, text=True, timeout=300))
    fresh = tmp_path / "user"
    fresh.mkdir()
    out = ok(run_readme("trainscope replay DIR", fresh, tmp_path, DIR=str(traces)))
    assert "replayed job" in out and "kernel events in" in out and (fresh / ".trainscope" / "store.sqlite").exists()
    assert not os.listdir(tmp_path / "tmp"), "sim or replay left temporary files behind"


TRAIN = textwrap.dedent("""\
    import time
    import torch
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1:  # two CPU-operator windows (every 0.5 s from the first step)
        for x, y in torch.utils.data.DataLoader(data, batch_size=8):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            time.sleep(0.005)  # a step of milliseconds, as a training step is (see the test)
    print("trained")
    """)


@pytest.mark.realjob      # a real 4-rank torch job: on the real-job worker (tests/conftest.py)
def test_run_a_torchrun_job(tmp_path):
    """`trainscope run -- torchrun --nproc-per-node 4 train.py` on a small real CPU torch job: every rank
    trains, the summary says what to run next, the torch profiler's CPU-operator windows ran on every rank
    (their records are in the store) and none of its lines nor a traceback reaches stderr.
    `trainscope run` alone says what is missing in one line (exit 2)."""
    pytest.importorskip("torch")
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun not on PATH")
    assert_one_line_exit_2(run_readme("trainscope run", tmp_path, tmp_path), "no command")
    (tmp_path / "train.py").write_text(TRAIN)
    # the user's environment asks for a CPU-operator window every 0.5 s from the first step (default: every
    # 30 s, 5 s after it), so the collector runs torch's profiler inside this short job: none of its lines
    # may reach the job's stderr. Each step sleeps 5 ms: without it a step took 0.3-0.8 ms, and beside a busy
    # process the processor's 64 open windows per rank (10 iterations each: 0.2 s of this job) were force-closed
    # before a window's operators arrived, which it drops as late (tens of thousands; ranks with no records)
    res = run_readme("trainscope run -- torchrun --nproc-per-node 4 train.py", tmp_path, tmp_path, timeout=400,
                     env={"TRAINSCOPE_CPU_OPS": "period_s=0.5,window_s=0.05,first_after_s=0"})
    ok(res)
    assert res.stdout.count("trained") == 4, res.stdout
    assert res.stderr.count("kernels: cpu-ops") == 4, res.stderr  # the source every rank chose...
    store = SqliteStore(str(tmp_path / ".trainscope" / "store.sqlite"), read_only=True)
    try:  # ...and its windows ran: operator records of every rank were stored
        assert {kw.resource.rank for kw in store.records(Signal.KERNELS) if kw.kernels} == set(range(4))
    finally:
        store.close()
    assert "next: trainscope analyzer" in res.stderr, res.stderr
    profiler = [ln for ln in res.stderr.splitlines() if ln.startswith(("USDT:", "STAGE:"))]
    assert not profiler, profiler
    ours = [n for n in os.listdir(tmp_path / "tmp") if n.startswith(("trainscope-run-", "ts-"))]
    assert not ours, f"run left its temporary directories: {ours}"  # torch's own (torchelastic_*) are torch's


def test_install_pth_in_a_throwaway_venv(tmp_path):
    """`trainscope run --install-pth` writes into the interpreter's site-packages: run it from a throwaway venv
    (system packages visible) so the interpreter under test is not touched."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run([str(py), "-m", "trainscope.deploy.cli", *_filled("trainscope run --install-pth")[1:]],
                         cwd=tmp_path, env=_user_env(tmp_path), capture_output=True, text=True, timeout=120)
    ok(res)
    written = res.stdout.split("wrote ", 1)[1].split(";", 1)[0]
    assert written.startswith(str(venv)) and os.path.isfile(written), res.stdout
    assert "TRAINSCOPE_AUTOSTART=1" in res.stdout

"""``trainscope run`` end to end on small jobs: the processor it starts, the start-up hook in a
fresh interpreter, a single-process job, and a job whose collector has nowhere to send."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainscope.collector.bootstrap import DIR as BOOTSTRAP_DIR
from trainscope.collector.exporter_socket import reachable

pytestmark = pytest.mark.integration

JOB = textwrap.dedent("""\
    import torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    for x, y in torch.utils.data.DataLoader(data, batch_size=4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print("trained")
    """)


def clean_env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}
    e.update(extra)
    return e


def ts(*args, timeout=180, **env):
    return subprocess.run([sys.executable, "-m", "trainscope.deploy.cli", "run", *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def test_run_starts_a_processor_collects_a_single_process_job_and_stops_it(tmp_path):
    pytest.importorskip("torch")
    sock = f"unix://{tmp_path}/p.sock"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    p = ts("--processor", sock, "--home", str(tmp_path / "home"), "--run-dir", str(tmp_path / "run"),
           "--no-stacks", "--set", "TRAINSCOPE_CPU_OPS=0", "--", sys.executable, str(script))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "trained" in p.stdout
    assert "(started here, now stopped)" in p.stderr and not reachable(sock)
    (stats,) = [json.loads(f.read_text()) for f in (tmp_path / "run").glob("stats-*.json")]
    assert stats["resource"]["rank"] == 0 and stats["resource"]["world_size"] == 1
    assert stats["hooks"]["iterations"] == 16 and stats["hooks"]["pattern"] == "DO"
    c = stats["collector"]
    assert c["submitted"] > 0 and c["confirmed"] == c["submitted"] and c["dropped_total"] == 0
    assert (tmp_path / "home" / "store.sqlite").exists()


def test_without_a_processor_the_job_runs_and_the_loss_is_counted(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    p = ts("--processor", "127.0.0.1:1", "--no-processor", "--no-stacks", "--run-dir", str(tmp_path / "run"),
           "--set", "TRAINSCOPE_CPU_OPS=0", "--", sys.executable, str(script))
    assert p.returncode == 0 and "trained" in p.stdout, p.stderr
    assert "no processor at 127.0.0.1:1" in p.stderr
    (stats,) = [json.loads(f.read_text()) for f in (tmp_path / "run").glob("stats-*.json")]
    c = stats["collector"]
    assert c["confirmed"] == 0 and c["dropped_total"] == c["submitted"] > 0


def test_the_start_up_hook_chains_to_an_existing_sitecustomize_and_skips_non_ranks(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    env = clean_env(PYTHONPATH=os.pathsep.join([BOOTSTRAP_DIR, str(other)]), TRAINSCOPE_AUTOSTART="1",
                    TRAINSCOPE_DEBUG_BOOT="1")
    code = "import os, sys; print(os.environ.get('OTHER_SITECUSTOMIZE'), 'trainscope.collector' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["ran", "False"]  # chained; and a non-rank never imports trainscope
    assert "skip (no distributed worker identity)" in p.stderr
    p = subprocess.run([sys.executable, "-c", "print('ok')"], env=dict(env, PYTHONPATH=BOOTSTRAP_DIR, RANK="0",
                       WORLD_SIZE="1", TRAINSCOPE_PROCESSOR="127.0.0.1:1", TRAINSCOPE_RUN_DIR=str(tmp_path / "r"),
                       TRAINSCOPE_SHUTDOWN_TIMEOUT_S="0.2", TRAINSCOPE_STACKS="0"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    assert "start (rank process)" in p.stderr
    assert list(Path(tmp_path / "r").glob("stats-*.json"))

"""`trainscope run` keeps torch's profiler lines out of the job's stderr (issue #12 item 4).

The collector's CPU-ops windows start torch's profiler; Kineto (torch 2.13) prints
``USDT:``/``STAGE:`` lines at every log level below 6. No processes here: the
environment the launcher builds is checked; the real torch job runs in
tests/integration/test_readme_commands.py.
"""
from __future__ import annotations

from trainscope.deploy.launcher import RunConfig, child_env


def _env(base: dict) -> dict:
    return child_env(RunConfig(command=("python3", "train.py")), job_id="j", processor="unix:///x.sock",
                     run_dir="/tmp/r", base=base)


def test_kineto_is_quiet_in_the_job_by_default():
    assert _env({})["KINETO_LOG_LEVEL"] == "6"


def test_a_level_the_user_chose_is_kept():
    assert _env({"KINETO_LOG_LEVEL": "2"})["KINETO_LOG_LEVEL"] == "2"

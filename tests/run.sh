#!/usr/bin/env bash
# Install everything the test suite needs, then run it.
# The README's test command and .ci/run both call this script, so they cannot drift.
#   bash tests/run.sh                 # unit + integration tiers
#   TRAINSCOPE_TEST_WORKERS=0 bash tests/run.sh -m benchmark    # extra pytest arguments pass through
#                                     # (pytest-benchmark times nothing under xdist: one process)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

"$PY" -m pip install --disable-pip-version-check -q -e '.[test]'

# PyTorch (CPU) for the real training-job tests of the collector; a test-only
# dependency: the collector imports torch lazily and runs without it.
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  "$PY" -m pip install --disable-pip-version-check -q torch==2.13.0 \
    || echo "WARNING: could not install torch; the PyTorch collector tests will be skipped" >&2
fi

# Prometheus + promtool (Debian) for the real-Prometheus integration tests and
# `promtool test rules`. Installed when we can; the tests say loudly when not.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing prometheus and prometheus-alertmanager from Debian..." >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends prometheus prometheus-alertmanager >/dev/null; } \
      || echo "WARNING: could not install Prometheus; its tests will be skipped" >&2
  else
    echo "WARNING: prometheus/promtool not found and cannot apt-get install them;" \
         "the Prometheus tests will be skipped (apt-get install -y prometheus)" >&2
  fi
fi

# Chromium (Debian) renders `trainscope report`'s HTML headless in its test.
# Installed when we can; the test skips and says so when not.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium from Debian..." >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium >/dev/null; } \
      || echo "WARNING: could not install chromium; the HTML report test will be skipped" >&2
  else
    echo "WARNING: chromium not found and cannot apt-get install it;" \
         "the HTML report test will be skipped (apt-get install -y chromium)" >&2
  fi
fi

# Compiled modules (and pytest's rewritten test modules) are written beside their sources (__pycache__, ignored by
# git): with PYTHONDONTWRITEBYTECODE set (as on CI machines) every interpreter the suite starts (each rank of each
# real job, each CLI run) would compile trainscope again. No PYTHONPYCACHEPREFIX: under one, Python ignores the
# compiled files pip installed beside torch, numpy and grpc and compiles them again (measured: three cold
# collections 62 CPU-s with a fresh prefix, 46 without).
unset PYTHONDONTWRITEBYTECODE

# The summary CI prints last: the suite's wall time, after pytest's ten slowest tests (issue #23).
start=$(date +%s)
set +e
# Three pytest-xdist workers by default on any machine (tests/conftest.py lays the suite out): the real-job files
# one at a time on one worker, first, as the longest scope; the other workers take the other files (each a scope,
# its fixtures run once) and then the unit tests. A real job shares the host with two other tests, as a job
# shares a node; a third worker fills the cores while tests wait on servers and subprocesses (measured on 2 cores:
# 77 % busy with two workers). TRAINSCOPE_TEST_WORKERS=N: N workers; 0: one process (benchmarks need that).
workers=${TRAINSCOPE_TEST_WORKERS:-3}
xdist=()
if [ "$workers" != 0 ]; then xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi
"$PY" -m pytest -q -p no:cacheprovider --durations=10 "${xdist[@]}" "$@"
rc=$?
set -e
echo "trainscope suite: exit ${rc}, wall time $(( $(date +%s) - start )) s (the ten slowest tests are listed above)"
exit "$rc"

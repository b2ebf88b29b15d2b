"""``trainscope report``: a real store from a simulated faulty job, the report rendered in headless chromium.

The store comes from the simulator through the real path (exporters -> gRPC ->
processor -> embedded analyzer). The page is opened in Debian's ``chromium``
(headless): its console must show no script error, every plotly figure must
have rendered (an SVG inside each plot div) and a screenshot is taken.
"""
from __future__ import annotations

import html.parser
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from trainscope.collector.sim import SimConfig, parse_fault
from trainscope.deploy.embedded import SimAnalysis, run_sim_embedded

pytestmark = pytest.mark.integration
SUSPECT = 5
JOB = "reportjob"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("chromium is not installed (apt-get install -y chromium): the HTML report is not rendered")


def cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscope.deploy.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def external_resources(page: str) -> list[str]:
    """src/href of script, link and img tags (the parser skips script bodies, as a browser does)."""
    found: list[str] = []

    class Tags(html.parser.HTMLParser):
        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag in ("script", "img", "link") and (a.get("src") or a.get("href")):
                found.append(a.get("src") or a.get("href"))

    Tags().feed(page)
    return found


def render(page: pathlib.Path, shot: pathlib.Path) -> tuple[str, list[str]]:
    """The DOM after scripts ran, and the console messages at error level or uncaught."""
    base = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", "--window-size=1280,3800"]
    r = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines()
              if "CONSOLE" in ln and ("Uncaught" in ln or ":ERROR:" in ln or "Error" in ln)]
    s = subprocess.run([*base, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert s.returncode == 0 and shot.exists(), s.stderr[-2000:]
    return r.stdout, errors


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> pathlib.Path:
    home = tmp_path_factory.mktemp("report-home")
    cfg = SimConfig(ranks=16, tp=2, pp=2, gpus_per_host=4, iterations=60, iteration_s=1.0, job_id=JOB,
                    faults=(parse_fault(f"gpu_throttle:rank={SUSPECT},onset=10s,factor=1.6"),), home=str(home))
    a = SimAnalysis()
    res = run_sim_embedded(cfg, **a.hooks())
    return pathlib.Path(res.store_path)


def test_report_renders_with_its_plots_and_no_script_errors(store, tmp_path):
    out = tmp_path / "report.html"
    r = cli("report", "--store", str(store), "--job", JOB, "-o", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    text = out.read_text()
    assert external_resources(text) == []  # self-contained: plotly.js inlined
    dom, errors = render(out, tmp_path / "report.png")
    assert errors == []
    plots = re.findall(r'class="[^"]*js-plotly-plot', dom)
    svgs = dom.count('class="main-svg"')
    # iterations, heatmap, >= 1 kernel CDF, phases; each figure draws at least one svg layer
    assert len(plots) >= 4 and svgs >= len(plots), (len(plots), svgs)
    assert f"rank {SUSPECT} (suspect)" in dom  # the kernel CDFs are the suspect's
    verdict = dom[dom.index('id="verdict"'):dom.index('id="iterations"')]
    assert re.search(rf"<td>{SUSPECT}</td><td>culprit</td>", verdict)
    assert "Next steps" in verdict and "confidence" in verdict
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000  # a page with plots, not a blank one


def test_the_checker_does_catch_a_script_error(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>no_such_function();</script></body></html>")
    _, errors = render(page, tmp_path / "bad.png")
    assert errors and "no_such_function" in errors[0]


def test_wrong_input_is_one_line_and_exit_2(store, tmp_path):
    out = tmp_path / "r.html"
    cases = [
        (["--store", str(store), "--job", "nosuchjob", "-o", str(out)], "unknown job"),
        (["--store", str(tmp_path / "missing.sqlite"), "-o", str(out)], "no trainscope store"),
        (["--store", __file__, "-o", str(out)], "not a trainscope store"),
        (["--store", str(store), "-o", str(pathlib.Path(__file__) / "r.html")], "cannot write"),
    ]
    for args, msg in cases:
        r = cli("report", *args, cwd=tmp_path)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not out.exists()


def test_an_existing_output_is_replaced_only_with_force(store, tmp_path):
    out = tmp_path / "r.html"
    out.write_text("an engineer's notes")
    r = cli("report", "--store", str(store), "-o", str(out), cwd=tmp_path)
    assert r.returncode == 2 and "--force" in r.stderr and out.read_text() == "an engineer's notes"
    r = cli("report", "--store", str(store), "-o", str(out), "--force", cwd=tmp_path)
    assert r.returncode == 0 and out.read_text().startswith("<!DOCTYPE html>")


def test_a_healthy_job_is_reported_healthy_with_no_suspect(tmp_path):
    cfg = SimConfig(ranks=8, tp=2, gpus_per_host=4, iterations=40, iteration_s=1.0, job_id="healthy",
                    home=str(tmp_path / "home"))
    res = run_sim_embedded(cfg, **SimAnalysis().hooks())
    out = tmp_path / "r.html"
    r = cli("report", "--store", res.store_path, "-o", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert 'class="state healthy"' in page and "<td>culprit</td>" not in page
    assert "no suspect to compare" in page

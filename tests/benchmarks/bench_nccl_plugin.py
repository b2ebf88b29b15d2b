"""What the NCCL profiler plugin costs NCCL's proxy thread per network transfer (no GPU needed).

    python tests/benchmarks/bench_nccl_plugin.py [--rounds 3]

Builds the plugin (``trainscope nccl-plugin build``'s code) and ``tests/support/nccl_driver.c``
in a temporary directory, then runs the driver's ``bench`` scenario: on one thread, 200,000
send steps as NCCL's proxy thread makes them per transfer (ProxyStep start, SendGPUWait,
SendPeerWait, SendWait, stop: five calls), through the plugin and, in the same process, through
empty functions behind the same function pointers (the baseline: NCCL's cost of calling any
plugin). Thread CPU time (other work on the shared host is not counted), best of 5 per driver
run; ``--rounds`` driver runs. Prints ns per step for both and
the difference; the plugin reads the clock twice per step (CLOCK_REALTIME: ~20 ns with the
vDSO, ~120 ns on this virtualised host, which dominates here). A transfer of a 256 KiB slice
takes ~10 us at 25 GB/s, so the figure is to be read against that.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="driver runs (each: best of 5 x 200,000 steps)")
    args = ap.parse_args()
    from trainscope.deploy import nccl_plugin

    cc = nccl_plugin.find_compiler()
    if cc is None:
        print("no C compiler: nothing to measure", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        lib = nccl_plugin.build(d, cc=cc)
        driver = os.path.join(d, "nccl_driver")
        subprocess.run([cc, "-std=c11", "-O2", "-I", str(nccl_plugin.source_dir()), "-o", driver,
                        os.path.join(ROOT, "tests", "support", "nccl_driver.c"), "-ldl", "-lpthread"], check=True)
        plugin, empty = [], []
        for r in range(args.rounds):
            env = dict(os.environ, TRAINSCOPE_NCCL_DIR=os.path.join(d, f"run{r}"))
            out = subprocess.run([driver, str(lib), "4", "bench"], env=env, capture_output=True, text=True,
                                 check=True).stdout
            f = dict(zip(*[iter(next(ln for ln in out.splitlines() if ln.startswith("bench")).split()[1:])] * 2))
            plugin.append(float(f["plugin_ns_per_step"]))
            empty.append(float(f["empty_ns_per_step"]))
            print(f"run {r + 1}/{args.rounds}: plugin {plugin[-1]:.0f} ns/step, empty calls {empty[-1]:.1f} ns/step",
                  file=sys.stderr)
    p, e = min(plugin), min(empty)
    print(f"NCCL profiler plugin, per send step (5 calls), best of {args.rounds} runs:")
    print(f"  plugin          {p:8.1f} ns")
    print(f"  empty plugin    {e:8.1f} ns   (baseline, same runs)")
    print(f"  added           {p - e:8.1f} ns = {100 * (p - e) / 10_000:.2f} % of a 10 us transfer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

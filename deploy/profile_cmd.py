"""``trainscope profile --job J``: a manual deep dive (issue #14; EROICA §4.1's trigger, by hand).

Asks the processor(s) of the job's hosts for one synchronized profiler window
(``processor/control.py``: the first processor picks the start iteration a few
iterations ahead of the latest it saw, the others are given it), then, with
``--wait``, follows it until every rank reported and prints where each rank's
trace is. Exit 0 when accepted (and, with ``--wait``, every rank traced the
iterations asked for), 1 when refused or incomplete, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time

from trainscope.proto import env
from trainscope.proto.contracts import Trigger
from trainscope.proto.errors import ConfigError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="profile the same iterations on every rank of a running job (deep dive)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--job", required=True, help="job id (required)")
    p.add_argument("--ranks", help="only these ranks: 0,3,5-7 (default: every rank)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--iterations", type=int, help="iterations to profile (default: the processor's, 5)")
    how.add_argument("--duration", help="wall time to profile, converted to iterations at the job's pace: 20s, 2m")
    p.add_argument("--processor", action="append", metavar="ADDR",
                   help=f"processor of a host of the job; repeat for each host "
                        f"(default: {env.PROCESSOR} or this host's socket)")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for every rank's trace and list them (0: do not wait)")
    p.add_argument("--reason", default="", help="free text kept with the deep dive")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_profile)
    return p


def parse_ranks(text: str | None) -> list[int]:
    """``"0,3,5-7"`` -> [0, 3, 5, 6, 7]; ConfigError on anything else."""
    if not text:
        return []
    out: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ConfigError("--ranks", text, "expected ranks like 0,3,5-7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 1_000_000:
            raise ConfigError("--ranks", text, f"bad range {part.strip()!r}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_duration(text: str | None) -> float:
    """``"20s"``, ``"2m"``, ``"1.5"`` (seconds) -> seconds; ConfigError otherwise."""
    if not text:
        return 0.0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise ConfigError("--duration", text, "expected a duration like 20s, 2m")
    v = float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2) or "s"]
    if not v > 0:
        raise ConfigError("--duration", text, "must be > 0")
    return v


def cmd_profile(args) -> int:
    import grpc

    from trainscope.processor.control import deep_dive_status, manifest_of, request_all
    from trainscope.proto.v1 import control_pb2

    if args.iterations is not None and args.iterations < 1:
        raise ConfigError("--iterations", args.iterations, "must be >= 1")
    if args.wait < 0:
        raise ConfigError("--wait", args.wait, "must be >= 0")
    ranks = parse_ranks(args.ranks)
    duration = parse_duration(args.duration)
    targets = args.processor or [env.text(env.PROCESSOR) or env.DEFAULT_PROCESSOR_TARGET]
    for t in targets:
        env.check_target("--processor", t)
    req = control_pb2.DeepDiveRequest(job_id=args.job, ranks=ranks, iterations=args.iterations or 0,
                                      duration_s=duration, trigger=Trigger.MANUAL, reason=args.reason)
    try:
        acks = request_all(targets, req)
    except grpc.RpcError as e:
        raise ConfigError("--processor", ",".join(targets),
                          f"no answer ({e.code().name if hasattr(e, 'code') else e})") from None
    refused = [(t, a) for t, a in zip(targets, acks) if not a.accepted]
    first = next((a for a in acks if a.accepted), None)
    if not args.json:
        for t, a in zip(targets, acks):
            if a.accepted:
                print(f"deep dive {a.dive_id} of job {args.job}: iterations {a.start_iteration}-"
                      f"{a.start_iteration + a.iterations - 1} on {a.ranks_reached} rank(s) at {t} "
                      f"(latest seen: iteration {a.latest_iteration}); traces in {a.directory}")
            else:
                print(f"refused by {t}: {a.detail}", file=sys.stderr)
    if first is None or refused:
        if args.json:
            print(json.dumps({"accepted": False, "refused": {t: a.detail for t, a in refused}}))
        return 1
    if args.wait <= 0:
        if args.json:
            print(json.dumps({"accepted": True, "dive_id": first.dive_id, "start_iteration": first.start_iteration,
                              "iterations": first.iterations, "directories": [a.directory for a in acks]}))
        return 0
    deadline = time.monotonic() + args.wait
    records: dict = {}
    while True:
        for t in targets:
            st = deep_dive_status(t, args.job, first.dive_id)
            if st.dives:
                records[t] = st.dives[0]
        if len(records) == len(targets) and all(r.complete for r in records.values()) and all(
                rep.summary_path for r in records.values() for rep in r.reports if rep.trace_path):
            break  # every rank reported and the processor summarized each trace
        if time.monotonic() >= deadline:
            break
        if sys.stderr.isatty():
            got = sum(len(r.reports) for r in records.values())
            want = sum(len(r.ranks_expected) for r in records.values())
            print(f"\rwaiting for traces: {got}/{want} ranks", end="", file=sys.stderr, flush=True)
        time.sleep(0.5)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    docs = [manifest_of(r) for r in records.values()]
    ranks_out = {k: v for d in docs for k, v in d["ranks"].items()}
    ok = (len(records) == len(targets) and all(r.complete and not r.partial for r in records.values())
          and ranks_out and all(v["outcome"] == "done" for v in ranks_out.values()))
    if args.json:
        print(json.dumps({"accepted": True, "dive_id": first.dive_id, "complete": ok, "processors": docs}))
        return 0 if ok else 1
    for rank in sorted(ranks_out, key=int):
        v = ranks_out[rank]
        its = f"iterations {v['first_iteration']}-{v['last_iteration']}" if v["outcome"] in ("done", "truncated") \
            else "no iterations"
        where = f"{v['trace']} ({v['trace_bytes'] / 1e6:.1f} MB)" if v["trace"] else v["detail"]
        print(f"  rank {rank}: {v['outcome']}, {its}, {where}")
    missing = [r for d in docs for r in d["ranks_expected"] if str(r) not in d["ranks"]]
    if missing:
        print(f"  no report from rank(s) {', '.join(map(str, missing))} within {args.wait:g} s")
    return 0 if ok else 1


__all__ = ["add_parser", "cmd_profile", "parse_duration", "parse_ranks"]

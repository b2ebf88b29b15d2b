"""Regenerate the checked-in dashboard JSON (``dashboards/json/*.json``).

    python dashboards/build.py           # write
    python dashboards/build.py --check   # exit 1 if the checked-in files differ

Needs the test extra (grafana-foundation-sdk); nothing at run time imports this.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402

import boards  # noqa: E402

OUT = HERE / "json"


def render() -> dict[str, str]:
    """name -> JSON text of every dashboard (sorted keys, stable across runs)."""
    out = {}
    for name, make in boards.BOARDS.items():
        model = make().build()
        text = json.dumps(json.loads(JSONEncoder().encode(model)), indent=2, sort_keys=True) + "\n"
        out[f"trainscope-{name}.json"] = text
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the checked-in files instead of writing")
    args = ap.parse_args(argv)
    files = render()
    if args.check:
        stale = [n for n, t in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != t]
        extra = sorted(p.name for p in OUT.glob("*.json") if p.name not in files)
        for n in stale + extra:
            print(f"dashboards/json/{n} is out of date: run python dashboards/build.py", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(exist_ok=True)
    for n, t in files.items():
        (OUT / n).write_text(t)
        print(f"wrote dashboards/json/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

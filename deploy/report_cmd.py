"""``trainscope report --job J -o report.html``: the job's incident report as one HTML file.

The command's parser and handler; ``deploy/cli.py`` registers it with
``add_parser(sub)``. The report itself is ``analyzer/report_html.py``.
"""
from __future__ import annotations

import argparse
import os

from trainscope.proto import env
from trainscope.proto.errors import ConfigError

SQLITE_MAGIC = b"SQLite format 3\x00"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="write a job's self-contained HTML incident report",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--job", help="job id (default: the store's only job)")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write")
    p.add_argument("--force", action="store_true", help="replace the output file when it exists")
    p.add_argument("--store", help="the SQLite store (default HOME/store.sqlite)")
    p.add_argument("--home", help=f"state directory (env {env.HOME}; default ./.trainscope)")
    p.set_defaults(func=cmd_report)
    return p


def cmd_report(args) -> int:
    from trainscope.analyzer.report_html import ReportConfig, write_report

    if args.store:
        path, setting = args.store, "--store"
    else:
        home = args.home or env.text(env.HOME) or os.path.join(os.getcwd(), ".trainscope")
        path, setting = os.path.join(home, "store.sqlite"), "--home" if args.home else "--home (default ./.trainscope)"
    check_store(path, setting)
    out = write_report(ReportConfig(store_path=path, store_setting=setting, out=args.output,
                                    job=args.job, force=args.force))
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB): open it in any browser, or attach it to the incident")
    return 0


def check_store(path: str, setting: str, *, need: frozenset[str] = frozenset()) -> None:
    """A trainscope store, checked without writing to it, or a one-line ConfigError (never a sqlite
    traceback): missing, a directory, unreadable, not SQLite, or an SQLite file without trainscope's
    tables (``need``: tables the caller reads, e.g. the analyzer's tail needs the processor's)."""
    import sqlite3

    from trainscope.analyzer import store as analyzer_store
    from trainscope.processor import store as processor_store

    if os.path.isdir(path):
        raise ConfigError(setting, path, "is a directory; name the store file (HOME/store.sqlite)")
    if not os.path.isfile(path):
        raise ConfigError(setting, path, "no trainscope store there: run `trainscope demo`, `replay` or a "
                                         "processor with this --home, or pass --store PATH")
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise ConfigError(setting, path, f"cannot be read: {exc.strerror}") from None
    if head != SQLITE_MAGIC:
        raise ConfigError(setting, path, "is not a trainscope store (not an SQLite file)")
    try:
        tables = processor_store.tables_in(path)
    except sqlite3.DatabaseError as exc:
        raise ConfigError(setting, path, f"is not a readable trainscope store: {exc}") from None
    if not tables & (processor_store.TABLES | analyzer_store.TABLES):
        raise ConfigError(setting, path, "is not a trainscope store (an SQLite file without trainscope's "
                                         "tables; left as it was)")
    if need - tables:
        raise ConfigError(setting, path, f"holds no {', '.join(sorted(need - tables))} table: not a "
                                         "processor's store (start `trainscope processor` with this --home)")

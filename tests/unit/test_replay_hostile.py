"""`replay` on hostile files (issue #11 item 9): each ends in one clear ``TraceFileError`` (and,
through the CLI, one line and exit 2) within a bounded memory cost, or loads with the bad
events skipped and counted."""
from __future__ import annotations

import gzip
import json
import resource
import zlib

import pytest

from trainscope.collector.sources.replay import MAX_NAME_CHARS, load_rank_trace
from trainscope.proto.errors import ConfigError, TraceFileError

GOOD = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10 + i, "dur": 1, "args": {"stream": 7}}
        for i in range(5)]


def write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def gzip_bomb(path, expanded_bytes):
    """A valid gzip file of ``expanded_bytes`` zeros, written in well under a second."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(expanded_bytes >> 20):
            f.write(c.compress(chunk))
        f.write(c.flush())
    return path


def test_a_gzip_bomb_stops_at_the_cap_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSCOPE_REPLAY_MAX_BYTES", str(8 << 20))
    bomb = gzip_bomb(tmp_path / "rank-0.json.gz", 256 << 20)
    assert bomb.stat().st_size < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TraceFileError, match="decompresses to more than the 8.0 MiB limit"):
        load_rank_trace(bomb)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 128 << 10  # far below the 256 MiB it expands to


def test_a_file_over_the_cap_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSCOPE_REPLAY_MAX_BYTES", "1000")
    p = write(tmp_path / "rank-0.json", {"traceEvents": GOOD * 50})
    with pytest.raises(TraceFileError, match="larger than the"):
        load_rank_trace(p)
    monkeypatch.setenv("TRAINSCOPE_REPLAY_MAX_BYTES", "lots")
    with pytest.raises(ConfigError, match="TRAINSCOPE_REPLAY_MAX_BYTES"):
        load_rank_trace(p)


def test_whitespace_only_and_deep_nesting_are_clear_errors(tmp_path):
    ws = tmp_path / "rank-0.json"
    ws.write_bytes(b" \n\t" * 100_000)
    with pytest.raises(TraceFileError, match="only whitespace"):
        load_rank_trace(ws)
    for i, text in enumerate(["[" * 100_000 + "]" * 100_000,
                              # 100k nested objects crash orjson (C stack); strings with
                              # brackets in them must not hide the depth
                              '{"traceEvents": [' + '{"a":"]",' * 100_000 + "1" + "}" * 100_000 + "]}"]):
        deep = tmp_path / f"rank-{i + 1}.json"
        deep.write_text(text)
        with pytest.raises(TraceFileError, match="nested more than 512 levels"):
            load_rank_trace(deep)
    ok = write(tmp_path / "rank-9.json", {"traceEvents": GOOD, "x": '"\\"[[[[{{{{' * 1000})
    assert len(load_rank_trace(ok).kernels) == 5  # brackets inside strings do not count


def test_bad_events_are_skipped_and_counted_not_fatal(tmp_path):
    events = GOOD + [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#" + "9" * 100_000, "ts": 1, "dur": 5},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 1, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "k" * 100_000, "ts": 30, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "huge", "ts": 31, "dur": 1e30},
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 2**70, "dur": 1},
    ]
    t = load_rank_trace(write(tmp_path / "rank-0.json", {"traceEvents": events}))
    assert t.skipped == {"iteration:bad_name": 1, "kernel:long_name": 1, "kernel:bad_duration": 1,
                         "kernel:bad_timestamp": 1}
    assert len(t.kernels) == 6 and [m.iteration for m in t.iterations] == [3]
    assert max(len(n) for n in t.kernels.names) == MAX_NAME_CHARS


def test_replay_cli_says_one_line_and_exits_2_on_a_bomb(tmp_path, monkeypatch, capsys):
    from trainscope.deploy.cli import main

    d = tmp_path / "job"
    d.mkdir()
    gzip_bomb(d / "rank-0.json.gz", 64 << 20)
    monkeypatch.setenv("TRAINSCOPE_REPLAY_MAX_BYTES", str(4 << 20))
    rc = main(["replay", str(d), "--home", str(tmp_path / "h")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "4.0 MiB limit" in err
    assert len(err.strip().splitlines()) == 1

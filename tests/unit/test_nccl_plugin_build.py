"""``trainscope nccl-plugin build`` without a compiler or over an existing library: one line, exit 2.

No compiler is run here (the unit tier starts no process): ``shutil.which`` is made to find
nothing, or the output already exists. Building for real is tests/integration/test_nccl_plugin.py.
"""
from __future__ import annotations

import pytest

from trainscope.deploy import nccl_plugin
from trainscope.deploy.cli import main as cli
from trainscope.proto.errors import ConfigError


def test_no_compiler_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(nccl_plugin.shutil, "which", lambda name: None)
    assert nccl_plugin.find_compiler() is None
    with pytest.raises(ConfigError, match="no C compiler"):
        nccl_plugin.build(tmp_path)
    assert cli(["nccl-plugin", "build", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C compiler found" in err[0] and not (tmp_path / "o").exists()


def test_an_existing_library_is_not_replaced_without_force(tmp_path, capsys):
    lib = tmp_path / nccl_plugin.LIBRARY
    lib.write_bytes(b"someone's library")
    assert cli(["nccl-plugin", "build", "--out", str(tmp_path), "--cc", "sh"]) == 2
    assert "pass --force" in capsys.readouterr().err and lib.read_bytes() == b"someone's library"


def test_the_shipped_source_is_found():
    src = nccl_plugin.source_dir()
    assert (src / "trainscope_nccl_profiler.c").is_file() and (src / "trainscope_nccl_profiler.h").is_file()
    assert "ncclProfiler_v4" in (src / "trainscope_nccl_profiler.c").read_text()

"""``trainscope nccl-plugin build [--out DIR]``: compile the NCCL profiler plugin on a GPU host.

The plugin's C source ships with the package (``collector/nccl_plugin/``);
this compiles it with the host's C compiler (``$CC``, else ``cc``, ``gcc``,
``clang``) into ``libnccl-profiler-trainscope.so`` and says how to turn it on:
``NCCL_PROFILER_PLUGIN=<path>`` in every rank's environment (with
``trainscope run``: ``--set NCCL_PROFILER_PLUGIN=<path>``). No NCCL headers or
CUDA are needed: the plugin declares the ABI it implements itself. Exit 0 when
built, 2 with one line when there is no compiler, the output exists (``--force``
replaces it) or the compiler fails.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources
from typing import Mapping

from trainscope.proto import env
from trainscope.proto.errors import ConfigError, TrainscopeError

LIBRARY = "libnccl-profiler-trainscope.so"
SOURCE = "trainscope_nccl_profiler.c"
CFLAGS = ("-std=c11", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall")


class BuildError(TrainscopeError):
    """The compiler ran and failed (one line: its first error)."""


def source_dir() -> pathlib.Path:
    """The shipped plugin source (package data of ``trainscope.collector``)."""
    return pathlib.Path(str(resources.files("trainscope.collector").joinpath("nccl_plugin")))


def find_compiler(environ: Mapping[str, str] = os.environ) -> str | None:
    for cand in ([environ["CC"]] if environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        path = shutil.which(cand)
        if path:
            return path
    return None


def build(out_dir: str | os.PathLike, *, cc: str | None = None, force: bool = False,
          extra_flags: tuple[str, ...] = ()) -> pathlib.Path:
    """Compile the plugin into ``out_dir``; returns the library's path. Raises ConfigError (no
    compiler, output exists without ``force``) or BuildError (the compiler failed)."""
    cc = cc or find_compiler()
    if cc is None:
        raise ConfigError("nccl-plugin build", "cc", "no C compiler found (set CC, or install gcc or clang)")
    src = source_dir() / SOURCE
    if not src.is_file():
        raise ConfigError("nccl-plugin build", str(src), "the plugin source is missing from this installation")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lib = out / LIBRARY
    if lib.exists() and not force:
        raise ConfigError("--out", str(lib), "exists (pass --force to replace it)")
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{LIBRARY}.", suffix=".tmp")
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, *extra_flags, "-I", str(src.parent), "-o", tmp, str(src), "-lpthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
            raise BuildError(f"{os.path.basename(cc)} failed (exit {proc.returncode}): {first}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib.resolve()


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("nccl-plugin", help="the NCCL profiler plugin (per-channel chunk states, per-step flows)")
    ps = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = ps.add_parser("build", help="compile libnccl-profiler-trainscope.so with this host's C compiler",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--out", default=os.path.join(".trainscope", "nccl"), help="directory for the library")
    b.add_argument("--cc", help="the C compiler (default: $CC, else cc, gcc, clang)")
    b.add_argument("--force", action="store_true", help="replace a library already at --out")
    b.set_defaults(func=cmd_nccl_plugin)
    return p


def cmd_nccl_plugin(args) -> int:
    t0 = time.monotonic()
    cc = args.cc and (shutil.which(args.cc) or None)
    if args.cc and cc is None:
        raise ConfigError("--cc", args.cc, "not found on PATH")
    cc = cc or find_compiler()
    if cc is None:
        raise ConfigError("nccl-plugin build", "cc", "no C compiler found (set CC, or install gcc or clang)")
    if (pathlib.Path(args.out) / LIBRARY).exists() and not args.force:
        raise ConfigError("--out", str(pathlib.Path(args.out) / LIBRARY), "exists (pass --force to replace it)")
    print(f"compiling {LIBRARY} with {cc} ...", file=sys.stderr)
    lib = build(args.out, cc=cc, force=args.force)
    size_kib = lib.stat().st_size / 1024
    print(f"built {lib} ({size_kib:.0f} KiB) in {time.monotonic() - t0:.1f} s")
    print(f"turn it on in every rank's environment: {env.NCCL_PROFILER_PLUGIN}={lib}")
    print(f"  with trainscope run: --set {env.NCCL_PROFILER_PLUGIN}={lib}")
    print(f"rings: {env.nccl_ring_dir()}/ring-<pid> (set {env.NCCL_DIR} to move them)")
    return 0


__all__ = ["BuildError", "LIBRARY", "add_parser", "build", "cmd_nccl_plugin", "find_compiler", "source_dir"]

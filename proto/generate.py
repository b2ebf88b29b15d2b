"""Regenerate the checked-in protobuf/gRPC modules from ``proto/v1/*.proto``
and ``proto/prompb/*.proto``.

Run from the repository root (needs the ``test`` extra, which has
grpcio-tools)::

    python proto/generate.py

The ``.proto`` files import each other as ``trainscope/proto/v1/<file>.proto``
so that the generated code imports ``trainscope.proto.v1.<file>_pb2``, the
name under which the package installs; protoc needs the sources laid out at
that path, so they are staged in a temporary tree first. ``prompb/`` (the
Prometheus remote write messages) is staged the same way and imports as
``trainscope.proto.prompb.remote_pb2``. The installed package
only needs ``protobuf`` and ``grpcio`` at run time, never grpcio-tools.
"""
from __future__ import annotations

import pathlib
import re
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
#: Source folders under proto/, each generated in place.
PACKAGES = ("v1", "prompb")
#: The runtime floor grpc_tools writes into each ``*_grpc.py`` (its own version: 1.85.4's tools write
#: '1.85.4', and the module then refuses a 1.85.1 runtime that pyproject allows) ...
_STAMP = re.compile(rb"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)


def _grpc_floor() -> bytes:
    """... is set to the grpcio floor pyproject.toml declares, so the generated code depends on the
    project's dependencies, not on which patch release of the tools generated it."""
    m = re.search(r'"grpcio>=([0-9.]+)"', (HERE.parent / "pyproject.toml").read_text())
    if m is None:
        raise SystemExit("pyproject.toml declares no grpcio>=X.Y.Z floor")
    return m.group(1).encode()


def _generated(f: pathlib.Path, floor: bytes) -> bytes:
    """A generated file's bytes, its gRPC stamp set to the project's floor."""
    return _STAMP.sub(b"GRPC_GENERATED_VERSION = '" + floor + b"'", f.read_bytes())


def main(argv: list[str] | None = None) -> int:
    """Regenerate in place; with ``--check``, only report files that differ (exit 1)."""
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    from grpc_tools import protoc  # imported here: a build-time dependency only
    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    floor = _grpc_floor()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        out = root / "out"
        out.mkdir()
        staged_files = []
        for pkg in PACKAGES:
            staged = root / "in" / "trainscope" / "proto" / pkg
            staged.mkdir(parents=True)
            for p in sorted((HERE / pkg).glob("*.proto")):
                shutil.copy(p, staged / p.name)
                staged_files.append(str(staged / p.name))
        args = [
            "protoc",
            f"-I{root / 'in'}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *staged_files,
        ]
        rc = protoc.main(args)
        if rc != 0:
            print(f"protoc failed with exit code {rc}", file=sys.stderr)
            return rc
        stale = []
        for pkg in PACKAGES:
            src = HERE / pkg
            gen = out / "trainscope" / "proto" / pkg
            if check:
                want = {f.name: _generated(f, floor) for f in gen.iterdir()
                        if f.suffix in (".py", ".pyi")
                        and not (f.name.endswith("_grpc.py") and b"Stub" not in f.read_bytes())}
                have = {f.name: f.read_bytes() for f in src.glob("*_pb2*.py*")}
                stale += [f"{pkg}/{n}" for n in sorted(set(want) | set(have)) if want.get(n) != have.get(n)]
                continue
            for old in src.glob("*_pb2*.py*"):
                old.unlink()
            for f in sorted(gen.iterdir()):
                # protoc writes an empty *_grpc.py for files without a service.
                if f.name.endswith("_grpc.py") and "Stub" not in f.read_text():
                    continue
                if f.suffix in (".py", ".pyi"):
                    (src / f.name).write_bytes(_generated(f, floor))
                    print(f"wrote {src / f.name}")
        if stale:
            print("generated code is stale, run `python proto/generate.py`: " + ", ".join(stale),
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Dependencies point one way (docs/architecture.md): read from the source, not from a diagram.

Every module of the five stage folders is parsed with ``ast``; every
``import``/``from ... import`` of a ``trainscope`` module (at any depth: a
call-time import is still a dependency) becomes an edge. The rules:

1. ``collector/`` (code that runs inside the training process) imports only
   ``trainscope.proto`` and itself.
2. ``proto/`` imports only itself.
3. Stages are layered proto → collector, processor → analyzer → deploy: no
   module imports a stage to its right, except ``deploy`` (the composition root)
   which may import all of them.
4. No import cycle among trainscope modules.
5. Contracts are spelled once, in ``proto/``: the ingest stream's method and
   metadata keys, environment variable names, signal and window-mode names
   (compared, passed or offered as ``choices`` as enum members, not literals),
   ``unix:`` targets (``env.unix_path``); and no re-export shims.
"""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STAGES = ("proto", "collector", "processor", "analyzer", "deploy")
#: What each stage may import besides itself.
ALLOWED = {
    "proto": {"proto"},
    "collector": {"proto"},
    "processor": {"proto"},
    "analyzer": {"proto", "processor"},
    "deploy": {"proto", "collector", "processor", "analyzer"},
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for stage in STAGES:
        for p in (ROOT / stage).rglob("*.py"):
            if p.name.endswith("_pb2.py") or p.name.endswith("_pb2_grpc.py"):
                continue  # generated: imports only protobuf and its siblings
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods["trainscope." + ".".join(parts)] = p
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The trainscope modules ``name`` imports (a package's ``from pkg import mod`` names the module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("trainscope."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("trainscope."):
                continue
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod)
    return {m for m in out if m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    """{module: the trainscope modules it imports}, parsed on first use: every pytest-xdist worker imports
    this file to collect it; only the one that runs these tests reads the sources."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def _stage(module: str) -> str:
    return module.split(".")[1]


def test_the_graph_is_read():
    """The walk finds the stages and real edges (a broken walk would pass every rule below)."""
    assert {_stage(m) for m in MODULES} == set(STAGES)
    assert "trainscope.proto.env" in graph()["trainscope.collector.sdk"]
    assert "trainscope.processor.daemon" in graph()["trainscope.deploy.embedded"]


@pytest.mark.parametrize("stage", STAGES)
def test_stage_imports_only_what_it_may(stage):
    bad = sorted(f"{m} -> {d}" for m, deps in graph().items() if _stage(m) == stage
                 for d in deps if _stage(d) != stage and _stage(d) not in ALLOWED[stage])
    assert not bad, f"{stage}/ may import only {sorted(ALLOWED[stage])}:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_what_the_start_up_hook_imports_is_standard_library_only():
    """``collector/bootstrap/_trainscope_boot.py`` runs in every Python process of a job (launchers,
    data-loader workers): at import time it and what it imports from trainscope (``proto/env.py``
    and, through it, ``proto/errors.py``) may import only the standard library. (Only a process
    found to be a rank imports the collector, inside ``boot()``.)"""
    import sys

    files = ["collector/bootstrap/_trainscope_boot.py", "proto/env.py", "proto/errors.py"]
    for rel in files:
        tree = ast.parse((ROOT / rel).read_text())
        top = set()
        for node in tree.body:  # module level: what importing the file costs
            if isinstance(node, ast.Import):
                top.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                top.add(node.module)
        ours = {m for m in top if m.startswith("trainscope.")}
        assert ours <= {"trainscope.proto.env", "trainscope.proto.errors"}, (rel, ours)
        others = {m.split(".")[0] for m in top - ours}
        assert others <= set(sys.stdlib_module_names) | {"__future__"}, (rel, others - set(sys.stdlib_module_names))


def test_no_module_imports_scipy_stats_at_import_time():
    """``scipy.stats`` costs ~1.8 s to import on these machines: a module-level import of it made every
    ``trainscope replay`` and query, and every analyzer start, that much slower (``sequential`` did, for
    one MAD). Only a function that needs it (Student's t) imports it, when called."""
    bad = []
    for path in sorted(p for stage in STAGES for p in (ROOT / stage).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "scipy.stats" or m.startswith("scipy.stats.") for m in mods):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def test_environment_values_are_parsed_one_way():
    """proto/env.py: unset and empty mean the default; a bad value names the variable."""
    from trainscope.proto import env
    from trainscope.proto.errors import ConfigError

    e = {env.PROMETHEUS_PORT: "9100", env.STACKS: "Off", env.SHUTDOWN_TIMEOUT_S: "", env.HOME: "/h"}
    assert env.integer(env.PROMETHEUS_PORT, None, e) == 9100
    assert env.integer(env.WORLD_SIZE, 1, e) == 1
    assert env.switch(env.STACKS, True, e) is False and env.switch(env.CUPTI, True, e) is True
    assert env.number(env.SHUTDOWN_TIMEOUT_S, 3.0, e) == 3.0
    assert env.text(env.HOME, "", e) == "/h" and env.text(env.PROCESSOR, "d", e) == "d"
    with pytest.raises(ConfigError, match=env.PROMETHEUS_PORT):
        env.integer(env.PROMETHEUS_PORT, None, {env.PROMETHEUS_PORT: "ninety"})
    with pytest.raises(ConfigError, match=env.SHIP_INTERVAL_S):
        env.number(env.SHIP_INTERVAL_S, 1.0, {env.SHIP_INTERVAL_S: "1s"})
    assert env.identity({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}) == (3, 8, 1)


# ------------------------------------------------ contracts spelled once, in proto/
def _sources(*, tests: bool = False):
    """(path, tree) of every module outside ``proto/`` (and of tests/, without this file)."""
    paths = [p for name, p in MODULES.items() if _stage(name) != "proto"]
    if tests:
        paths += [p for p in (ROOT / "tests").rglob("*.py") if p.resolve() != pathlib.Path(__file__).resolve()]
    for p in paths:
        yield p.relative_to(ROOT), _tree(p)


@functools.lru_cache(maxsize=None)
def _tree(path: pathlib.Path) -> ast.Module:
    """One parse per file per test process (six checks read every source; the trees are not modified)."""
    return ast.parse(path.read_text(), str(path))


def _strings(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node


def test_the_ingest_stream_names_are_spelled_only_in_proto():
    """The method, service and restart-metadata keys of the ingest stream: ``proto/contracts.py``."""
    from trainscope.proto import contracts

    names = {contracts.INGEST_METHOD, contracts.INGEST_SERVICE, contracts.BOOT_METADATA,
             contracts.SENDER_METADATA, contracts.REPLAY_METADATA}
    bad = [f"{path}:{n.lineno} {n.value!r}" for path, tree in _sources(tests=True)
           for n in _strings(tree) if n.value in names]
    assert not bad, "import these from trainscope.proto.contracts:\n" + "\n".join(bad)


def test_environment_variable_names_are_spelled_only_in_proto_env():
    import re

    bad = [f"{path}:{n.lineno} {n.value!r}" for path, tree in _sources()
           for n in _strings(tree) if re.fullmatch(r"(TRAINSCOPE|KAFKA)_[A-Z0-9_]+", n.value)]
    assert not bad, "name the variable in trainscope/proto/env.py and use it from there:\n" + "\n".join(bad)


def test_signal_and_window_mode_names_are_enum_members_not_literals():
    """``x.signal == "kernels"``, ``mode in ("time", ...)``, ``store.records("kernels")``: use
    ``Signal`` / ``WindowMode`` (a str enum member equals its value, so nothing else changes)."""
    from trainscope.proto.contracts import SIGNALS, WINDOW_MODES

    names = {s.value for s in SIGNALS} | {m.value for m in WINDOW_MODES}

    def literals(node):
        if isinstance(node, ast.Constant):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant)]
        return []

    bad = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(v in names for s in sides for v in literals(s)) and any(
                        w in ast.unparse(s).lower() for s in sides if not literals(s) for w in ("signal", "mode")):
                    bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                if any(w in func for w in ("records", "topic_for")) and any(
                        v in names for a in node.args for v in literals(a)):
                    bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
                bad += [f"{path}:{node.lineno} {k.arg}={k.value.value!r}" for k in node.keywords
                        if k.arg in ("signal", "mode", "window_mode") and isinstance(k.value, ast.Constant)
                        and k.value.value in names]
                bad += [f"{path}:{node.lineno} choices={ast.unparse(k.value)}" for k in node.keywords
                        if k.arg == "choices" and len(literals(k.value)) > 1 and set(literals(k.value)) <= names]
    assert not bad, "use trainscope.proto.contracts.Signal / WindowMode:\n" + "\n".join(bad)


def test_no_hand_stripping_of_unix_targets():
    bad = [f"{path}" for path, tree in _sources()
           if 'len("unix:' in (ROOT / path).read_text() or "len('unix:" in (ROOT / path).read_text()]
    assert not bad, "use trainscope.proto.env.unix_path:\n" + "\n".join(bad)


def test_no_re_export_shims():
    """A 0.1.0 tree has no importers to keep happy: import a name from the module that defines it."""
    bad = [f"{path}" for path, _ in _sources(tests=True) if "re-export" in (ROOT / path).read_text().lower()]
    assert not bad, "re-export shims:\n" + "\n".join(bad)


def test_the_unit_tier_starts_no_process():
    """tests/unit starts no processes (tests/conftest.py's tiers): no subprocess or multiprocessing
    import and no os.fork there; such tests belong in tests/integration."""
    bad = []
    for path in sorted((ROOT / "tests" / "unit").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("subprocess", "multiprocessing") for n in names):
                bad.append(f"{path.name}:{node.lineno}")
            if (isinstance(node, ast.Attribute) and node.attr in ("fork", "forkpty")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, "processes started in the unit tier:\n" + "\n".join(bad)


def test_every_stage_package_is_installed():
    """`pip install .` ships only the packages pyproject.toml lists: a new stage subpackage left out
    installs nothing (analyzer/deepdive was missing, so the installed `trainscope analyzer` could not
    import its deep-dive follower)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"trainscope." + ".".join(p.parent.relative_to(ROOT).parts)
             for stage in ("collector", "processor", "analyzer", "proto", "deploy")
             for p in (ROOT / stage).rglob("__init__.py")}
    assert found - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"

"""Issue #12 item 4: every flag's help shows its default; the docs' relative links resolve.

No processes: the argparse tree is walked in memory, the Markdown files read from the tree.
"""
from __future__ import annotations

import argparse
import pathlib
import re

import pytest

from trainscope.deploy.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _parsers(parser: argparse.ArgumentParser, path: str = "trainscope"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def _options():
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS:
                yield path, parser, action


def test_the_walk_sees_every_subcommand():
    names = {p for p, _ in _parsers(build_parser())}
    for cmd in ("demo", "processor", "analyzer", "replay", "sim", "run", "report", "query verdict",
                "query kernels", "query iterations"):
        assert f"trainscope {cmd}" in names, names


@pytest.mark.parametrize("path,parser,action", list(_options()),
                         ids=lambda x: x if isinstance(x, str) else getattr(x, "dest", ""))
def test_every_option_help_shows_its_default(path, parser, action):
    """Each option's rendered help says its default (switches: off unless given, so exempt)."""
    if action.nargs == 0:  # --force, --json, --help, --version: a switch has no value to default
        return
    help_text = parser.formatter_class(prog=path)._expand_help(action) if action.help else ""
    if action.required:  # no default to show: it says it is required instead
        assert help_text.endswith("(required)") and "default" not in help_text.lower(), (path, help_text)
        return
    assert help_text, f"{path} {action.option_strings[0]} has no help"
    assert re.search(r"default", help_text, re.I), f"{path} {action.option_strings[0]}: {help_text!r}"
    if action.default not in (None, [], argparse.SUPPRESS) and "%(default)" not in (action.help or ""):
        # a stated default must be the real one (catches help text drifting from the code)
        shown = str(action.default)
        assert shown in help_text or (isinstance(action.default, float) and f"{action.default:g}" in help_text), \
            f"{path} {action.option_strings[0]}: default {action.default!r} not in {help_text!r}"


def _help(path, parser, action) -> str:
    return parser.formatter_class(prog=path)._expand_help(action) if action.help else ""


@pytest.mark.parametrize("path,parser,action", list(_options()),
                         ids=lambda x: x if isinstance(x, str) else getattr(x, "dest", ""))
def test_every_option_says_what_it_does(path, parser, action):
    """Not only its default: sim's --seed or processor's --window-length-s showed just '(default: none)'."""
    text = re.sub(r"\(default[^)]*\)|\(required\)|default:? [\w./-]+", "", _help(path, parser, action)).strip(" ;,")
    assert len(text) >= 5, f"{path} {action.option_strings[0]}: no description in {_help(path, parser, action)!r}"


#: The config dataclass behind a subcommand's flags (a flag left at ``default=None`` takes the field's
#: default), and the flags whose field has another name.
_CONFIGS = {"trainscope sim": ("trainscope.collector.sim.config", "SimConfig"),
            "trainscope analyzer": ("trainscope.deploy.analyzer_daemon", "AnalyzerDaemonConfig"),
            "trainscope run": ("trainscope.deploy.launcher", "RunConfig")}
_FIELD = {"iteration_time": "iteration_s"}


def _config_default(path: str, dest: str):
    import dataclasses
    import importlib

    if path not in _CONFIGS:
        return None
    module, name = _CONFIGS[path]
    fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    f = fields.get(_FIELD.get(dest, dest))
    if f is None or f.default is dataclasses.MISSING or f.default in (None, "", ()):
        return None
    return getattr(f.default, "value", f.default)  # a str enum (WindowMode) as the value a user types


@pytest.mark.parametrize("path,parser,action", [(p, pa, a) for p, pa, a in _options() if p in _CONFIGS],
                         ids=lambda x: x if isinstance(x, str) else getattr(x, "dest", ""))
def test_a_flag_left_to_its_config_states_the_configs_default(path, parser, action):
    """A ``default=None`` flag falls back to its config dataclass's default, so its help must state that
    value: sim's --seed/--job-id/--exporters said '(default: none)' for 0, sim and 4, and
    --iteration-time said 'e.g. 3s (default)' with no value."""
    if action.default is not None or action.nargs == 0:
        return
    real = _config_default(path, action.dest)
    if real is None:
        return
    text = _help(path, parser, action)
    shown = {str(real), f"{real:g}" if isinstance(real, float) else str(real)}
    assert "default: none" not in text.lower() and re.search(
        r"default:? (" + "|".join(re.escape(x) for x in shown) + r")s?\b", text), \
        f"{path} {action.option_strings[0]}: the config's default is {real!r}; help says {text!r}"


def test_top_level_help_is_for_users():
    """It showed cli.py's docstring ('parse into configs, call a facade, render')."""
    text = build_parser().format_help()
    assert "facade" not in text and "``" not in text and "trainscope demo" in text


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    from trainscope.deploy.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"trainscope {version('trainscope')}"


def test_help_renders_for_every_parser():
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "usage:" in text, path


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_relative_links_point_at_files_that_exist(doc):
    missing = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # URLs and in-page anchors
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{doc.name}: links to missing files: {missing}"


def test_readme_layout_table_matches_the_tree():
    """Every folder the README's layout table names exists, and every top-level package folder is named."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w.-]+)/` \|", section, re.M))
    assert named, "no layout table"
    for folder in named:
        assert (ROOT / folder).is_dir(), f"README layout names {folder}/ which is not in the tree"
    present = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
               and not p.name.endswith(".egg-info")}
    # folders .gitignore names (build/ left by the README's own `pip install .`, dist/) are not the tree's
    ignore = (ROOT / ".gitignore").read_text().split() if (ROOT / ".gitignore").exists() else []
    present -= {g.strip("/") for g in ignore if g.endswith("/") and not any(c in g for c in "*?[")}
    assert present <= named, f"folders missing from the README layout: {sorted(present - named)}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_file_paths_named_in_backticks_exist(doc):
    """`some/path.py` in the prose names a file of this repository (relative to the root, the document
    or a top-level folder, as the prose reads it); ../shared/ papers and placeholders like <name> excepted."""
    tops = [ROOT, doc.parent, *(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))]
    missing = []
    for t in re.findall(r"`([\w./<>*-]+)`", doc.read_text()):
        if "/" not in t or any(c in t for c in "<*") or t.startswith(("/", "../")):
            continue
        if not re.search(r"\.(py|md|yml|yaml|proto|json|sh|toml|txt)$|/$", t):
            continue
        if not any((base / t).exists() for base in tops):
            missing.append(t)
    assert not missing, f"{doc.name}: names files that are not in the repo: {missing}"


def test_no_parser_takes_an_abbreviated_flag():
    """Issue #24 item 3: ``--token SECRET`` was taken for ``--token-file`` and ``--kafka-sasl-password SECRET`` for
    ``--kafka-sasl-password-file``, the secret left in ``ps``. Every parser refuses a flag not spelt whole."""
    assert all(not parser.allow_abbrev for _, parser in _parsers(build_parser()))
    for argv in (["processor", "--token", "s3cret"], ["processor", "--kafka-sasl-password", "s3cret"],
                 ["analyzer", "--kafka-sasl-password", "s3cret"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2, argv

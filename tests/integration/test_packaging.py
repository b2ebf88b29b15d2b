"""The checked-in generated code matches proto/, and every package folder installs."""
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_protobuf_code_is_reproducible_from_proto():
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_python_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]))
    assert found == listed


def test_installed_runtime_does_not_need_grpc_tools():
    code = ("import sys; sys.modules['grpc_tools'] = None; "
            "import trainscope.processor.daemon, trainscope.collector.sdk, trainscope.deploy.cli")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

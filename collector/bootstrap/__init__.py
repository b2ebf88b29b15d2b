"""The directory ``trainscope run`` puts first on ``PYTHONPATH``.

Its ``sitecustomize.py`` runs at the start of every Python process of the job
and starts the collector only in rank processes (``_trainscope_boot.select``,
ARGUS Appendix A: selective injection). Nothing here is imported by the hook
itself through this package: the hook loads ``_trainscope_boot.py`` by path,
so a process that is not a rank pays for one small stdlib-only module.

Also here: ``AfterImport`` (run a callback once a module, e.g. torch, has been
imported by the program) and ``install_autostart_pth`` (the one-variable
alternative to PYTHONPATH for launchers that cannot be wrapped).
"""
import importlib.abc
import importlib.util
import os
import sys

DIR = os.path.dirname(os.path.abspath(__file__))
"""Put this directory first on PYTHONPATH to enable the hook."""


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` right after ``name`` has been imported (once)."""

    def __init__(self, name: str, callback) -> None:
        self.name, self.callback, self._busy = name, callback, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, hook = spec.loader, self
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                sys.meta_path.remove(hook)
            except ValueError:
                pass
            try:
                hook.callback(module)
            except Exception as e:
                print(f"trainscope: instrumentation after importing {hook.name} failed: {e}", file=sys.stderr)

        loader.exec_module = exec_module
        return spec


def install_autostart_pth(site_dir: str | None = None) -> str:
    """Write ``trainscope-autostart.pth`` so ``TRAINSCOPE_AUTOSTART=1`` alone enables collection."""
    import site
    site_dir = site_dir or site.getsitepackages()[0]
    boot = os.path.join(DIR, "_trainscope_boot.py")
    line = ("import os; exec(\"if os.environ.get('TRAINSCOPE_AUTOSTART', '0') not in ('', '0'):\\n"
            " import importlib.util as u\\n"
            f" s = u.spec_from_file_location('_trainscope_boot', {boot!r}); m = u.module_from_spec(s)\\n"
            " try:\\n  s.loader.exec_module(m); m.boot()\\n except Exception:\\n  pass\")\n")
    path = os.path.join(site_dir, "trainscope-autostart.pth")
    with open(path, "w") as f:
        f.write(line)
    return path

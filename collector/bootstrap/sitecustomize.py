"""trainscope's start-up hook (imported by ``site`` because its directory is on PYTHONPATH).

1. Chain: run the ``sitecustomize`` this one shadows, if any (a distribution's
   or a virtualenv's), so enabling trainscope changes nothing else.
2. Boot: load ``_trainscope_boot.py`` (stdlib only) by path and let it decide
   whether this process is a rank; only then is the collector imported.
Never raises: a failure here must not stop the user's program.
"""


def _trainscope_chain() -> None:
    import importlib
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        del sys.modules["sitecustomize"]
        try:
            importlib.import_module("sitecustomize")
        except ImportError:
            sys.modules["sitecustomize"] = me
    finally:
        sys.path[:] = saved


def _trainscope_start() -> None:
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trainscope_boot.py")
    spec = importlib.util.spec_from_file_location("_trainscope_boot", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.boot()


for _step in (_trainscope_chain, _trainscope_start):
    try:
        _step()
    except BaseException:  # noqa: BLE001 - never break the user's interpreter start-up
        pass
del _step

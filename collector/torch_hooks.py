"""Automatic PyTorch instrumentation: phases and iterations with no change to training code.

``install(collector)`` (called by ``launch`` in every rank process, or by hand)
wraps a few call sites where semantic boundaries are clear (ARGUS §4.2):

1. ``DataLoader`` iterators' ``__next__`` → phase ``dataloader`` (host clock:
   loading is host work) and a ``D`` event for the iteration detector.
2. ``Optimizer.step`` of every optimizer, through torch's global step hooks →
   phase ``optimizer`` and an ``O`` event (EROICA §4.1). Nested steps (an
   optimizer wrapping another) are timed once, at the outermost.
3. Forward of the top-level module(s): global module hooks watch which
   modules with parameters are called outside any other module's forward,
   then hooks move onto those modules and the global ones are removed (a
   global hook would cost a Python call per submodule). ``backward``: the
   outermost ``torch.autograd.backward`` call (``loss.backward()``).
4. ``torch.distributed`` collectives and point-to-point calls → phases named
   ``<role>-<op>`` (``dp-allreduce``, ``tp-allgather``...), the role coming
   from groups the framework declared (``declare_groups``; ``launch`` has the
   Megatron and DeviceMesh conventions). Async handles are timed to
   completion: on CPU backends by the work's future callback, on NCCL by the
   process group's own events on the NCCL stream (``TORCH_NCCL_ENABLE_TIMING``),
   which the poller reads without synchronising (``cuda_phases``).
   Each collective (not point-to-point) is also a record with its group's
   sequence number (``collective_log``, Mycroft §4.2); DDP's all-reduces,
   issued from C++, are relayed through the wrapped ``all_reduce`` by a
   communication hook (``torch_ddp``).
5. The iteration detector turns D/O events into iteration marks.

Rank and world size follow ``init_process_group`` when the environment did
not give them. Every wrapper calls straight through when the hooks are off
(in a forked child, after ``uninstall``) and swallows its own errors: user
code sees its own exceptions only, never ours.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from trainscope.collector.collective_log import CollectiveLog, CollectiveLogConfig
from trainscope.collector.cuda_phases import Phases, PhaseTimerConfig, activate
from trainscope.collector.iteration_detector import (
    DATALOADER, OPTIMIZER, IterationDetector, IterationDetectorConfig)
from trainscope.collector.torch_collectives import CollectiveHooks
from trainscope.proto.errors import ConfigError

log = logging.getLogger(__name__)

_tls = threading.local()
_CURRENT: "TorchHooks | None" = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TorchHooksConfig:
    dataloader: bool = True
    """Wrap ``DataLoader`` iterators' ``__next__``."""
    optimizer: bool = True
    """Hook every optimizer's ``step``."""
    module: bool = True
    """Time forward of the top-level module(s) and the outermost backward."""
    collectives: bool = True
    """Wrap ``torch.distributed`` collectives and point-to-point calls."""
    collective_records: bool = True
    """Also emit one record per collective with the group's sequence number (``collective_log``)."""
    ddp_comm_hook: bool = True
    """Relay DDP's bucket all-reduces through the wrapped ``all_reduce`` (``torch_ddp``)."""
    collective_log: CollectiveLogConfig = dataclasses.field(default_factory=CollectiveLogConfig)
    """Shipping of collective records."""
    iterations: bool = True
    """Detect iterations from the data-loader/optimizer sequence (EROICA §4.1)."""
    learn_forwards: int = 3
    """Top-level forwards watched with global module hooks before they move onto the model."""
    detector: IterationDetectorConfig = dataclasses.field(default_factory=IterationDetectorConfig)
    """Iteration detection settings."""
    phases: PhaseTimerConfig = dataclasses.field(default_factory=PhaseTimerConfig)
    """CUDA-event phase timing settings."""

    def __post_init__(self) -> None:
        if type(self.learn_forwards) is not int or self.learn_forwards < 1:
            raise ConfigError("torch_hooks.learn_forwards", self.learn_forwards, "must be an integer >= 1")


def _depth(name: str) -> int:
    return getattr(_tls, name, 0)


class TorchHooks(CollectiveHooks):
    """Installs and removes the wrappers; holds the phase timer and iteration detector.

    The collective wrappers and the declared groups (step 4) are in ``torch_collectives.py``."""

    def __init__(self, collector, config: TorchHooksConfig = TorchHooksConfig(), *,
                 on_resource: Callable[[Any], None] | None = None) -> None:
        self.collector = collector
        self.config = config
        self.detector = IterationDetector(self._on_iteration, config.detector)
        self.phases = Phases(collector, config.phases,
                             iteration=self._current_iteration if config.iterations else None)
        self.active = False
        self.errors = 0
        self._on_resource = on_resource
        self._undo: list[Callable[[], None]] = []
        self._owner: int | None = None
        self._roles: dict[int, tuple[Any, str]] = {}
        self._backends: dict[int, str] = {}
        self._role_cache: dict[int, str] = {}
        self._group_infos: dict[int, tuple | None] = {}
        submit = getattr(getattr(collector, "exporter", None), "submit", None)
        self.collective_log = (CollectiveLog(submit, config.collective_log)
                               if config.collectives and config.collective_records and submit else None)
        self._top: "weakref.WeakSet" = weakref.WeakSet()
        self._seen_forwards = 0
        self._global_module_hooks: list = []
        self.first_step = threading.Event()
        """Set when the first optimizer step ends: training has begun."""
        self.deep_dive = None
        """A ``collector.deep_dive.DeepDiveWindow`` whose boundaries are the iterations' first batches."""

    # -------------------------------------------------------------- install
    def install(self) -> "TorchHooks":
        """Wrap the call sites (idempotent). Imports torch: call it once torch is importable."""
        global _CURRENT
        if self._undo:
            return self
        import torch  # noqa: F401  (lazy: the collector works without torch)
        cfg = self.config
        steps = [("dataloader", cfg.dataloader, self._install_dataloader),
                 ("optimizer", cfg.optimizer, self._install_optimizer),
                 ("module", cfg.module, self._install_module),
                 ("collectives", cfg.collectives, self._install_collectives)]
        for name, on, fn in steps:
            if on:
                try:
                    fn()
                except Exception:
                    log.warning("trainscope: could not hook %s; continuing without it", name, exc_info=True)
        self.active = True
        _CURRENT = self
        activate(self.phases)  # the user-facing phase() marks phases on this timer
        hooks_ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _disable_in_child(hooks_ref))
        return self

    def uninstall(self) -> None:
        global _CURRENT
        self.active = False
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:
                log.debug("undo failed", exc_info=True)
        self._undo.clear()
        self._remove_global_module_hooks()
        self.phases.stop()
        self.stop_collectives()
        if _CURRENT is self:
            _CURRENT = None
            activate(None)

    def stop_collectives(self) -> None:
        """Ship the collective records left (before the exporter's final flush)."""
        if self.collective_log is not None:
            self._guard(self.collective_log.stop)

    def _patch(self, owner, attr: str, new) -> None:
        old = owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, old))

    # ----------------------------------------------------- shared plumbing
    def _current_iteration(self) -> int:
        return self.detector.current

    def _on_iteration(self, n: int, start_ns: int, end_ns: int) -> None:
        self.collector.iteration(n, start_ns=start_ns, end_ns=end_ns)

    def _event(self, symbol: str, start_ns: int, end_ns: int) -> None:
        if not self.config.iterations:
            return
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        if me == self._owner:  # the detector follows one training loop
            self.detector.event(symbol, start_ns, end_ns)

    def _guard(self, fn: Callable, *a) -> Any:
        try:
            return fn(*a)
        except Exception:
            self.errors += 1
            log.debug("trainscope hook failed", exc_info=True)
            return None

    # ----------------------------------------------------------- dataloader
    def _install_dataloader(self) -> None:
        from torch.utils.data import dataloader as dl

        orig = dl._BaseDataLoaderIter.__next__
        hooks = self

        @functools.wraps(orig)
        def __next__(it):
            if not hooks.active:
                return orig(it)
            dd = hooks.deep_dive
            if dd is not None and dd.busy:  # a deep-dive window opens/closes before the iteration's first batch
                hooks._guard(hooks._deep_dive_boundary, dd)
            span = hooks.phases.begin("dataloader", device_side=False)
            wall = time.time_ns()
            batch = orig(it)  # StopIteration and loader errors pass through untouched
            hooks._guard(hooks._after_next, span, wall)
            return batch

        self._patch(dl._BaseDataLoaderIter, "__next__", __next__)

    def _deep_dive_boundary(self, dd) -> None:
        if self._owner in (None, threading.get_ident()):  # the training loop's thread only
            dd.before_batch(self.detector.opening())

    def _after_next(self, span, wall: int) -> None:
        self._event(DATALOADER, wall, time.time_ns())  # first: a D may open the next iteration
        if span is not None:
            span.iteration = self.detector.current if self.config.iterations else span.iteration
        self.phases.end(span)

    # ------------------------------------------------------------ optimizer
    def _install_optimizer(self) -> None:
        from torch.optim import optimizer as optim

        h1 = optim.register_optimizer_step_pre_hook(lambda opt, a, k: self._guard(self._opt_pre, opt))
        h2 = optim.register_optimizer_step_post_hook(lambda opt, a, k: self._guard(self._opt_post, opt))
        self._undo += [h1.remove, h2.remove]

    def _opt_pre(self, opt) -> None:
        if not self.active:
            return
        stack = getattr(_tls, "opt", None)
        if stack is None:
            stack = _tls.opt = []
        if any(o is opt for o, _, _ in stack):  # left over from a step that raised
            stack.clear()
        stack.append((opt, self.phases.begin("optimizer") if not stack else None, time.time_ns()))
        if self._global_module_hooks and self._top:
            self._settle_top_modules()  # the model is known once it has stepped

    def _opt_post(self, opt) -> None:
        stack = getattr(_tls, "opt", None)
        while stack:
            o, span, wall = stack.pop()
            if o is opt:
                break
        else:
            return
        if stack:
            return  # nested step
        self.phases.end(span)
        self._event(OPTIMIZER, wall, time.time_ns())
        if not self.first_step.is_set():
            self.first_step.set()

    # ------------------------------------------------------- module forward
    def _install_module(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module

        h1 = nn_module.register_module_forward_pre_hook(self._g_pre)
        h2 = nn_module.register_module_forward_hook(self._g_post, always_call=True)
        self._global_module_hooks = [h1, h2]

        orig = torch.autograd.backward
        hooks = self

        @functools.wraps(orig)
        def backward(*a, **k):
            if not hooks.active or _depth("bwd"):
                return orig(*a, **k)
            _tls.bwd = 1
            span = hooks.phases.begin("backward")
            try:
                return orig(*a, **k)
            finally:
                _tls.bwd = 0
                hooks.phases.end(span)

        self._patch(torch.autograd, "backward", backward)

    def _g_pre(self, module, args) -> None:
        d = _depth("fwd")
        _tls.fwd = d + 1
        if d == 0 and self.active:
            self._guard(self._top_pre, module)

    def _g_post(self, module, args, out) -> None:
        d = _depth("fwd") - 1
        _tls.fwd = max(d, 0)
        if d == 0 and self.active:
            self._guard(self._top_post, module)

    def _top_pre(self, module) -> None:
        if next(module.parameters(), None) is None:
            return  # a loss function or other parameter-free top-level call
        self._top.add(module)
        _tls.fwd_span = self.phases.begin("forward")

    def _top_post(self, module) -> None:
        span = getattr(_tls, "fwd_span", None)
        if span is None:
            return
        _tls.fwd_span = None
        self.phases.end(span)
        self._seen_forwards += 1
        if self._seen_forwards >= self.config.learn_forwards:
            self._settle_top_modules()

    def _settle_top_modules(self) -> None:
        """Move forward timing from the global hooks onto the top-level modules seen."""
        self._remove_global_module_hooks()
        _tls.fwd = 0
        for m in list(self._top):
            h1 = m.register_forward_pre_hook(lambda mod, args: self._guard(self._m_pre))
            h2 = m.register_forward_hook(lambda mod, args, out: self._guard(self._m_post), always_call=True)
            self._undo += [h1.remove, h2.remove]

    def _m_pre(self) -> None:
        d = _depth("mfwd")
        _tls.mfwd = d + 1
        if d == 0 and self.active:
            _tls.fwd_span = self.phases.begin("forward")

    def _m_post(self) -> None:
        _tls.mfwd = max(_depth("mfwd") - 1, 0)
        if _tls.mfwd == 0:
            span, _tls.fwd_span = getattr(_tls, "fwd_span", None), None
            self.phases.end(span)

    def _remove_global_module_hooks(self) -> None:
        hs, self._global_module_hooks = self._global_module_hooks, []
        for h in hs:
            h.remove()


def _disable_in_child(ref) -> None:
    hooks = ref()
    if hooks is not None:
        hooks.active = False  # a forked child (data-loader worker) is not a rank


def current() -> TorchHooks | None:
    """The installed hooks of this process, if any."""
    return _CURRENT


def install(collector, config: TorchHooksConfig = TorchHooksConfig(), **kw) -> TorchHooks:
    return TorchHooks(collector, config, **kw).install()


__all__ = ["TorchHooks", "TorchHooksConfig", "current", "install"]

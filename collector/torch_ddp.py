"""DDP's gradient all-reduces through the collective hooks, by a communication hook.

``DistributedDataParallel`` issues its bucket all-reduces from C++ (the
reducer), so they never pass through the ``torch.distributed`` wrappers of
``torch_collectives``: no phase, no collective record. Every DDP module built
after ``install`` gets a communication hook (``register_comm_hook``) that
relays each bucket to:

1. by default ``default_hooks.allreduce_hook``: divide the bucket by the group
   size, then ``dist.all_reduce`` (SUM) — the arithmetic DDP's reducer does
   without a hook (it divides each gradient before the all-reduce), so the
   user's results are unchanged (tested bit for bit on a gloo job). That
   ``dist.all_reduce`` is the wrapped one: a ``dp-allreduce`` phase and a
   collective record with the group's sequence number.
   Exception: under ``Join`` (uneven inputs) DDP divides by the ranks still
   joined; set ``TRAINSCOPE_DDP_COMM_HOOK=0`` for such jobs.
2. a hook the user registers later (``register_comm_hook`` or
   ``register_builtin_comm_hook``, which DDP allows only once) replaces the
   relay's target instead of raising; its own ``dist`` calls are recorded too.

The profiler's c10d records were the alternative; they need the profiler
running, which always-on tracing cannot assume.
"""
from __future__ import annotations

import functools
import logging

from trainscope.proto import env

log = logging.getLogger(__name__)


class _Relay:
    """The state DDP hands the hook: where each bucket goes."""

    __slots__ = ("state", "hook")

    def __init__(self, process_group) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.state, self.hook = process_group, default_hooks.allreduce_hook


def _relay_hook(relay: _Relay, bucket):
    return relay.hook(relay.state, bucket)


def install_ddp(hooks) -> None:
    """Patch ``DistributedDataParallel`` (construction and hook registration); undone by ``uninstall``."""
    if not env.switch(env.DDP_COMM_HOOK, True):
        return   # no records for DDP's all-reduces
    from torch.nn.parallel import DistributedDataParallel as DDP

    init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook

    @functools.wraps(init)
    def __init__(ddp, *a, **k):
        init(ddp, *a, **k)
        if hooks.active:
            hooks._guard(_adopt, ddp, register)

    @functools.wraps(register)
    def register_comm_hook(ddp, state, hook):
        relay = getattr(ddp, "_trainscope_relay", None)
        if relay is None:
            return register(ddp, state, hook)
        relay.state, relay.hook = state, hook   # the user's hook, still relayed (recorded)

    @functools.wraps(builtin)
    def register_builtin_comm_hook(ddp, comm_hook_type):
        relay = getattr(ddp, "_trainscope_relay", None)
        target = _builtin(comm_hook_type) if relay is not None else None
        if target is None:
            return builtin(ddp, comm_hook_type)
        relay.state, relay.hook = ddp.process_group, target

    hooks._patch(DDP, "__init__", __init__)
    hooks._patch(DDP, "register_comm_hook", register_comm_hook)
    hooks._patch(DDP, "_register_builtin_comm_hook", register_builtin_comm_hook)


def _adopt(ddp, register) -> None:
    relay = _Relay(ddp.process_group)
    register(ddp, relay, _relay_hook)
    ddp._trainscope_relay = relay


def _builtin(comm_hook_type):
    """The Python equivalent of a built-in C++ hook, when there is one."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}.get(comm_hook_type)


__all__ = ["install_ddp"]

"""torch.distributed collectives as phases named by the group's role, and the rank's declared groups.

Step 4 of ``torch_hooks`` (its module docstring): collectives and
point-to-point calls become phases ``<role>-<op>`` (``dp-allreduce``,
``tp-allgather``...), the role coming from groups the framework declared
(``declare_groups``; ``launch`` has the Megatron and DeviceMesh conventions).
Async handles are timed to completion: on CPU backends by the work's future
callback, on NCCL by the process group's own events on the NCCL stream
(``TORCH_NCCL_ENABLE_TIMING``), read without synchronising (``cuda_phases``).
After ``init_process_group`` the rank's identity follows torch.distributed.

:class:`CollectiveHooks` is a part of :class:`~trainscope.collector.torch_hooks.TorchHooks`
(which it is mixed into): it uses that object's ``collector``, ``phases``,
``active``, ``_patch``, ``_guard``, ``_on_resource`` and its role caches.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time

from trainscope.proto import env
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import DIMS, ParallelCoords, coords_for_rank

#: torch.distributed functions wrapped, with the op name used in phase names.
COLLECTIVES = {
    "all_reduce": "allreduce", "all_gather": "allgather", "all_gather_into_tensor": "allgather",
    "reduce_scatter": "reducescatter", "reduce_scatter_tensor": "reducescatter",
    "broadcast": "broadcast", "reduce": "reduce", "all_to_all": "alltoall",
    "all_to_all_single": "alltoall", "barrier": "barrier", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "isend": "send", "irecv": "recv",
    "all_gather_object": "allgather", "broadcast_object_list": "broadcast",
    # torch >= 2.10's single-tensor entry points (FSDP2's all-gather and reduce-scatter call these:
    # without them a fully_shard job produced no collective record) and the coalesced ones
    "all_gather_single": "allgather", "reduce_scatter_single": "reducescatter",
    "all_reduce_coalesced": "allreduce", "all_gather_coalesced": "allgather",
    "_all_gather_base": "allgather", "_reduce_scatter_base": "reducescatter",
}
#: Argument names holding this rank's input where the output comes first (all-gather, reduce-scatter).
INPUT_ARGS = ("input_tensor", "input", "input_tensor_list", "input_list", "tensor")
#: Point-to-point calls: not collectives of the whole group (no group sequence number).
P2P = frozenset({"send", "recv"})
log = logging.getLogger(__name__)
_tls = threading.local()  # "coll": inside a wrapped collective (a collective calling another is timed once)


def _payload(a, k, ii: int | None = None, iname: str = "") -> tuple[int, str]:
    """Bytes and dtype of a collective's input (argument ``ii``/``iname`` when the signature has one,
    else its first tensor argument; a list: summed)."""
    import torch

    if ii is not None and (ii < len(a) or iname in k):
        first = a[ii] if ii < len(a) else k[iname]
    else:
        first = a[0] if a else next(iter(k.values()), None)
    tensors = first if isinstance(first, (list, tuple)) else [first]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0, ""
    return sum(t.numel() * t.element_size() for t in tensors), str(tensors[0].dtype).removeprefix("torch.")


class CollectiveHooks:
    def _install_collectives(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import distributed_c10d as c10d

        init = c10d.init_process_group

        @functools.wraps(init)
        def init_process_group(*a, **k):
            out = init(*a, **k)
            if self.active:
                self._guard(self._adopt_dist_identity)
            return out

        self._patch(c10d, "init_process_group", init_process_group)
        self._patch(dist, "init_process_group", init_process_group)
        if self.config.ddp_comm_hook:
            from trainscope.collector.torch_ddp import install_ddp
            try:
                install_ddp(self)
            except Exception:   # an old torch without comm hooks: DDP stays unrecorded
                log.warning("trainscope: could not hook DDP; its all-reduces are not recorded", exc_info=True)
        for fname, op in COLLECTIVES.items():
            fn = getattr(c10d, fname, None)
            if fn is None or getattr(fn, "__trainscope__", False):
                continue
            params = list(inspect.signature(fn).parameters)
            wrapped = self._wrap_collective(fn, op, params)
            self._patch(c10d, fname, wrapped)
            if getattr(dist, fname, None) is fn:
                self._patch(dist, fname, wrapped)

    def _wrap_collective(self, fn, op: str, params: list[str]):
        hooks = self
        gi = params.index("group") if "group" in params else None
        ai = params.index("async_op") if "async_op" in params else None
        iname = next((n for n in INPUT_ARGS if n in params), "")
        ii = params.index(iname) if iname else None

        @functools.wraps(fn)
        def wrapper(*a, **k):
            if not hooks.active or getattr(_tls, "coll", 0):
                return fn(*a, **k)
            _tls.coll = 1
            try:
                group = k.get("group", a[gi] if gi is not None and gi < len(a) else None)
                return hooks._timed_call(fn, op, group, ai, a, k, (ii, iname))
            finally:
                _tls.coll = 0

        wrapper.__trainscope__ = True
        return wrapper

    def _timed_call(self, fn, op: str, group, ai: int | None, a, k, inp=(None, "")):
        prep = self._guard(self._prepare_collective, op, group, ai is not None)
        if prep is None:
            return fn(*a, **k)
        name, mode = prep
        if mode == "capturing":  # inside CUDA-graph capture: no events, no handle juggling
            return fn(*a, **k)
        rec = self._guard(self._record_begin, op, group, a, k, inp)
        if mode == "nccl_timing":  # async internally, so the group's NCCL-stream events time it
            wall = time.time_ns()
            if ai < len(a):
                user_async, a = bool(a[ai]), a[:ai] + (True,) + a[ai + 1:]
            else:
                user_async, k = bool(k.get("async_op", False)), dict(k, async_op=True)
            work = fn(*a, **k)
            if work is not None:
                self.phases.add_work(name, work, start_wall=wall)
                self._guard(self._end_on_completion, [work], None, rec)
                if not user_async:
                    work.wait()
                    return None
            else:
                self._guard(self._record_end, rec)
            return work
        span = self.phases.begin(name, device_side=(mode == "events"))
        out = fn(*a, **k)
        works = out if isinstance(out, list) else [out]
        if mode == "events" or not all(hasattr(w, "get_future") for w in works):
            self.phases.end(span)  # done (recv returns the sender's rank, not a handle)
            self._guard(self._record_end, rec)
        else:
            self._guard(self._end_on_completion, works, span, rec)
        return out

    def _prepare_collective(self, op: str, group, can_async: bool) -> tuple[str, str]:
        name = f"{self._role(group)}-{op}"
        if "nccl" in self._backend(group) and self.phases.cuda_active():
            if self.phases.capturing():
                return name, "capturing"
            timing = env.text(env.NCCL_TIMING, "0") != "0"
            return name, ("nccl_timing" if timing and can_async else "events")
        return name, "host"

    def _end_on_completion(self, works: list, span, rec=None) -> None:
        pending = [len(works)]
        lock = threading.Lock()

        def done(_fut):
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                if span is not None:
                    self.phases.end(span)
                self._guard(self._record_end, rec)

        for w in works:
            w.get_future().add_done_callback(done)

    # ------------------------------------------- collective records (Mycroft §4.2)
    def _record_begin(self, op: str, group, a, k, inp=(None, "")):
        """A record for ``collective_log`` (``collective_log.py``): group id and members,
        the group's next sequence number, bytes and dtype of the rank's input tensor(s)."""
        clog = getattr(self, "collective_log", None)
        if clog is None or op in P2P:
            return None
        info = self._group_info(group)
        if info is None:
            return None   # this rank is not a member: torch makes the call a no-op
        nbytes, dtype = _payload(a, k, *inp)
        it = self._current_iteration() if self.config.iterations else 0
        return clog.begin(info[0], info[1], op, nbytes, dtype, it)

    def _record_end(self, rec) -> None:
        if rec is not None:
            self.collective_log.end(rec)

    def _group_info(self, group) -> tuple[str, tuple[int, ...]] | None:
        key = id(group)
        if key in self._group_infos:
            return self._group_infos[key]
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        pg = group if group is not None else c10d._get_default_group()
        if dist.get_rank(pg) < 0:
            info = None
        else:
            members = tuple(int(r) for r in dist.get_process_group_ranks(pg))
            try:  # torch names groups "0", "1", ... in creation order: the same on every member
                name = str(c10d._get_process_group_name(pg))
            except Exception:
                name = ""
            info = (name or "ranks:" + ",".join(map(str, members)), members)
        if len(self._group_infos) > 1024:   # groups made on the fly: bounded
            self._group_infos.clear()
        self._group_infos[key] = info
        return info

    def _backend(self, group) -> str:
        key = id(group)
        b = self._backends.get(key)
        if b is None:
            import torch.distributed as dist
            if len(self._backends) > 1024:  # groups made on the fly: keep the caches bounded
                self._backends.clear()
                self._role_cache.clear()
            b = self._backends[key] = str(dist.get_backend(group)).lower()
        return b

    def _role(self, group) -> str:
        key = id(group)
        role = self._role_cache.get(key)
        if role is None:
            role = self._role_cache[key] = self._lookup_role(group)
        return role

    def _lookup_role(self, group) -> str:
        if group is not None:
            hit = self._roles.get(id(group))
            if hit is not None:
                return hit[1]
            import torch.distributed as dist
            if group is not dist.group.WORLD:
                return "group"
        c = getattr(getattr(self.collector, "resource", None), "coords", None)
        pure_dp = c is None or all(getattr(c, f"{d}_size", 1) in (0, 1) for d in ("tp", "pp", "ep", "cp"))
        return "dp" if pure_dp else "world"

    # ---------------------------------------------------- declared groups
    def declare_groups(self, **groups) -> ParallelCoords | None:
        """Name this rank's process groups by role (dp=, tp=, pp=, ep=, cp=) and
        derive its parallel coordinates from them (rank and size in each group)."""
        import torch.distributed as dist

        bad = set(groups) - set(DIMS)
        if bad:
            raise ConfigError("declare_groups", sorted(bad), f"roles must be among {DIMS}")
        coords = {}
        for role, g in groups.items():
            if g is None:
                continue
            self._roles[id(g)] = (g, role)
            rank = dist.get_rank(g)
            if rank >= 0:  # -1: this process is not a member (a group created collectively)
                coords[role], coords[f"{role}_size"] = rank, dist.get_world_size(g)
        return self.declare_coords(**coords)

    def declare_coords(self, **coords) -> ParallelCoords | None:
        """Set coordinates (``dp=3, dp_size=8, tp=1, tp_size=2, ...``) directly."""
        res = getattr(self.collector, "resource", None)
        if res is None:
            return None
        return self._set_resource(coords=dataclasses.replace(res.coords, **coords)).coords

    def _set_resource(self, **changes):
        """Replace this rank's identity; batches serialised from now on carry it."""
        new = dataclasses.replace(self.collector.resource, **changes)
        self.collector.resource = new
        self._role_cache.clear()
        exp = getattr(self.collector, "exporter", None)
        if exp is not None and hasattr(exp, "set_resource"):
            exp.set_resource(new)
        if self._on_resource is not None:
            self._guard(self._on_resource, new)
        return new

    def _adopt_dist_identity(self) -> None:
        """After ``init_process_group``: rank and world size from torch.distributed when the
        launcher's environment did not say (or said otherwise)."""
        import torch.distributed as dist

        res = getattr(self.collector, "resource", None)
        rank, world = dist.get_rank(), dist.get_world_size()
        if res is not None and (res.rank, res.world_size) != (rank, world):
            topo = getattr(getattr(self.collector, "config", None), "topology", None) or {}
            self._set_resource(rank=rank, world_size=world, coords=coords_for_rank(rank, world, **topo))

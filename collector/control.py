"""The collector's end of the control path: a stream it opens to its processor (issue #14).

The training process listens on no port. Like the ingest stream (``exporter.py``),
the control stream is a client call to the host's processor, with the same
target, socket-directory check and credentials (``ClientSecurity``):

1. A daemon thread opens ``trainscope.v1.Control/Subscribe`` with a
   ``ControlHello`` (this rank's ``Resource``, whether ``torch.profiler`` can
   run here) and reads ``ControlCommand`` messages until the processor ends the
   stream (it does after ``stream_max_s``) or it breaks; it then reconnects,
   after a jittered, doubling backoff when it broke (a processor that is down
   costs a connection attempt per backoff, nothing on the training thread).
2. A ``DeepDiveCommand`` is armed in the rank's :class:`DeepDiveWindow`; the
   training thread opens the window at the command's iteration boundary. A
   ``StackDumpCommand`` (the stack grid of a collective trigger, Mycroft §5) goes
   to the rank's ``StackDumper`` (``stacks.py``): py-spy dumps this process on a
   thread of its own and the dump returns on the ingest stream.
3. Reports (``DeepDiveReport``: outcome, iterations covered, trace path) are
   queued (bounded, drop-oldest and counted) by whoever makes them, the
   training thread included, and sent by a second daemon thread with the unary
   ``Report`` call, retried a few times, so no gRPC call is ever made on the
   training thread.
After ``fork()`` the child's client is off (gRPC did not survive the fork).
"""
from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from typing import Callable

import grpc

from trainscope.collector.deep_dive import DeepDiveWindow
from trainscope.collector.exporter_socket import check_socket_dir
from trainscope.proto.contracts import CONTROL_PROTOCOL, CONTROL_REPORT, CONTROL_SUBSCRIBE
from trainscope.proto.errors import ConfigError
from trainscope.proto.security import ClientSecurity
from trainscope.proto.v1 import control_pb2

log = logging.getLogger(__name__)


class ControlClient:
    """Subscribes to the processor's control stream and feeds commands to a :class:`DeepDiveWindow`."""

    def __init__(self, target: str, resource_fn: Callable[[], object], window: DeepDiveWindow, *,
                 security: ClientSecurity | None = None,
                 channel_factory: Callable[[str], grpc.Channel] | None = None,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 max_reports: int = 64, dumper=None) -> None:
        self.target = target
        self.window = window
        self.dumper = dumper
        """``stacks.StackDumper`` for stack-grid commands (None: they are refused and counted)."""
        self._resource_fn = resource_fn
        self._security = security
        self._factory = channel_factory
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._stop = threading.Event()
        self._reports: collections.deque = collections.deque(maxlen=max_reports)
        self._report_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._call = None
        self._forked = False
        self.stats: collections.Counter[str] = collections.Counter()
        """subscribed, commands, reports_sent, reports_dropped, reconnects, refused, stack_dumps,
        stack_dumps_refused."""
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        self._forked = True
        self._threads = []
        self._call = None

    # ------------------------------------------------------------------ API
    def start(self) -> "ControlClient":
        if self._threads or self._forked:
            return self
        if self._security is None:
            try:
                self._security = ClientSecurity.from_env()
            except ConfigError as e:
                log.warning("trainscope control stream off: %s", e)
                return self
        if self._factory is None:
            self._factory = self._security.channel
        for name, fn in (("trainscope-control", self._run), ("trainscope-control-report", self._send_reports)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def report(self, rep: control_pb2.DeepDiveReport) -> None:
        """Queue a report (any thread; O(1), never blocks)."""
        if self._forked:
            return
        if len(self._reports) == self._reports.maxlen:
            self.stats["reports_dropped"] += 1
        self._reports.append(rep)
        self._report_wake.set()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Send the reports left (bounded), end the stream, stop the threads."""
        deadline = time.monotonic() + timeout_s
        while self._reports and time.monotonic() < deadline and self._threads:
            self._report_wake.set()
            time.sleep(0.02)
        self._stop.set()
        self._report_wake.set()
        call = self._call
        if call is not None:
            try:
                call.cancel()
            except Exception:
                pass
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.1, deadline - time.monotonic()))

    # --------------------------------------------------------------- threads
    def _metadata(self) -> tuple:
        return tuple(self._security.metadata() or ()) if self._security is not None else ()

    def _hello(self) -> control_pb2.ControlHello:
        res = self._resource_fn()
        pb = res.to_pb() if hasattr(res, "to_pb") else res
        self.window.resource_pb = pb
        return control_pb2.ControlHello(resource=pb, protocol=CONTROL_PROTOCOL,
                                        profiler_available=self.window.available,
                                        unavailable_reason=self.window.reason)

    def _run(self) -> None:
        first, top = self._backoff
        backoff = first
        channel = None
        while not self._stop.is_set():
            broke = False
            try:
                if channel is None:
                    check_socket_dir(self.target)
                    channel = self._factory(self.target)
                call = channel.unary_stream(CONTROL_SUBSCRIBE,
                                            request_serializer=control_pb2.ControlHello.SerializeToString,
                                            response_deserializer=control_pb2.ControlCommand.FromString)
                self._call = call(self._hello(), metadata=self._metadata(), wait_for_ready=False)
                self.stats["subscribed"] += 1
                for msg in self._call:
                    backoff = first
                    kind = msg.WhichOneof("command")
                    if kind == "deep_dive":
                        self.stats["commands"] += 1
                        why = self.window.arm(msg.deep_dive)
                        if why is not None:
                            self.stats["refused"] += 1
                    elif kind == "stack_dump":
                        self.stats["stack_dumps"] += 1
                        if self.dumper is None or not self.dumper.request(msg.stack_dump):
                            self.stats["stack_dumps_refused"] += 1
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                broke = code != grpc.StatusCode.CANCELLED or not self._stop.is_set()
                log.debug("trainscope control stream: %s", code)
            except ConfigError as e:
                broke = True
                log.debug("trainscope control stream refused to connect: %s", e)
            except Exception:  # the thread must survive
                broke = True
                log.debug("trainscope control stream error", exc_info=True)
            self._call = None
            if self._stop.is_set():
                break
            self.stats["reconnects"] += 1
            if broke:
                if channel is not None:
                    channel.close()
                    channel = None
                self._stop.wait(random.uniform(0, backoff))
                backoff = min(backoff * 2, top)
            else:
                self._stop.wait(random.uniform(0, 0.1))  # the processor ended the stream: come back at once
        if channel is not None:
            channel.close()

    def _send_reports(self) -> None:
        channel = None
        while True:
            self._report_wake.wait(1.0)
            self._report_wake.clear()
            while self._reports:
                rep = self._reports[0]
                sent = False
                for attempt in range(3):
                    try:
                        if channel is None:
                            check_socket_dir(self.target)
                            channel = self._factory(self.target)
                        rpc = channel.unary_unary(CONTROL_REPORT,
                                                  request_serializer=control_pb2.DeepDiveReport.SerializeToString,
                                                  response_deserializer=control_pb2.ControlAck.FromString)
                        rpc(rep, metadata=self._metadata(), timeout=5.0)
                        sent = True
                        break
                    except Exception:
                        log.debug("trainscope deep-dive report failed", exc_info=True)
                        if channel is not None:
                            channel.close()
                            channel = None
                        if self._stop.wait(0.2 * (attempt + 1)):
                            break
                try:
                    self._reports.popleft()
                except IndexError:
                    pass
                self.stats["reports_sent" if sent else "reports_dropped"] += 1
            if self._stop.is_set():
                break
        if channel is not None:
            channel.close()


__all__ = ["ControlClient"]

"""The exporter's checks of a gRPC target before and without a channel (split from ``exporter.py``).

``check_socket_dir``: the directory of a ``unix:`` target must be ours or root's
and closed to other users, or the exporter refuses to connect (issue #11).
``reachable``: whether anything accepts connections there (``collector/launch.py``
and ``deploy/launcher.py`` ask before starting a processor of their own).
"""
from __future__ import annotations

import os
import socket

from trainscope.proto import env
from trainscope.proto.securefs import check_private_dir


def check_socket_dir(target: str) -> None:
    """Never send a rank's telemetry to a socket another user could have planted: raises
    ``ConfigError`` when the directory of a ``unix:`` target is not ours (or root's) and closed
    to others. Nothing is checked for ``host:port``, nor when the directory does not exist yet
    (the connection then fails and is retried)."""
    path = env.unix_path(target)
    if path is None:
        return
    try:
        check_private_dir(os.path.dirname(os.path.abspath(path)), "processor target")
    except FileNotFoundError:
        return


def reachable(target: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts connections at a gRPC target (``unix:///path`` or ``host:port``)."""
    try:
        path = env.unix_path(target)
        if path is not None:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(timeout_s)
                s.connect(path)
        else:
            host, _, port = target.rpartition(":")
            socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False

"""Files and directories another local user cannot plant, redirect or read (issue #11 item 7).

Standard library only (the collector's start-up hook imports ``proto/env.py``,
which imports this module).

* ``proto/env.runtime_dir()`` (kept there: the start-up hook may import only
  ``env`` and ``errors``) says where the default socket lives, per user;
* ``private_dir(path)``: create the directory 0700 or accept an existing one
  only when it is ours (or root's), not a symlink, and not writable by others.
* ``write_private(path, data)``: write through ``mkstemp`` (unpredictable name,
  ``O_EXCL``, 0600) and an atomic rename: a symlink planted at a predictable
  ``.tmp`` path is never followed.
* ``owned_by_me(path)``: a regular file (not a symlink) owned by this user;
  readers of shared directories ignore everything else.
"""
from __future__ import annotations

import os
import stat
import tempfile

from trainscope.proto.errors import ConfigError


def check_private_dir(path: str, setting: str = "directory") -> None:
    """Raise ``ConfigError`` unless ``path`` is a real directory owned by us or root that
    no other user can write to."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(setting, path, "is not a directory (a symlink or a file is refused)")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(setting, path, f"is owned by uid {st.st_uid}, not by this user: "
                                         "another user may have created it first")
    if st.st_mode & 0o022:
        raise ConfigError(setting, path, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")


def private_dir(path: str, setting: str = "directory") -> str:
    """Create ``path`` (and missing parents) 0700, or check an existing one; returns it."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    check_private_dir(path, setting)
    return path


def write_private(path: str, data: bytes | str) -> None:
    """Replace ``path`` atomically with ``data``, 0600, never following a planted link."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)  # rename replaces a link itself, never its target
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def owned_by_me(path: str) -> bool:
    """True for a regular file (not a symlink) owned by this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def open_private(path: str, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """Open or create ``path`` 0600 without following a symlink; refuses a file owned by another user."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError("file", path, f"is owned by uid {st.st_uid} or not a regular file")
    return fd

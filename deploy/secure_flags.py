"""Command-line flags of network security (issue #11 item 8), kept out of ``cli.py``.

Each flag falls back to its environment variable (``proto/env.py``), then to
"off". Secrets (tokens, passwords, key passphrases) are taken only from files
or environment variables, never as flag values: argv is visible to every user
in ``ps``.
"""
from __future__ import annotations

import argparse

from trainscope.proto import env
from trainscope.proto.security import ServerSecurity, resolve_secret


def add_tls_flags(p: argparse.ArgumentParser, *, grpc: bool) -> None:
    """--tls-cert/--tls-key (gRPC port and /metrics), --metrics-token-file; with ``grpc`` also
    --tls-client-ca and --token-file for the ingest port."""
    g = p.add_argument_group("network security")
    g.add_argument("--tls-cert", help=f"PEM server certificate for {'gRPC and ' if grpc else ''}/metrics "
                                      f"(env {env.TLS_CERT}; default: no TLS)")
    g.add_argument("--tls-key", help=f"its unencrypted PEM key, mode 0600 (env {env.TLS_KEY})")
    if grpc:
        g.add_argument("--tls-client-ca", help=f"require collector certificates signed by this CA "
                                               f"(env {env.TLS_CLIENT_CA}; default: none required)")
        g.add_argument("--token-file", help=f"collectors must send this bearer token (env {env.TOKEN_FILE} "
                                            f"or {env.TOKEN}; default: none)")
    if grpc:
        g.add_argument("--metrics-host", help="address /metrics binds to (default 127.0.0.1; a non-loopback "
                                              "one warns unless TLS and a metrics token are on)")
    g.add_argument("--metrics-token-file", help=f"/metrics and /healthz require this bearer token "
                                                f"(env {env.METRICS_TOKEN_FILE} or {env.METRICS_TOKEN}; default: none)")


def add_kafka_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kafka security (librdkafka settings)")
    g.add_argument("--kafka-security-protocol", help=f"plaintext, ssl, sasl_plaintext or sasl_ssl "
                                                     f"(env {env.KAFKA_SECURITY_PROTOCOL}; default plaintext)")
    g.add_argument("--kafka-sasl-mechanism", help=f"PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI "
                                                  f"(env {env.KAFKA_SASL_MECHANISM})")
    g.add_argument("--kafka-sasl-username", help=f"(env {env.KAFKA_SASL_USERNAME})")
    g.add_argument("--kafka-sasl-password-file", help=f"file holding the SASL password "
                                                      f"(env {env.KAFKA_SASL_PASSWORD_FILE} or {env.KAFKA_SASL_PASSWORD})")
    g.add_argument("--kafka-ssl-ca", help=f"CA bundle of the brokers (env {env.KAFKA_SSL_CA})")
    g.add_argument("--kafka-ssl-cert", help=f"client certificate (env {env.KAFKA_SSL_CERT})")
    g.add_argument("--kafka-ssl-key", help=f"client key (env {env.KAFKA_SSL_KEY})")
    g.add_argument("--kafka-ssl-key-password-file", help=f"file holding the client key's passphrase "
                                                         f"(env {env.KAFKA_SSL_KEY_PASSWORD_FILE} or "
                                                         f"{env.KAFKA_SSL_KEY_PASSWORD})")


def _flag(args, name: str) -> str | None:
    return getattr(args, name, None)


def grpc_security(args, environ=None) -> ServerSecurity:
    """The processor's gRPC port: flags, then environment."""
    import os
    e = os.environ if environ is None else environ
    return ServerSecurity(
        cert_file=_flag(args, "tls_cert") or e.get(env.TLS_CERT, ""),
        key_file=_flag(args, "tls_key") or e.get(env.TLS_KEY, ""),
        client_ca_file=_flag(args, "tls_client_ca") or e.get(env.TLS_CLIENT_CA, ""),
        token=resolve_secret(_flag(args, "token_file"), env.TOKEN_FILE, env.TOKEN, "--token-file", e),
    )


def metrics_security(args, environ=None) -> ServerSecurity | None:
    """/metrics and /healthz: the same certificate as the gRPC port, their own token; None when neither."""
    import os
    e = os.environ if environ is None else environ
    cert = _flag(args, "tls_cert") or e.get(env.TLS_CERT, "")
    key = _flag(args, "tls_key") or e.get(env.TLS_KEY, "")
    token = resolve_secret(_flag(args, "metrics_token_file"), env.METRICS_TOKEN_FILE, env.METRICS_TOKEN,
                           "--metrics-token-file", e)
    if not cert and not key and token is None:
        return None
    return ServerSecurity(cert_file=cert, key_file=key, token=token)


def kafka_extra(args, environ=None) -> dict[str, str]:
    """librdkafka security settings from the --kafka-* flags, then the KAFKA_* variables."""
    from trainscope.processor.kafka_config import security_settings
    return security_settings(
        protocol=_flag(args, "kafka_security_protocol"), mechanism=_flag(args, "kafka_sasl_mechanism"),
        username=_flag(args, "kafka_sasl_username"), password_file=_flag(args, "kafka_sasl_password_file"),
        ca=_flag(args, "kafka_ssl_ca"), cert=_flag(args, "kafka_ssl_cert"), key=_flag(args, "kafka_ssl_key"),
        key_password_file=_flag(args, "kafka_ssl_key_password_file"), environ=environ)

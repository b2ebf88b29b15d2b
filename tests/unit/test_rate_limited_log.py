"""librdkafka's logger adapter (analyzer/sources.py): one line per kind per period, the rest counted."""
import logging

from trainscope.analyzer.sources import RateLimitedLog


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_one_line_per_kind_per_period_and_the_held_ones_counted(caplog):
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("t.rdkafka"), every_s=30.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="t.rdkafka"):
        for i in range(100):
            clock.t = i * 0.05
            log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", f"connect failed {i}")
        log.log(logging.INFO, "%s [%s] %s", "JOIN", "rdkafka#consumer-1", "joined")  # another kind
        clock.t = 31.0
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", "connect failed again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("connect failed 0")
    assert lines[1].endswith("joined")
    assert "connect failed again" in lines[2] and "99 more like it" in lines[2]
    assert len(lines) == 3

"""EROICA §4.1 iteration detection from data-loader / optimizer events."""
import pytest

from trainscope.collector.iteration_detector import IterationDetector, IterationDetectorConfig
from trainscope.proto.errors import ConfigError


class Feed:
    """Feeds symbols with synthetic times: each event lasts 10 ns, 1 ns apart."""

    def __init__(self, **cfg) -> None:
        self.marks: list[tuple[int, int, int]] = []
        self.det = IterationDetector(lambda n, s, e: self.marks.append((n, s, e)),
                                     IterationDetectorConfig(**cfg))
        self.t = 0
        self.times: list[tuple[str, int, int]] = []

    def __call__(self, symbols: str) -> "Feed":
        for s in symbols:
            start, end = self.t, self.t + 10
            self.times.append((s, start, end))
            self.det.event(s, start, end)
            self.t = end + 1
        return self


def test_learns_after_m_identical_sequences_and_reports_them():
    f = Feed(m=3, k=50)("DO" * 3)
    assert f.det.pattern is None and f.marks == []  # the 3rd candidate closes at the next D
    f("D")
    assert f.det.pattern == "DO"
    assert [n for n, _, _ in f.marks] == [0, 1, 2]
    f("O")
    assert [n for n, _, _ in f.marks] == [0, 1, 2, 3]


def test_iteration_spans_first_dataloader_start_to_last_optimizer_end():
    f = Feed(m=2)("DDDO" * 4)  # gradient accumulation: 3 micro-batches per step
    assert f.det.pattern == "DDDO"
    n, start, end = f.marks[-1]
    last = f.times[-4:]
    assert (start, end) == (last[0][1], last[-1][2])
    assert all(e - s == 4 * 10 + 3 for _, s, e in f.marks)


def test_two_optimizers_per_iteration():
    f = Feed(m=2)("DOO" * 5)
    assert f.det.pattern == "DOO"
    assert [n for n, _, _ in f.marks] == [0, 1, 2, 3, 4]


def test_different_candidates_reset_the_count():
    f = Feed(m=3)("DO" "DDO" "DO" "DO" "DDO")
    assert f.det.pattern is None
    f("DO" * 3 + "D")
    assert f.det.pattern == "DO"


def test_leading_optimizer_steps_are_ignored():
    f = Feed(m=2)("OO" + "DO" * 3)
    assert f.det.pattern == "DO"


def test_relearns_after_k_unmatched_events():
    f = Feed(m=2, k=10)("DO" * 4)
    assert f.det.pattern == "DO"
    before = len(f.marks)
    f("D" * 10)  # an evaluation loop: batches, no steps
    assert f.det.relearned == 1 and f.det.pattern is None
    f("DDO" * 3 + "D")  # the first candidate carries the leftover D: DDDO, DDO, DDO
    assert f.det.pattern == "DDO"
    assert len(f.marks) > before


def test_matching_survives_a_stray_event():
    f = Feed(m=2, k=50)("DO" * 3)
    n = len(f.marks)
    f("O")       # an extra step, e.g. a scheduler wrapper
    f("DO" * 2)
    assert len(f.marks) == n + 2 and f.det.relearned == 0


def test_numbers_continue_without_gaps():
    f = Feed(m=4)("DO" * 20)
    assert [n for n, _, _ in f.marks] == list(range(19)) + [19][: len(f.marks) - 19]
    assert f.det.current == len(f.marks)


def test_memory_is_bounded_while_learning():
    f = Feed(m=2, max_sequence=8)("D" * 100)
    assert f.det.discarded >= 10
    assert len(f.det._cur) <= 8


@pytest.mark.parametrize("kw", [dict(m=0), dict(k=1), dict(max_sequence=1), dict(m=2.5)])
def test_bad_config_names_the_setting(kw):
    with pytest.raises(ConfigError) as e:
        IterationDetectorConfig(**kw)
    assert "iteration_detector." in str(e.value)

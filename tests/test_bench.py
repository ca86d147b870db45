"""The write benchmark's arithmetic (the benchmark itself is run by hand: it measures, it asserts nothing)."""

from collections import Counter

from services.bench.write import Run, ceiling


def test_the_ceiling_counts_the_embedding_and_the_other_processes_but_not_the_writer() -> None:
    # 100 created writes: API 1 ms, PostgreSQL 2 ms, NATS 1 ms a write; the writer's 8 ms a write are left out.
    created = Run("created", [0.1] * 100, 1.0, Counter(created=100),
                  {"writer1": 0.8, "api": 0.1, "postgres": 0.2, "nats": 0.1, "load": 0.5})
    # Two cores, 4 ms of embedding a text: 2,000 ms / (4 + 1 + 2 + 1) ms = 250 writes a second.
    assert ceiling(created, embedding_cpu_ms=4.0, cores=2) == 250

"""benchmarks/black_box_cost.py: an `off` child really trains without the writer, an `on` child
with it, and the comparison reads both."""

from __future__ import annotations

from tests.benchmarks import load


def test_the_writer_rewrites_in_on_children_and_not_in_off_children():
    bench = load("black_box_cost")
    on = bench.child("toy", "on", 1.2)  # two periods of 0.5 s
    off = bench.child("toy", "off", 0.6)
    assert on["rewrites"] >= 1 and on["writer_cpu_s"] > 0
    assert off["rewrites"] == 0 and off["writer_cpu_s"] == 0
    for result in (on, off):
        assert 0 < result["bare_s"] < result["basic_s"]  # BASIC's steps cost more than the bare ones


def test_the_comparison_pairs_within_triples(monkeypatch):
    """on - off and on - on are taken within each triple, from each child's BASIC - bare."""
    bench = load("black_box_cost")
    added = {"on": iter([10e-6, 12e-6]), "off": iter([4e-6, 5e-6])}

    def fake_child(workload, writer, seconds):
        return {"bare_s": 1e-3, "basic_s": 1e-3 + next(added[writer]), "rewrites": 2 if writer == "on" else 0,
                "writer_cpu_s": 0.001 if writer == "on" else 0.0, "seconds": 1.0}

    monkeypatch.setattr(bench, "run_child", fake_child)
    lines = bench.compare("toy", triples=1, seconds=1.0)
    text = "\n".join(lines)
    # One triple: two `on` children (10 and 12 us added, in the shuffled order's turn) and one `off` (4 us).
    assert "off 4.0 us" in text
    assert "the writer (on - off, per triple): +6.0 us" in text or "the writer (on - off, per triple): +8.0 us" in text
    assert "A/A (on - on) +2.0 us" in text or "A/A (on - on) -2.0 us" in text
    assert "rewrites a child: on 2, off 0" in text

"""benchmarks/tree_cost.py: a child times the torchtrace of the tree it is given, the base tree is
the commit's own code, and the comparison pairs its figures within triples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.benchmarks import load

ROOT = Path(__file__).resolve().parents[2]


def test_the_base_tree_is_the_commits_torchtrace(tmp_path):
    bench = load("tree_cost")
    tree = bench.export_tree("HEAD", str(tmp_path))
    shown = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:torchtrace/api.py"], capture_output=True,
                           text=True, check=True).stdout
    assert (Path(tree) / "torchtrace" / "api.py").read_text() == shown


def test_a_child_imports_torchtrace_from_its_tree_and_times_the_three_variants(tmp_path):
    """The child refuses to time a torchtrace from elsewhere; from its own tree it reports BASIC's
    cost beyond the floor and beyond bare, from rounds it really ran."""
    bench = load("tree_cost")
    tree = bench.export_tree("HEAD", str(tmp_path))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_cost.py"), "--child", tree,
                           "--workloads", "toy", "--seconds", "0.5"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = bench.json.loads(done.stdout.strip().splitlines()[-1])
    assert result["workload"] == "toy-mlp-8x17"
    assert result["rounds"] >= 3  # run_workload's least, however short the budget
    assert 0 < result["bare_s"] < 0.1
    assert result["beyond_bare_s"] > 0  # BASIC's steps cost more than bare ones
    wrong = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_cost.py"), "--child",
                            str(tmp_path / "nothing-here"), "--workloads", "toy", "--seconds", "0.5"],
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode != 0 and "not from" in wrong.stderr


def test_the_comparison_pairs_within_triples(monkeypatch):
    """new - base and base again - base are taken within each triple from the children's BASIC
    beyond the floor."""
    bench = load("tree_cost")
    costs = {"base": iter([100e-6, 104e-6]), "new": iter([90e-6])}

    def fake_child(tree, workload, seconds):
        return {"workload": "toy-mlp-8x17", "rounds": 50, "bare_s": 1e-3, "beyond_floor_s": next(costs[tree]),
                "beyond_bare_s": 0.0, "background_s": 0.0}

    monkeypatch.setattr(bench, "run_child", fake_child)
    text = "\n".join(bench.compare("toy", {"base": "base", "new": "new"}, triples=1, seconds=1.0))
    # One triple: the base children read 100 and 104 us in the shuffled order's turn, the new one 90 us.
    assert "new 90.0 us (9.00 % of bare)" in text
    assert "new - base (per triple): -10.0 us" in text or "new - base (per triple): -14.0 us" in text
    assert "A/A (base again - base) +4.0 us" in text or "A/A (base again - base) -4.0 us" in text

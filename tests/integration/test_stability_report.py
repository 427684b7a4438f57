"""scripts/stability_report.py: its figures against a plain loop on a scripted curve, and the results page is what
the recorded rows render to."""

import importlib.util
import json
from pathlib import Path

import numpy as np
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("stability_report", ROOT / "scripts" / "stability_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def fake_run(tmp_path, accuracy):
    run = tmp_path / "run"
    writer = SummaryWriter(str(run / "logs"))
    for step, value in enumerate(accuracy, start=1):
        writer.add_scalar("charts/accuracy", value, step)
    writer.close()
    (run / "summary.json").write_text(json.dumps({"accuracy_after": 0.5, "best_heldout_accuracy": 0.9, "best_iteration": 7, "rollbacks": 1}))
    (run / "config.json").write_text(json.dumps({"runner": {"seed": 3}}))
    return run


def test_the_figures_match_a_plain_loop(tmp_path):
    accuracy = list(np.random.default_rng(0).uniform(0.5, 1.0, 40)) + [1.0] * 10 + [0.3] * 10
    figures = report.seed_figures(fake_run(tmp_path, accuracy), window=5, reached=0.95)
    means = [(i + 5, sum(accuracy[i:i + 5]) / 5) for i in range(len(accuracy) - 4)]  # (iteration it ends at, mean)
    best = max(means, key=lambda m: m[1])
    first = next(i for i, (_, m) in enumerate(means) if m >= 0.95)
    assert figures["best_iteration"] == best[0] and abs(figures["best_moving"] - best[1]) < 1e-4
    assert figures["first_reached_iteration"] == means[first][0]
    assert abs(figures["lowest_after_reached"] - min(m for _, m in means[first:])) < 1e-4
    assert abs(figures["final_moving"] - 0.3) < 1e-4 and figures["seed"] == 3 and figures["rollbacks"] == 1
    assert figures["heldout_at_best"] == 0.9 and figures["heldout_at_end"] == 0.5


def test_the_results_page_is_generated_from_the_recorded_rows():
    rows = json.loads(report.RESULTS.read_text())["rows"]
    assert rows and report.PAGE.read_text() == report.render(rows), "docs/results/stability.md is out of date: rerun scripts/stability_report.py"
    for row in rows:
        assert (report.PAGE.parent / row["plot"]).is_file() and len(row["seeds"]) == 5


def test_the_code_sandbox_results_page_is_generated_from_the_recorded_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the script imports its neighbours
    spec = importlib.util.spec_from_file_location("benchmark_code", ROOT / "scripts" / "benchmark_code.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = json.loads(bench.RESULTS_FILE.read_text())
    assert runs and bench.RESULTS_PAGE.read_text() == bench.render(runs), "docs/results/code_sandbox.md is out of date"

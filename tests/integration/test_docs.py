"""The documentation: generated pages are current, the config reference covers every flag of ``marft train``,
the docs site builds with ``mkdocs build --strict``, ruff is clean, and the README stays a landing page."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import render_benchmarks  # noqa: E402
import render_config_reference  # noqa: E402


def tool(name: str) -> str:
    """The path of a dev tool (requirements-dev.txt) next to this interpreter; skipped outside CI if not installed."""
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.is_file() else shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: CI installs requirements-dev.txt (scripts/setup.sh)")
        pytest.skip(f"{name} is not installed (pip install -r requirements-dev.txt)")
    return found


def test_the_configuration_reference_is_generated_from_the_config():
    assert (ROOT / "docs" / "configuration.md").read_text() == render_config_reference.render(), (
        "docs/configuration.md is out of date: python scripts/render_config_reference.py")


def test_the_configuration_reference_lists_every_flag_of_marft_train(capsys):
    from marft.cli.main import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_flags = set(re.findall(r"^\s+(--[a-z_]+)", capsys.readouterr().out, flags=re.M)) - {"--help"}
    page_flags = set(re.findall(r"^\| `(--[a-z_]+)` \|", (ROOT / "docs" / "configuration.md").read_text(), flags=re.M))
    assert len(help_flags) > 60
    assert help_flags - page_flags == {"--config"}  # the run-config file itself, explained in the page's header
    from marft.sft import SFTConfig

    assert page_flags - help_flags == {f"--{field.name}" for field in dataclasses.fields(SFTConfig)}  # the warm start's own
    assert "--config FILE.yaml" in (ROOT / "docs" / "configuration.md").read_text()
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    sft_flags = set(re.findall(r"^\s+(--[a-z_]+)", capsys.readouterr().out, flags=re.M)) - {"--help", "--config"}
    assert sft_flags - help_flags and sft_flags <= page_flags  # the warm start's own flags are documented too


def test_the_benchmarks_page_and_readme_table_are_generated_from_the_recorded_results():
    assert (ROOT / "docs" / "results" / "benchmarks.md").read_text() == render_benchmarks.render(), (
        "docs/results/benchmarks.md is out of date: python scripts/render_benchmarks.py")
    assert (ROOT / "README.md").read_text() == render_benchmarks.render_readme(), (
        "README.md's results table is out of date: python scripts/render_benchmarks.py")


def test_rows_recorded_one_by_one_share_a_table_with_their_calibration_range():
    """Rows whose records differ only in the calibration read before each one form one table; another commit, another."""
    run = {"date": "2026-11-27", "machine": {"cpu": "CPU", "cores": 2, "gpu": None, "python": "3.11", "torch": "2"}, "commit": "a" * 40,
           "dirty": False}
    suite = {"title": "T", "about": "A", "figure": "{x}", "rows": [{"label": f"r{i}", "command": f"c{i}"} for i in range(3)]}
    recorded = {"rows": [{"label": "r0", "command": "c0", "command_seconds": 1.0, "result": {"x": 0}, "run": {**run, "calibrate_s": 0.9}},
                         {"label": "r1", "command": "c1", "command_seconds": 1.0, "result": {"x": 1}, "run": {**run, "calibrate_s": 0.7}},
                         {"label": "r2", "command": "c2", "command_seconds": 1.0, "result": {"x": 2}, "run": {**run, "commit": "b" * 40, "calibrate_s": 0.8}}]}
    page = render_benchmarks.render_suite("t", suite, recorded)
    assert page.count("| | command |") == 2 and "calibrate 0.70–0.90 s (read before each row)" in page and "calibrate 0.80 s." in page


def test_rows_with_a_learning_curve_get_its_numbers_under_their_table():
    run = {"date": "2026-11-27", "machine": {"cpu": "CPU", "cores": 2, "gpu": None, "python": "3.11", "torch": "2"}, "commit": "a" * 40,
           "dirty": False, "calibrate_s": 0.6}
    curve = [{"iterations": [1, 25], "success": 0.41, "held_out": None, "entropy": {"Player": 0.371}},
             {"iterations": [26, 50], "success": 0.525, "held_out": 0.6, "entropy": {"Player": 0.3}}]
    suite = {"title": "T", "about": "A", "figure": "{x}", "rows": [{"label": f"r{i}", "command": f"c{i}"} for i in range(2)]}
    recorded = {"rows": [{"label": "r0", "command": "c0", "command_seconds": 1.0, "result": {"x": 0, "curve": curve}, "run": run},
                         {"label": "r1", "command": "c1", "command_seconds": 1.0, "result": {"x": 1}, "run": run}]}
    page = render_benchmarks.render_suite("t", suite, recorded)
    assert "| r0 | 25 | 0.41 · 0.53 | – · 0.60 | Player: 0.37 · 0.30 |" in page  # two decimals
    assert "| r1 | " not in page.split("Learning curves in numbers")[1]  # a row without a curve gets no line


def test_a_row_without_seconds_shows_a_dash_not_an_error():
    """A run stopped and resumed by another command has no seconds of its own to show: the table says "–"."""
    suite = {"title": "T", "about": "A", "figure": "{x}", "seconds": "seconds", "rows": []}
    assert render_benchmarks.seconds({"result": {"x": 0, "seconds": None}}, suite) == "–"
    assert render_benchmarks.seconds({"result": {"x": 0, "seconds": 12.4}}, suite) == "12"


def test_every_readme_figure_has_its_command_on_the_benchmarks_page():
    table = render_benchmarks.readme_table()
    page = (ROOT / "docs" / "results" / "benchmarks.md").read_text()
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    assert rows, "the README's results table is empty: run the benchmark suites (benchmarks/suites.yaml)"
    for row in rows:
        command = re.search(r"\| `([^`]+)` \|", row).group(1)
        assert command.replace(" S", " 0") in page or command in page, row


def test_the_suite_definitions_are_well_formed(tmp_path):
    suites = render_benchmarks.load_suites()
    for name, suite in suites.items():
        commands = {row["command"] for row in suite["rows"]}
        assert len(commands) == len(suite["rows"]), f"{name}: two rows run the same command"
        for entry in suite.get("readme", []):
            missing = [s for s in entry["seeds"] if entry["command"].format(seed=s) not in commands]
            assert not missing, f"{name}: the README entry {entry['what']!r} names seeds no row runs: {missing}"
    bad = tmp_path / "suites.yaml"
    bad.write_text("x:\n  title: t\n  about: a\n  reads: stdout\n  rows: []\n")
    with pytest.raises(ValueError, match="reads must be one of"):
        render_benchmarks.load_suites(bad)


def test_a_suite_with_a_plot_draws_each_series_from_its_rows_and_the_page_shows_it(tmp_path, monkeypatch):
    """A suite's ``plot`` (x, series of dotted field paths) becomes a PNG beside the page, linked under its table; a row
    without a series' field leaves that point out."""
    monkeypatch.setattr(render_benchmarks, "PAGE", tmp_path / "benchmarks.md")
    suite = {"title": "t", "about": "a", "reads": "last_json_line", "figure": "{a:.0f}",
             "plot": {"x": "n", "x_label": "envs", "y_label": "tokens/s", "series": {"ours": "a", "theirs": "b.c"}},
             "rows": [{"label": f"{n} envs", "command": f"run {n}"} for n in (1, 4)]}
    run = {"date": "d", "commit": "c", "machine": {"cpu": "x", "cores": 2, "python": "3", "torch": "2"}}
    recorded = {"rows": [{"label": "1 envs", "command": "run 1", "run": run, "command_seconds": 1.0, "result": {"n": 1, "a": 10.0, "b": {"c": 5.0}}},
                         {"label": "4 envs", "command": "run 4", "run": run, "command_seconds": 1.0, "result": {"n": 4, "a": 30.0}}]}
    path = render_benchmarks.write_plot("speed_by_batch", suite, recorded)
    assert path == tmp_path / "speed_by_batch.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![tokens/s against envs](speed_by_batch.png)" in render_benchmarks.render_suite("speed_by_batch", suite, recorded)
    assert render_benchmarks.field(recorded["rows"][1]["result"], "b.c") is None
    assert render_benchmarks.write_plot("none", {**suite, "plot": None}, recorded) is None


def test_the_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing anchor or a page left out of the nav fails it."""
    mkdocs = tool("mkdocs")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_ruff_is_clean():
    ruff = tool("ruff")
    done = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"
    assert "calibrate" not in readme, "calibration readings belong in the generated benchmarks page"
    assert ".venv/bin/python -m pytest -q tests" in readme  # the test command CI runs (.ci/run)


def test_a_suite_row_sets_the_environment_its_command_names():
    """A row's command as a user types it in a shell, ``NAME=value python ...``: the suite runs it with that variable
    set (the memory suite's ``MALLOC_MMAP_THRESHOLD_``) and the interpreter running the suite."""
    import benchmark_suite

    command = """MARFT_SUITE_PROBE=on python -c 'import json, os, sys; print(json.dumps({"probe": os.environ["MARFT_SUITE_PROBE"], "python": sys.executable}))'"""
    row = benchmark_suite.run_row({"label": "probe", "command": command}, "last_json_line")
    assert row["result"] == {"probe": "on", "python": sys.executable} and row["command"] == command
    with pytest.raises(ValueError, match="no command"):
        benchmark_suite.run_row({"label": "only assignments", "command": "MARFT_SUITE_PROBE=on"}, "last_json_line")

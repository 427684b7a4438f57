"""Answer grading: unit cases, the hard time limit, and every reference answer of real datasets."""

import json
import logging
import random
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from marft.envs.math import grade_answer, grade_answers, grader_stats, load_problems
from marft.envs.math import grader as grader_module
from marft.envs.math.grader import MathGrader, last_boxed, normalize_reference

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(scope="module")
def exact_grader():
    """A grader that always asks math-verify (no identical-string shortcut)."""
    grader = MathGrader(shortcut=False)
    yield grader
    grader.close()


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"dataset {path} not present (shared data lives in {DATA})")
    return path


# ---------------------------------------------------------------- box extraction (plain reference)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("no box here 5", None),
        ("\\boxed{5}", "5"),
        ("first \\boxed{4} then \\boxed{5}", "5"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{ {a}^{ {b} } } tail", "{a}^{ {b} }"),
        ("\\boxed 5$ text", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} \\boxed{unbalanced", None),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_normalize_reference():
    assert normalize_reference(" $\\frac12$ ") == "\\frac12"
    assert normalize_reference("so \\boxed{3}") == "3"
    assert normalize_reference(17) == "17"


# ---------------------------------------------------------------- grading cases


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("The answer is \\boxed{4}.", "4", True),
        ("\\boxed{4} wait, no: \\boxed{5}", "5", True),  # the last box counts
        ("\\boxed{5} wait, no: \\boxed{4}", "5", False),
        ("The answer is 5", "5", False),  # unboxed never counts
        ("it's 4 or maybe 5", "5", False),
        ("$5$", "5", False),
        ("", "5", False),
        ("\\boxed{}", "5", False),
        ("\\boxed 5", "5", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),  # fractions
        ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),  # nested braces
        ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "(3, \\frac{\\pi}{2})", True),
        ("\\boxed{(3, \\frac{\\pi}{3})}", "(3, \\frac{\\pi}{2})", False),
        ("\\boxed{18}", "17", False),  # wrong answer
        ("\\boxed{2125}", "2,125", True),
        ("\\boxed{17}", "\\boxed{17}", True),  # boxed reference
        ("\\boxed{17}", "$17$", True),
    ],
)
def test_grade_answer(response, truth, expected):
    assert grade_answer(response, truth) is expected


def test_batch_matches_single_and_counts():
    before = grader_stats()
    responses = ["\\boxed{3}", "3", "\\boxed{0.25}", "\\boxed{x+1}"]
    truths = ["3", "3", "\\frac14", "1+x"]
    assert grade_answers(responses, truths) == [grade_answer(r, t) for r, t in zip(responses, truths)]
    assert grade_answers(responses, truths) == [True, False, True, True]
    assert grader_stats()["checks"] == before["checks"] + 3 * len(responses)
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        grade_answers(["a", "b"], ["a"])


def test_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(grade_answer("\\boxed{\\frac{6}{4}}", "1.5")))
    thread.start()
    thread.join()
    assert results == [True]
    with ThreadPoolExecutor(4) as pool:
        verdicts = list(pool.map(lambda k: grade_answer(f"\\boxed{{{k}/2}}", str(k / 2)), range(8)))
    assert verdicts == [True] * 8


# ---------------------------------------------------------------- hard time limit


FAKE_WORKER = textwrap.dedent(
    """
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("marft_grader_worker", {path!r})
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def check(prediction, reference):
        if prediction == "hang":
            time.sleep(600)
        if prediction == "die":
            os._exit(3)
        if prediction == "die slowly":  # its output closed before it exits, as a dying process's may be
            os.close(1)
            time.sleep(2)
            os._exit(3)
        if prediction == "raise":
            raise RuntimeError("boom")
        return prediction == reference

    module._serve(check)
    """
)


@pytest.fixture
def fake_grader(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(path=grader_module.__file__))
    # Generous limit: a loaded CI machine must not turn a slow answer into a timeout.
    grader = MathGrader(timeout_s=3.0, worker_command=[sys.executable, str(script)], shortcut=False)
    yield grader
    grader.close()


def test_a_worker_whose_output_ends_before_it_exits_died_and_did_not_time_out(fake_grader, caplog):
    """The end of the worker's output is a crash even while the process has not exited yet (a loaded machine
    reaps it later): an error right away, never a timeout, and the log does not claim the deadline passed."""
    with caplog.at_level(logging.WARNING):
        verdicts = fake_grader.grade_many(["\\boxed{die slowly}", "\\boxed{5}"], ["5", "5"])
    assert verdicts == [False, True]
    assert (fake_grader.stats.errors, fake_grader.stats.timeouts, fake_grader.stats.restarts) == (1, 0, 1)
    assert "worker died" in caplog.text and "timed out" not in caplog.text


@pytest.mark.slow
def test_timeout_kills_and_restarts_worker(fake_grader, caplog):
    responses = ["\\boxed{hang}", "\\boxed{2}", "\\boxed{hang}", "\\boxed{3}"]
    with caplog.at_level(logging.WARNING):
        verdicts = fake_grader.grade_many(responses, ["1", "2", "1", "4"])
    assert verdicts == [False, True, False, False]
    assert (fake_grader.stats.timeouts, fake_grader.stats.restarts, fake_grader.stats.errors) == (2, 2, 0)
    assert "timed out" in caplog.text


@pytest.mark.slow
def test_timeout_from_a_thread(fake_grader):
    results = []
    thread = threading.Thread(target=lambda: results.append(fake_grader.grade("\\boxed{hang}", "1")))
    thread.start()
    thread.join(timeout=30)
    assert results == [False] and fake_grader.stats.timeouts == 1
    assert fake_grader.grade("\\boxed{1}", "1") is True


def test_errors_and_worker_crash_are_counted(tmp_path):
    """No check here hangs, so the deadline is far (30 s): on a loaded machine a worker that takes seconds to start
    must not turn an error into a timeout."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(path=grader_module.__file__))
    grader = MathGrader(timeout_s=30.0, worker_command=[sys.executable, str(script)], shortcut=False)
    try:
        verdicts = grader.grade_many(["\\boxed{raise}", "\\boxed{die}", "\\boxed{5}"], ["5", "5", "5"])
        assert verdicts == [False, False, True]
        assert (grader.stats.errors, grader.stats.timeouts, grader.stats.restarts) == (2, 0, 1)
    finally:
        grader.close()


# ---------------------------------------------------------------- real data


@pytest.mark.slow
def test_math500_answers_grade_against_themselves(exact_grader):
    rows = [json.loads(line) for line in need(DATA / "MATH" / "test500.jsonl").read_text().splitlines()]
    answers = [row["answer"] for row in rows]
    assert len(answers) == 500
    verdicts = exact_grader.grade_many([f"\\boxed{{{a}}}" for a in answers], answers)
    failed = [a for a, ok in zip(answers, verdicts) if not ok]
    assert not failed, f"{len(failed)} answers do not match themselves: {failed[:20]}"
    # The same through the solutions' own last box, which is how MATH writes answers.
    from_solution = exact_grader.grade_many([row["solution"] for row in rows], answers)
    assert sum(from_solution) == 500
    assert exact_grader.stats.timeouts == 0


def test_math500_wrong_answers_are_wrong(exact_grader):
    answers = [json.loads(line)["answer"] for line in need(DATA / "MATH" / "test500.jsonl").read_text().splitlines()]
    shifted = answers[1:] + answers[:1]
    pairs = [(a, b) for a, b in zip(answers, shifted) if a.strip() != b.strip()]
    verdicts = exact_grader.grade_many([f"\\boxed{{{b}}}" for _, b in pairs], [a for a, _ in pairs])
    accepted = {pair for pair, ok in zip(pairs, verdicts) if ok}
    assert accepted <= {("5", "x=5")}, accepted  # "x=5" for 5 is accepted by math-verify, and fine
    assert not any(exact_grader.grade_many([f"\\boxed{{{a}}} + 1" for a in answers[:50]], ["-987654321"] * 50))


def test_gsm8k_sample(exact_grader):
    rows = json.loads(need(DATA / "gsm8k" / "test.json").read_text())
    sample = random.Random(0).sample(rows, 200)
    truths = [row["final_answer"] for row in sample]
    assert all(exact_grader.grade_many([f"So she makes \\boxed{{{t}}} dollars." for t in truths], truths))
    assert all(exact_grader.grade_many([f"\\boxed{{{t.replace(',', '')}}}" for t in truths], truths))
    wrong = [str(int(t.replace(",", "")) + 1) for t in truths]
    assert not any(exact_grader.grade_many([f"\\boxed{{{w}}}" for w in wrong], truths))
    assert not any(exact_grader.grade_many([f"The answer is {t}." for t in truths], truths))


def test_math_train_loads():
    rows = load_problems(need(DATA / "MATH" / "train.json"))
    assert len(rows) >= 7490  # a few rows have no final_answer and are skipped
    assert all(set(row) == {"problem", "answer"} and row["problem"] and row["answer"] for row in rows)
    assert rows[0]["answer"] == "17"

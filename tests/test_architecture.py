"""The package's layers import downward only, without circles, and the config loads no torch.

The layers, lowest first (a module may import its own layer and the layers below it):

* leaf — names of choices, errors, the text format, validation rules, process groups, turn records
* sandbox — running untrusted programs: the grader's side, and the harness it starts (standard library only)
* config — the run's dataclasses and flags
* envs — environments, workflows, profiles, datasets and graders
* agents — the team: adapters, prompts, role headers, generation, critic
* rollout — the shared runner's lower half (``marft.runner.shared``: buffer, turns, collector, evaluation): one team
  step turn by turn, the rollout buffer
* algorithms — advantage estimators, losses, the APPO / TPPO / GRPO trainers
* training — the shared runner's upper half (``marft.runner.shared``: runner, checkpoint, best, preemption, storage,
  diagnostics): the loop and its phases; ``marft.runner`` and ``marft.runner.shared`` themselves import nothing
* sft — the supervised warm start
* models — loading a base model, building the embedded ones (a warm start on env transcripts)
* apps — training a team (launch), and working with a trained one: evaluate, export, play
* cli — the ``marft`` command and its subcommands, and the package's facade
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "marft"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf", ("marft.choices", "marft.faults", "marft.prompting", "marft.validation", "marft.distributed", "marft.types",
              "marft.moved")),
    ("sandbox", ("marft.sandbox",)),
    ("config", ("marft.config",)),
    ("envs", ("marft.envs",)),
    ("agents", ("marft.agents",)),
    ("rollout", ("marft.runner.shared.buffer", "marft.runner.shared.turns", "marft.runner.shared.collector",
                 "marft.runner.shared.evaluation", "marft.rollout")),
    ("algorithms", ("marft.algorithms",)),
    ("training", ("marft.runner", "marft.training")),
    ("sft", ("marft.sft",)),
    ("models", ("marft.models",)),
    ("apps", ("marft.launch", "marft.trained")),
    ("cli", ("marft.cli", "marft")),
]


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The marft modules that ``name`` imports anywhere in its source (module level, in functions, under
    TYPE_CHECKING): every one is a dependency."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in known and c != name)
    return found


def layer_of(name: str) -> int:
    """The index of the layer holding ``name`` (the longest matching package prefix)."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def test_every_module_is_in_a_layer(graph):
    for name in graph:
        layer_of(name)


def test_nothing_imports_upward(graph):
    upward = [f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
              for name, deps in sorted(graph.items()) for dep in sorted(deps) if layer_of(dep) > layer_of(name)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """Depth-first search for a back edge: the first import circle found, in full (None: there is none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name)):
            return circle
    return None


def test_no_import_circles(graph):
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_checker_sees_upward_imports_and_circles(tmp_path):
    """The walk finds a function-level import, a relative import and a circle (so the tests above can fail)."""
    (tmp_path / "a.py").write_text("def f():\n    from marft.runner.shared import runner\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    known = {"marft.envs.a": tmp_path / "a.py", "marft.envs.b": tmp_path / "b.py", "marft.runner.shared.runner": tmp_path / "r.py",
             "marft.envs": tmp_path / "__init__.py"}
    assert imported_modules("marft.envs.a", known["marft.envs.a"], known) == {"marft.runner.shared.runner"}
    assert layer_of("marft.runner.shared.runner") > layer_of("marft.envs.a")
    assert imported_modules("marft.envs.b", known["marft.envs.b"], known) == {"marft.envs", "marft.envs.a"}
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


SPECIFICATION_LAYOUT = ("marft/envs", "marft/runner/shared", "marft/algorithms", "scripts", "tests", "requirements.txt",
                        "setup.py", "README.md")
"""The top level the specification names (the original MARFT's layout)."""


def test_the_layout_is_the_specifications():
    root = PACKAGE.parent
    missing = [path for path in SPECIFICATION_LAYOUT if not (root / path).exists()]
    assert not missing, f"the specification's layout lacks {missing}"
    assert (PACKAGE / "runner" / "shared" / "runner.py").is_file() and (PACKAGE / "runner" / "shared" / "collector.py").is_file()


def test_moved_modules_import_from_their_old_paths_with_a_warning():
    """Each old path is the moved module itself (one release), and says where it went: one fresh interpreter
    imports every old path (each new module first, so the warning is the old path's own)."""
    from marft.moved import MOVED

    code = ("import importlib, json, sys, warnings\n"
            "moved = json.loads(sys.argv[1])\n"
            "for old, new in moved.items():\n"
            "    importlib.import_module(new)\n"
            "    with warnings.catch_warnings(record=True) as caught:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module(old)\n"
            "    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
            "    print(json.dumps([old, module is sys.modules[new], messages]))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(MOVED)], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    seen = {old: (same, messages) for old, same, messages in map(json.loads, done.stdout.splitlines())}
    assert seen.keys() == MOVED.keys()
    for old, new in MOVED.items():
        same, messages = seen[old]
        assert same and messages == [f"{old} moved to {new}; the old path goes in the next release"], (old, messages)


HARNESS = PACKAGE / "sandbox" / "harness"


def test_the_harness_imports_only_the_standard_library_and_itself():
    """The harness runs as ``python3 -I -S <folder>``: an import of anything but the standard library would fail
    there, and ``marft`` (whose ``__init__`` is not standard library) must never be imported by the trusted driver.
    Its modules import their siblings relatively, at their top (the folder is out of the candidate's sight once its
    sandbox is built), and only ``__main__.py`` names the package ``harness`` it imports them as."""
    outside = []
    for path in sorted(HARNESS.glob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level != 1 or id(node) not in top_level:
                    outside.append(f"{path.name}:{node.lineno} a relative import not of a sibling at the module's top")
                continue
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not (path.name == "__main__.py" and top == "harness"):
                    outside.append(f"{path.name}:{node.lineno} imports {name}")
    assert not outside, "the harness imports outside the standard library and itself:\n" + "\n".join(outside)
    assert "harness" not in sys.stdlib_module_names  # it is imported as ``harness`` from the end of ``sys.path``
    assert {p.name for p in HARNESS.glob("*.py")} >= {"__init__.py", "__main__.py", "driver.py"}


def test_importing_the_config_loads_no_torch():
    """The config, its choices and ``import marft`` itself: flags, --help and validation without torch or peft."""
    code = ("import sys, marft, marft.config, marft.choices; heavy = sorted(m for m in ('torch', 'peft', 'transformers', 'numpy') "
            "if m in sys.modules); print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, f"importing marft.config loaded {result.stdout.strip()} {result.stderr[-2000:]}"


MAX_FUNCTION_LINES = 60
LONG_FUNCTION_REASON = "# long function:"


def test_functions_are_short_or_say_why():
    """No function in ``marft/`` over 60 lines (docstring included) unless the line above its ``def`` (or its
    decorators) starts with ``# long function:`` and a reason."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if not lines[first - 2].strip().startswith(LONG_FUNCTION_REASON):
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over 60 lines without a reason:\n" + "\n".join(long)


MAX_CLASS_LINES = 340
"""About 300 lines: a class over it does several jobs (split it into parts, as the trainers' batching, schedule, KL
and guarded steps, or the runner's log, resume and keep-best phases are)."""


def test_classes_are_short():
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(long)


def test_marft_modules_are_imported_at_the_top():
    """No function imports a marft module: the dependencies of a module are its first lines (optional third-party
    packages, such as vllm or textarena, are imported where they are used, by the marft module that wraps them)."""
    inside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any(name == "marft" or name.startswith("marft.") for name in names) or getattr(node, "level", 0):
                    inside.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} in {function.name}")
    assert not inside, "marft imports inside functions (move them to the module's imports):\n" + "\n".join(inside)


def test_every_implementation_table_has_exactly_the_choice_names():
    """Each choice flag's names (:mod:`marft.choices`) and the table that implements them agree."""
    from marft import choices
    from marft.agents.backends import BACKEND_CLASSES
    from marft.agents.dtypes import TORCH_DTYPES
    from marft.algorithms import trainer_class
    from marft.algorithms.losses import NORMALIZERS

    assert set(TORCH_DTYPES) == set(choices.DTYPES)
    assert set(BACKEND_CLASSES) == set(choices.GENERATION_BACKENDS)
    assert set(NORMALIZERS) == set(choices.NORMALIZATION_MODES)
    assert all(trainer_class(name) for name in choices.TRAINERS)
    assert set(choices.KL_COEF_DEFAULTS) == set(choices.TRAINERS)  # every trainer has its KL weight


def test_the_tests_mirror_the_package():
    """``tests/<folder>/`` holds the unit tests of ``marft/<folder>/`` (``cli`` for the entry points, ``models`` for the
    embedded models), ``tests/integration/`` the end-to-end and slow runs; only this file and helpers stay at the top."""
    tests = Path(__file__).resolve().parent
    folders = {folder.name for folder in tests.iterdir() if folder.is_dir() and any(folder.glob("test_*.py"))}
    assert folders - {"integration"} <= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}, folders
    assert [p.name for p in tests.glob("test_*.py")] == ["test_architecture.py"]

"""The code's layout rules, checked on the source: one folder per method under ``models/``, no method imports
another, and model code never imports the pipeline (``foresight``, ``tasks``, ``flows``, Prefect)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("sla", "medusa", "coral", "mtp")
SHARED = ("common", "engine", "labeling")
PIPELINE = ("foresight", "tasks", "flows", "prefect", "mlflow", "dvc", "great_expectations")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def model_files(folder: str) -> list[Path]:
    return sorted((ROOT / "models" / folder).glob("*.py"))


def test_models_has_one_folder_per_method_and_nothing_loose():
    loose = [p.name for p in (ROOT / "models").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"model code outside a method or shared folder: {loose}"
    folders = {p.name for p in (ROOT / "models").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders == set(METHODS) | set(SHARED)


@pytest.mark.parametrize("method", METHODS)
def test_no_method_imports_another(method):
    others = [m for m in METHODS if m != method]
    offending = {f"{path.relative_to(ROOT)} imports {module}"
                 for path in model_files(method) for module in imported_modules(path)
                 if any(module == f"models.{o}" or module.startswith(f"models.{o}.") for o in others)}
    assert not offending, sorted(offending)


@pytest.mark.parametrize("folder", SHARED)
def test_shared_code_imports_no_method(folder):
    offending = {f"{path.relative_to(ROOT)} imports {module}"
                 for path in model_files(folder) for module in imported_modules(path)
                 if any(module == f"models.{m}" or module.startswith(f"models.{m}.") for m in METHODS)}
    assert not offending, sorted(offending)


@pytest.mark.parametrize("folder", METHODS + SHARED)
def test_model_code_is_free_of_the_pipeline(folder):
    offending = {f"{path.relative_to(ROOT)} imports {module}"
                 for path in model_files(folder) for module in imported_modules(path)
                 if module.split(".")[0] in PIPELINE}
    assert not offending, sorted(offending)


def test_the_checker_sees_function_local_imports(tmp_path):
    """The rule would be toothless if imports inside functions slipped through."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from models.coral.training import train_coral\n    import foresight.config\n")
    assert imported_modules(path) == {"models.coral.training", "foresight.config"}


def test_loading_the_params_loads_no_model_code():
    """The params take their defaults from ``models/<folder>/config.py`` only: if ``foresight.config`` imported
    model code, every stage would depend on every method's code, and any edit would re-run the whole pipeline."""
    probe = ("import sys, foresight.config; "
             "print(sorted(m for m in sys.modules if m.startswith('models.') and not m.endswith('.config')"
             " and m.count('.') > 1))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


FLOORS = ("models", "foresight", "tasks", "flows")
"""The packages from the ground up: a module imports its own floor and the ones below, never one above (the CLI is
``flows/cli.py``, on the top floor)."""


def test_imports_go_one_way_and_the_module_graph_has_no_cycle():
    import graphlib

    graph: dict[str, set[str]] = {}
    upward = []
    for floor, package in enumerate(FLOORS):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top in FLOORS:
                    graph.setdefault(name, set()).add(module)
                    if FLOORS.index(top) > floor:
                        upward.append(f"{name} imports {module}")
    assert upward == []
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle
    # negative control: the checker sees an upward import and a cycle
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"a"}}).prepare()

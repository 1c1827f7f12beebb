"""House rules a reader relies on: layers by folder, no import cycles, one error root, test modules independent of
each other, nothing that names a file outside the repository."""

import ast
import importlib
import inspect
import re
import subprocess

import pytest

import edm2
from edm2.errors import EDM2Error
from tests.helpers import REPO

PACKAGES = ("edm2", "training", "cli")
# The layers of the code, low to high (README, Layout), one row per folder: a module has the layer of the folder it
# sits in, so a new module needs no row here, and imports only modules of its own layer or lower.
LAYERS = {
    "edm2": 0,  # the paper: its errors and the model (layers, networks, loss, solvers, sampler, phema, encoders, ...)
    "edm2.architectures": 0,  # the model's other network families
    "edm2.runtime": 1,
    "edm2.data": 2,
    "edm2.formats": 3,
    "edm2.toy": 4,
    "edm2.procedures": 5,  # the procedures over files: post-hoc EMA, generation, grids
    "edm2.eval": 6,
    "edm2.plots": 7,
    "training": 8,  # the recipe: options, presets, architecture, state, step, schedule, data order
    "training.run": 9,  # the run machinery (run directory, locks, checkpoints, outputs, ...) and the loop driving it
    "cli": 10,  # what the command lines share: the library and training below it, never imported by them
}
COMMAND_LINES = 11  # the command lines and scripts/, above everything
# Raised on purpose without being bad input: an abstract method, and the second Ctrl-C that aborts at once.
NOT_ERRORS = (NotImplementedError, KeyboardInterrupt)


def tracked(pattern: str) -> list[str]:
    """Files git tracks (or would track) under a pathspec, relative to the repository."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", pattern],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return sorted(set(out.split()))


def product_files() -> list[str]:
    """Python files of the library, the training code, the command lines and the scripts."""
    files = [f for package in PACKAGES for f in tracked(f"{package}/*.py")]
    return files + [f for f in tracked("*.py") if "/" not in f] + tracked("scripts/*.py")


def package_files() -> list[str]:
    """The product files inside the packages (not the command lines and scripts above them)."""
    return [f for f in product_files() if f.split("/")[0] in PACKAGES]


def module_name(path: str) -> str:
    """'edm2/runtime/files.py' -> 'edm2.runtime.files'; a package's __init__ is the package."""
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def imported_modules(path: str, known: set[str]) -> set[str]:
    """Project modules that a file imports anywhere, inside functions too."""
    found = set()
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # 'from edm2.runtime import files' imports the module edm2.runtime.files when one exists.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def test_no_import_cycle():
    files = {module_name(f): f for f in package_files()}
    graph = {name: imported_modules(path, set(files)) - {name} for name, path in files.items()}
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join(stack[stack.index(target):] + [target])
            if target not in state:
                visit(target, stack + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_checks_cover_every_python_file_of_the_packages():
    # A pathspec's '*' matches '/' too, so product_files holds the subpackages (edm2/runtime/files.py, ...).
    every = [f for package in PACKAGES for f in tracked(package) if f.endswith(".py")]
    assert any(f.count("/") > 1 for f in every) and set(every) <= set(product_files())


def folder(path: str) -> str:
    """The package a file sits in: 'edm2/runtime/files.py' and 'edm2/runtime/__init__.py' -> 'edm2.runtime'."""
    return path.rpartition("/")[0].replace("/", ".")


def layer(path: str) -> int | None:
    """A file's layer: its folder's in LAYERS, COMMAND_LINES outside the packages, None for a folder without a row."""
    if path.split("/")[0] not in PACKAGES:
        return COMMAND_LINES
    return LAYERS.get(folder(path))


def test_every_folder_has_a_layer_and_every_layer_a_folder():
    folders = {folder(f) for f in package_files()}
    assert folders == set(LAYERS), f"folders without a layer: {folders - set(LAYERS)}; rows without a folder: " \
                                   f"{set(LAYERS) - folders}"


def test_a_new_module_takes_the_layer_of_its_folder():
    # The promise to a newcomer: a module added to an existing folder is placed and checked without a table edit.
    for name, rank in LAYERS.items():
        new = name.replace(".", "/") + "/a_module_nothing_names.py"
        assert layer(new) == rank and {folder(f) for f in package_files() + [new]} == set(LAYERS), new
    assert layer("a_command_line_nothing_names.py") == layer("scripts/a_script.py") == COMMAND_LINES


def test_modules_import_only_their_own_layer_or_lower():
    files = {module_name(f): f for f in product_files()}
    wrong = []
    for name, path in files.items():
        for target in sorted(imported_modules(path, set(files)) - {name}):
            if (layer(files[target]) or 0) > (layer(path) or 0):
                wrong.append(f"{name} (layer {layer(path)}) imports {target} (layer {layer(files[target])})")
    assert not wrong, "imports against the layers: " + "; ".join(wrong)


def test_the_readme_quotes_the_layers():
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("```\n", readme.index("Layers, low to high")) + 4:]
    quoted, rank = {}, None
    for line in block[:block.index("```")].splitlines():
        if line[:1].isdigit():
            rank = int(line.split()[0])
        quoted |= dict.fromkeys(re.findall(r"\b(?:edm2|training|cli)(?:\.\w+)?\b", line), rank)
    assert quoted == LAYERS


@pytest.mark.parametrize("path", tracked("tests/test_*.py"))
def test_test_modules_import_no_other_test_module(path):
    tree = ast.parse((REPO / path).read_text())
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [m for m in modules if m.split(".")[-1].startswith("test_")], path


def test_nothing_names_a_file_outside_the_repository():
    outside = ("../shared", "shared/reference", "FACTS.md", "DESIGN.md", "edm2-paper.md")
    offenders = [(path, word) for path in tracked(".") if path != "tests/test_structure.py"
                 for word in outside if (REPO / path).is_file() and word in (REPO / path).read_text(errors="replace")]
    assert not offenders


def raised_classes(path: str) -> list[tuple[int, type]]:
    """(line, class) of every `raise Name(...)` in a library file whose name resolves to a class."""
    module = importlib.import_module(module_name(path))
    found = []
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            expression = ast.unparse(node.exc.func)
            value = module
            for part in expression.split("."):
                value = getattr(value, part, None)
            if inspect.isclass(value):
                found.append((node.lineno, value))
    return found


@pytest.mark.parametrize("path", [f for package in ("edm2", "training") for f in tracked(f"{package}/*.py")])
def test_library_errors_share_one_root(path):
    module = importlib.import_module(module_name(path))
    defined = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
               if cls.__module__ == module.__name__ and issubclass(cls, BaseException)]
    assert all(issubclass(cls, EDM2Error) for cls in defined), [c.__name__ for c in defined]
    wrong = [(line, cls.__name__) for line, cls in raised_classes(path)
             if not issubclass(cls, (EDM2Error, *NOT_ERRORS))]
    assert not wrong, f"{path} raises errors outside EDM2Error: {wrong}"


def test_the_package_docstring_names_every_subpackage():
    subpackages = {path.split("/")[1] for path in tracked("edm2/*/__init__.py")}
    assert subpackages and not [name for name in subpackages if f"{name} (" not in " ".join(edm2.__doc__.split())]


def test_the_install_holds_only_the_designed_packages():
    # cli/ serves the command lines beside it; an installed top-level 'cli' would shadow or be shadowed by others.
    text = (REPO / "pyproject.toml").read_text()
    listed = re.findall(r'"([\w.]+)"', text[text.index("packages = ["):text.index("]", text.index("packages = ["))])
    assert {name.split(".")[0] for name in listed} == {"edm2", "training"}
    assert set(listed) == {module_name(f) for f in tracked("*/__init__.py") if f.split("/")[0] in {"edm2", "training"}}

"""The package never reaches into private attributes of the libraries it stands on.

A private attribute of botocore, urllib3, s3fs, obstore or fsspec can change in any
release the user installs, so the data path must not touch one. Checked on the
source: every ``obj._name`` the package reads must be a name the package itself
defines, and nothing private is imported from those libraries.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dcp_volumes

PACKAGE = Path(dcp_volumes.__file__).parent
CLIENT_LIBRARIES = ("botocore", "boto3", "urllib3", "s3fs", "obstore", "fsspec", "adlfs", "gcsfs")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _slots(node: ast.AST) -> list[str]:
    """The names a ``__slots__ = (...)`` assignment declares."""
    if not isinstance(node, ast.Assign) or not any(
        isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
    ):
        return []
    return [
        c.value for c in ast.walk(node.value)
        if isinstance(c, ast.Constant) and isinstance(c.value, str)
    ]


def _defined_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every private name the package defines: functions, classes, attributes, variables."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            names.update(_slots(node))
    return {n for n in names if _private(n)}


def _private_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """``obj._name`` reads, and ``getattr``/``hasattr``/``setattr(obj, "_name")`` calls."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            reads.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            reads.append((node.lineno, node.args[1].value))
    return reads


# The one module that may name torch's private API (each name behind one alias or
# function there, so a torch release that moves one is mended in one place).
TORCH_SEAM = PACKAGE / "_torch.py"
# Public API despite the underscore: os._exit, a namedtuple's _replace/_asdict.
PUBLIC_UNDERSCORE = frozenset({"_exit", "_replace", "_asdict"})


def test_no_private_attribute_of_another_library_is_read() -> None:
    trees = _trees()
    ours = _defined_names(trees) | PUBLIC_UNDERSCORE
    # Module names of the package itself (dcp_volumes._volume, ...).
    ours |= {p.stem for p in PACKAGE.rglob("*.py")}
    ours |= {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    foreign = []
    for path, tree in trees.items():
        if path == TORCH_SEAM:
            continue
        for lineno, name in _private_reads(tree):
            if name not in ours:
                foreign.append(f"{path.relative_to(PACKAGE)}:{lineno}: .{name}")
    assert not foreign, "private attributes of other libraries:\n" + "\n".join(foreign)


def test_private_torch_modules_are_imported_only_by_the_seam() -> None:
    found = []
    for path, tree in _trees().items():
        if path == TORCH_SEAM:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "torch"
            ):
                parts = node.module.split(".")
                if any(_private(p) for p in parts) or any(_private(a.name) for a in node.names):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.module}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch") and any(
                        _private(p) for p in alias.name.split(".")
                    ):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {alias.name}")
    assert not found, "private torch names outside dcp_volumes/_torch.py:\n" + "\n".join(found)


def test_nothing_private_is_imported_from_client_libraries() -> None:
    found = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                top = node.module.split(".")[0]
                if top not in CLIENT_LIBRARIES:
                    continue
                if any(_private(part) for part in node.module.split(".")) or any(
                    _private(a.name) for a in node.names
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.module}")
    assert not found, "private imports from client libraries:\n" + "\n".join(found)


def test_the_check_catches_a_private_attribute(tmp_path: Path) -> None:
    # The same rule on a snippet that does what the old S3 path did.
    tree = ast.parse("def f(client):\n    return client._client_config.http_session\n")
    assert [name for _, name in _private_reads(tree)] == ["_client_config"]
    assert "_client_config" not in _defined_names(_trees())


def test_the_check_catches_a_private_attribute_read_through_getattr() -> None:
    tree = ast.parse('def f(t):\n    return getattr(t, "_local_tensor", None)\n')
    assert [name for _, name in _private_reads(tree)] == ["_local_tensor"]
    assert "_local_tensor" not in _defined_names(_trees())

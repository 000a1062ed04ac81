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
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # __slots__ entries
    return {n for n in names if _private(n)}


# Private names of other libraries that the package reads knowingly: none of an
# object-store client. os._exit and namedtuple._replace are public API despite
# the underscore; the rest are torch internals (its weights-only unpickler, shared
# memory for DataLoader batches, the DataLoader's iterator, numpy's global RNG),
# each pinned by tests on the torch installed.
KNOWN_NON_CLIENT = frozenset(
    {"_exit", "_replace", "_C", "_load", "_weights_only_unpickler", "_new_shared",
     "_share_filename_cpu_", "_iterator", "_inst"}
)


def test_no_private_attribute_of_another_library_is_read() -> None:
    trees = _trees()
    ours = _defined_names(trees) | KNOWN_NON_CLIENT
    # Module names of the package itself (dcp_volumes._volume, ...).
    ours |= {p.stem for p in PACKAGE.rglob("*.py")}
    ours |= {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    foreign = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
                foreign.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert not foreign, "private attributes of other libraries:\n" + "\n".join(foreign)


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
    tree = ast.parse("def f(client):\n    return client._endpoint.http_session\n")
    reads = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr)]
    assert reads == ["_endpoint"]
    assert "_endpoint" not in _defined_names(_trees())

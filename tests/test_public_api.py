"""The public surface: everything exported is listed, documented and shown as asyncstore.X."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from types import ModuleType

import pytest

import asyncstore
from asyncstore import errors


def _all_modules() -> list[str]:
    # Every module a user can import, found by walking the package (as anyio's
    # test_all_attributes does) so that a new one is checked without being listed here.
    # ``__main__`` runs the command line when imported: it is a script, not a module.
    found = pkgutil.walk_packages(asyncstore.__path__, "asyncstore.")
    return [
        "asyncstore",
        *sorted(info.name for info in found if not info.name.endswith("__main__")),
    ]


MODULES = _all_modules()
# Public: no part of the dotted path starts with "_" (asyncstore.stores.s3, not
# asyncstore.stores._base).
PUBLIC_MODULES = [name for name in MODULES if not any(p.startswith("_") for p in name.split("."))]
WITH_ALL = [name for name in MODULES if hasattr(importlib.import_module(name), "__all__")]


def _bound_here(module: ModuleType) -> set[str]:
    """Names the module's own top-level code binds, other than by an import."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
                continue  # what its body binds is not the module's
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.For):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(
                    leaf.id
                    for target in targets
                    for leaf in ast.walk(target)
                    if isinstance(leaf, ast.Name)
                )
            # A block's statements bind at top level too (`if sys.platform ...:`, `try:`).
            children = list(ast.iter_child_nodes(node))
            visit([child for child in children if isinstance(child, ast.stmt)])
            for child in children:
                if isinstance(child, ast.ExceptHandler):
                    visit(child.body)

    visit(ast.parse(inspect.getsource(module)).body)
    return names


def _offered(module: ModuleType) -> set[str]:
    """The public names a module offers: those it defines and, for a package, every
    asyncstore name it holds (a package's ``__init__`` exists to re-export its parts)."""
    offered = _bound_here(module)
    if hasattr(module, "__path__"):
        offered |= {
            attr
            for attr, value in vars(module).items()
            if getattr(value, "__module__", module.__name__).startswith("asyncstore")
        }
    return {
        attr
        for attr in offered
        if not attr.startswith("_")
        and hasattr(module, attr)  # not one annotated but never assigned
        and not inspect.ismodule(getattr(module, attr))
    }


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_lists_every_public_name(name: str) -> None:
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} is public and defines no __all__"
    missing = _offered(module) - set(module.__all__)
    assert missing == set(), f"{name} exposes names missing from __all__"


def _has_docstring(value: object) -> bool:
    if not (inspect.isclass(value) or inspect.isroutine(value)):
        # A constant or a type alias cannot carry a docstring of its own (its __doc__ is its
        # type's): a comment beside its definition documents it.
        return True
    doc = (value.__doc__ or "").strip()
    # Dataclasses and named tuples without a docstring are given one, their signature.
    generated = re.fullmatch(rf"{re.escape(value.__name__)}\(.*\)", doc, flags=re.DOTALL)
    return bool(doc) and not generated


@pytest.mark.parametrize("name", WITH_ALL)
def test_every_name_in_all_exists_and_is_documented(name: str) -> None:
    module = importlib.import_module(name)
    absent = [attr for attr in module.__all__ if not hasattr(module, attr)]
    assert absent == [], f"{name}.__all__ lists names it does not have"
    undocumented = [attr for attr in module.__all__ if not _has_docstring(getattr(module, attr))]
    assert undocumented == [], f"{name}.__all__ lists names without a docstring"


def test_every_public_name_has_a_docstring() -> None:
    for name in asyncstore.__all__:
        obj = getattr(asyncstore, name)
        assert inspect.getdoc(obj), f"asyncstore.{name} has no docstring"


def test_public_classes_show_the_top_level_module() -> None:
    assert repr(asyncstore.S3Store) == "<class 'asyncstore.S3Store'>"
    assert asyncstore.NotFound.__module__ == "asyncstore"


def test_error_tree() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.AsyncStoreError)
        assert (cls.__doc__ and "raised" in cls.__doc__.lower()) or cls is errors.AsyncStoreError
    assert issubclass(errors.InvalidKey, ValueError)
    assert issubclass(errors.InvalidURL, ValueError)
    assert issubclass(errors.NotFound, FileNotFoundError)
    assert issubclass(errors.PermissionDenied, PermissionError)


def test_no_private_module_is_imported_by_name_from_outside() -> None:
    # Every subpackage imports cleanly on its own (no import cycles hidden by import order).
    for name in MODULES:
        importlib.import_module(name)


def _package_of(module: str) -> str:
    """The package a module belongs to, for the seams: ``asyncstore.cache`` for
    ``asyncstore.cache._tiered``; a top-level module (``asyncstore._loop``,
    ``asyncstore.errors``) is a package of its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_package_imports_a_private_name_of_another() -> None:
    # import-linter's contracts see modules; this sees names: `from ..errors import _plain`
    # reaches into errors as much as importing a private module would.
    reaches = []
    for name in MODULES:
        module = importlib.import_module(name)
        package = module.__name__ if hasattr(module, "__path__") else module.__package__
        assert package is not None
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
            if _package_of(source) == _package_of(name):
                continue
            reaches += [
                f"{name}: from {source} import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_")
            ]
    assert not reaches, "private names imported across packages:\n" + "\n".join(reaches)

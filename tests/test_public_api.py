"""The public surface: everything exported is listed, documented and shown as asyncstore.X."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import asyncstore
from asyncstore import errors

PUBLIC_MODULES = [
    "asyncstore",
    "asyncstore.errors",
    "asyncstore.stores",
    "asyncstore.cache",
    "asyncstore.testing",
    "asyncstore.checkpoint",
    "asyncstore.torch",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_lists_every_public_name(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and not inspect.ismodule(value)
        and getattr(value, "__module__", name).startswith("asyncstore")
        and attr not in {"annotations"}
    }
    assert public - exported == set(), f"{name} exposes names missing from __all__"
    assert all(hasattr(module, attr) for attr in exported)


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
    for info in pkgutil.walk_packages(asyncstore.__path__, "asyncstore."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)

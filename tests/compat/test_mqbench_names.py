"""Every public name of MQBench (the list in mqbench_api.py) is importable from MQBench's module path, or listed
as not provided with its reason; the count cannot fall without this test failing."""

from __future__ import annotations

import importlib

import pytest

from mqbench_api import NOT_PROVIDED, PROVIDED, RAISING

NAMES = sorted((module, name) for module, names in PROVIDED.items() for name in names)


def test_the_lists_do_not_overlap_and_cover_mqbench():
    provided = set(NAMES)
    assert not provided & set(NOT_PROVIDED)
    assert provided >= RAISING
    assert len(provided) == 280 and len(NOT_PROVIDED) == 64  # 344 names; update both when one moves


@pytest.mark.parametrize("module", sorted(PROVIDED))
def test_each_provided_name_imports_from_mqbenchs_module_path(module):
    imported = importlib.import_module(module)
    missing = [name for name in PROVIDED[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def test_names_not_provided_are_absent_and_explained():
    present = []
    for (module, name), reason in NOT_PROVIDED.items():
        assert len(reason) > 40, (module, name)
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        if hasattr(imported, name):
            present.append((module, name))
    assert not present, f"provided now: move {present} to PROVIDED"


@pytest.mark.parametrize(("module", "name"), sorted(RAISING))
def test_names_that_cannot_keep_their_meaning_raise_naming_the_replacement(module, name):
    function = getattr(importlib.import_module(module), name)
    with pytest.raises(NotImplementedError, match="find_units"):
        function()

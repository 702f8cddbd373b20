"""Validation of the dict-shaped configuration that MQBench's API takes.

Example:
    >>> from mqbench.utils.config import check_keys
    >>> check_keys({"leaf_module": []}, ("leaf_module", "concrete_args"), "prepare_custom_config_dict")
    >>> check_keys({"leaf_modules": []}, ("leaf_module",), "prepare_custom_config_dict")
    Traceback (most recent call last):
    ...
    ValueError: unknown prepare_custom_config_dict key 'leaf_modules'; valid keys: leaf_module
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_keys"]


def check_keys(given: Mapping[str, Any], valid: Iterable[str], what: str) -> None:
    """Raise ValueError naming the first unknown key of ``given`` and listing the valid ones."""
    valid = tuple(valid)
    for key in given:
        if key not in valid:
            raise ValueError(f"unknown {what} key {key!r}; valid keys: {', '.join(valid)}")

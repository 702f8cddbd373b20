"""The package's logger (``"mqbench"``), with MQBench's helpers to set its level or silence it.

Example:
    >>> from mqbench.utils.logger import logger, set_log_level
    >>> set_log_level("WARNING")
    >>> logger.name, logger.level == 30
    ('mqbench', True)
"""

from __future__ import annotations

import logging
import sys

__all__ = ["disable_logging", "logger", "set_log_level"]

logger = logging.getLogger("mqbench")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def set_log_level(level: int | str) -> None:
    """``logging.INFO``, ``"DEBUG"``, ... for mqbench's messages."""
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
        level = named
    logger.setLevel(level)


def disable_logging() -> None:
    """Silence mqbench's messages (errors included)."""
    logger.setLevel(logging.CRITICAL + 1)

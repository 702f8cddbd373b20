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

__all__ = [
    "MQBENCH_LOGGER_NAME",
    "QBENCH_LOGGER_NAME",
    "disable_logging",
    "fmt",
    "logger",
    "set_log_level",
    "stdout_handler",
]

QBENCH_LOGGER_NAME = "mqbench"  # MQBench's name for the logger's name
MQBENCH_LOGGER_NAME = QBENCH_LOGGER_NAME  # its later name for it: logging.getLogger(MQBENCH_LOGGER_NAME) is the logger
fmt = logging.Formatter("[%(name)s %(levelname)s] %(message)s")
logger = logging.getLogger(QBENCH_LOGGER_NAME)
# The handler mqbench's messages go through (MQBench's name; they go to stderr, as warnings do).
stdout_handler = next((h for h in logger.handlers if getattr(h, "_mqbench", False)), None) or logging.StreamHandler(
    sys.stderr
)
if not logger.handlers:
    stdout_handler.setFormatter(fmt)
    stdout_handler._mqbench = True  # type: ignore[attr-defined]
    logger.addHandler(stdout_handler)
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

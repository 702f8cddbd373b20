"""Artifact writers: one module per format, each with ``write(context) -> path`` and, for parameter files, ``read``."""

from mqbench.deploy.writers.registry import READERS, WRITERS

__all__ = ["READERS", "WRITERS"]

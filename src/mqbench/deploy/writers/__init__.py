"""Artifact writers: one module per format, each with ``write(context) -> path`` and, for parameter files, ``read``."""

from mqbench.deploy.writers.registry import FORMATS, READERS, WRITERS, ArtifactFormat

__all__ = ["FORMATS", "READERS", "WRITERS", "ArtifactFormat"]

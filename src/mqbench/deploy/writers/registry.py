"""Artifact key -> writer, and parameter-file key -> reader (filled from the format modules below)."""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["READERS", "WRITERS"]

_writers: dict = {}
_readers: dict = {}

WRITERS = MappingProxyType(_writers)
READERS = MappingProxyType(_readers)

"""Application code on top of the library: the demo, the verify command and their training helpers."""

__all__: list[str] = []

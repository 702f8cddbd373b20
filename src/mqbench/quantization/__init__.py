"""MQBench's ``mqbench.quantization`` helpers (qconfig dict flattening)."""

__all__: list[str] = []

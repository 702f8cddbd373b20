"""The demo's table: each backend's real weight and activation formats, columns as wide as their entries, and the
warnings once each below the table (the end-to-end run: tests/test_cli.py)."""

from __future__ import annotations

from mqbench.app.demo import DemoRow, _scheme_text, format_table
from mqbench.backends import ParamsTable


def _formats(backend: str) -> tuple[str, str]:
    spec = ParamsTable[backend]
    weights = _scheme_text(spec.weight.scheme if spec.weight else None, "int8 LSQ")
    default = "uint8 LSQ" if spec.weight is None else "float"
    return weights, _scheme_text(spec.activation.scheme if spec.activation else None, default)


def test_each_backend_row_names_its_real_formats():
    assert _formats("llm_w4a16") == ("int4 g128", "float")
    assert _formats("llm_w8a16") == ("int8 g128", "float")
    assert _formats("tensorrt_fp8") == ("FP8 E4M3 per-channel", "FP8 E4M3")
    assert _formats("tensorrt") == ("int8 per-channel", "int8")
    assert _formats("snpe") == ("uint8", "uint8")
    assert _formats("pplw8a16") == ("uint8", "uint16")
    assert _formats("vitis") == ("int8 pot", "int8 pot")


def test_columns_fit_their_entries_and_warnings_come_once_below():
    rows = [
        DemoRow("float", "fp32", "fp32", 0.96, 1.0),
        DemoRow(
            "tensorrt_fp8 (PTQ)",
            "FP8 E4M3 per-channel",
            "FP8 E4M3",
            0.95,
            2.0,
            0.95,
            "onnxruntime (as written)",
            0.0,
            2,
            warnings=("layer fc left float",),
        ),
        DemoRow("llm_w4a16 (PTQ)", "int4 g128", "float", 0.9, 3.0, 0.9, "onnxruntime", 0.0, 2, ("onnx: off",)),
    ]
    text = format_table(rows, 0.96)
    lines = text.splitlines()
    header = lines[1]
    assert header.index("activations") > header.index("weights") + len("FP8 E4M3 per-channel")
    table = lines[3:6]
    for line in table:  # every row's columns start where the header's do
        assert line[header.index("weights") - 1] == " " and line[header.index("activations") - 1] == " "
    assert "onnxruntime (as written)" in table[1]
    assert "FAILED llm_w4a16 (PTQ): onnx: off" in text
    assert text.splitlines()[-2:] == ["warnings:", "  tensorrt_fp8 (PTQ): layer fc left float"]

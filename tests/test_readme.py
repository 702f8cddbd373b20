"""The README's quick start runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python quick start"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    import onnx

    exported = onnx.load(str(tmp_path / "resnet18.onnx"))
    assert sum(node.op_type == "QuantizeLinear" for node in exported.graph.node) > 20
    assert sorted(namespace["result"].artifacts) == ["calib_cache", "clip_ranges", "deploy_onnx", "onnx"]
    assert (tmp_path / "resnet18_clip_ranges.json").is_file()
    assert len(blocks[0].strip().splitlines()) <= 20

"""An op the ONNX exporter cannot write is named with who calls it: the model's own code (change the op), or a
library's code the model runs (call the model otherwise)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch import nn

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.op_origin import library_of, refused_op
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

# ``aten::kthvalue`` has no ONNX form at opset 17 (the exporter refuses it, as it does histc, cummax, mode ...).
LIBRARY = '''
import torch
from torch import nn


class KthShift(nn.Module):
    """Subtracts the second smallest value of each row."""

    def forward(self, x):
        return x - torch.kthvalue(x, 2, dim=-1, keepdim=True).values
'''


class OwnKth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x - torch.kthvalue(x, 2, dim=-1, keepdim=True).values)


class LibraryKth(nn.Module):
    def __init__(self, shift: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.shift = shift

    def forward(self, x):
        return self.shift(self.linear(x))


def _deploy(model: nn.Module, tmp_path, **config) -> str:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    qmodel = prepare_by_platform(model.eval(), "tensorrt", {"example_inputs": (x,), **config})
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(x)
    enable_quantization(qmodel)
    with pytest.raises(NotImplementedError) as error:
        convert_deploy(qmodel, "tensorrt", dummy_input=x, output_path=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    return str(error.value)


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A module of an installed library (a file in a site-packages folder) whose forward calls kthvalue."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "kthlib.py").write_text(LIBRARY)
    spec = importlib.util.spec_from_file_location("kthlib", folder / "kthlib.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kthlib", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_an_op_of_the_model_s_own_code_is_named_as_the_model_s(capture, tmp_path):
    message = _deploy(OwnKth(), tmp_path, capture=capture)
    assert "'aten::kthvalue'" in message
    assert "The op is in the model's own code" in message and "Change that op of the model" in message
    assert "graph node 'kthvalue'" in message
    if capture == "export":  # torch.export keeps the line that called it
        assert f"{__file__}:" in message and "in forward, `return self.linear(x - torch.kthvalue(" in message


@pytest.mark.parametrize("leaf", [False, True], ids=["traced", "kept_whole"])
def test_an_op_of_a_library_s_code_is_named_as_the_library_s(leaf, library, tmp_path):
    """Captured into the graph (the stack torch.export keeps on the node) or inside a module kept whole (the stack
    of its call when the model runs): the message names the library and says the model is not where to change it."""
    config = {"capture": "export", "leaf_module": [library.KthShift] if leaf else []}
    message = _deploy(LibraryKth(library.KthShift()), tmp_path, **config)
    assert "'aten::kthvalue'" in message
    assert "The op is called by kthlib's code, not the model's" in message
    assert "kthlib.py:" in message and "Call the model so that kthlib takes another path" in message
    assert "Change that op of the model" not in message and "attention_mask" not in message


def test_names_of_refused_ops_and_owners_of_files():
    assert refused_op("Exporting the operator 'aten::histc' to ONNX opset version 17 is not supported.") == "histc"
    assert refused_op("Unsupported: ONNX export of operator adaptive_avg_pool2d, output size ...") == (
        "adaptive_avg_pool2d"
    )
    assert refused_op("something else went wrong") is None
    assert library_of(torch.__file__) == "torch"
    assert library_of("/opt/venv/lib/python3.11/site-packages/transformers/masking_utils.py") == "transformers"
    assert library_of(__file__) is None and library_of("<eval_with_key>.3") is None

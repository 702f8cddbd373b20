"""In-place ops keep their meaning after prepare: a value an in-place op rewrites is read, by every reader after
it, as rewritten, in the float mode and in the quantized mode, on every backend and with both captures.

The model is the pattern of a VGG-BN backbone with a skip (a text detector's): a convolution and BatchNorm, then
an in-place op on that output while a skip branch holds the same tensor, and a concatenation of the skip with the
branch's result. In the float model the skip reads the rewritten values; each case is compared with the same
model written out of place (the op's result named and read by both branches).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_configs import config_for, host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization

BACKENDS = [backend.value for backend in BackendType]

# name: (the in-place form, the same op out of place)
OPS: dict[
    str, tuple[Callable[[nn.Module, torch.Tensor], torch.Tensor], Callable[[nn.Module, torch.Tensor], torch.Tensor]]
]
OPS = {
    "ReLU(inplace=True)": (lambda m, y: m.relu(y), lambda m, y: F.relu(y)),
    "ReLU6(inplace=True)": (lambda m, y: m.relu6(y), lambda m, y: F.relu6(y)),
    "F.relu(inplace=True)": (lambda m, y: F.relu(y, inplace=True), lambda m, y: F.relu(y)),
    "relu_": (lambda m, y: y.relu_(), lambda m, y: y.relu()),
    "add_": (lambda m, y: y.add_(0.5), lambda m, y: y + 0.5),
    "mul_": (lambda m, y: y.mul_(2.0), lambda m, y: y * 2.0),
}


class SkipAroundInPlace(nn.Module):
    def __init__(self, op: str, in_place: bool) -> None:
        super().__init__()
        self.op, self.in_place = op, in_place
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.relu6 = nn.ReLU6(inplace=True)
        self.branch = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if self.in_place:
            skip = y  # rewritten by the op below: the skip reads the op's result
            z = self.branch(OPS[self.op][0](self, y))
        else:
            y = OPS[self.op][1](self, y)
            skip, z = y, self.branch(y)
        return self.head(torch.cat([skip, z], 1))


def _models(op: str) -> tuple[nn.Module, nn.Module]:
    models = []
    for in_place in (True, False):
        torch.manual_seed(0)
        model = SkipAroundInPlace(op, in_place)
        with torch.no_grad():
            model.bn.running_mean.uniform_(-1, 1)  # values on both sides of zero for the ReLUs
            model.bn.running_var.uniform_(0.5, 2)
        models.append(model.eval())
    return models[0], models[1]


def _inputs() -> torch.Tensor:
    return torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1))


def _prepared(
    model: nn.Module, backend: str, config: dict | None, x: torch.Tensor, capture: str
) -> torch.fx.GraphModule:
    settings = {**(config or {}), "capture": capture}
    if capture == "export":
        settings["example_inputs"] = (x,)
    qmodel = prepare_by_platform(model, backend, settings)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(x.clone())
    enable_quantization(qmodel)
    return qmodel


CASES = [(b, op, "fx") for b in BACKENDS for op in OPS]
CASES += [(b, op, "export") for b in ("tensorrt", "openvino", "snpe") for op in OPS]


@pytest.mark.parametrize(("backend", "op", "capture"), CASES)
def test_an_in_place_op_read_by_a_skip_keeps_its_meaning(backend, op, capture):
    in_place, out_of_place = _models(op)
    x = _inputs()
    with torch.no_grad():
        expected = out_of_place(x.clone())
        torch.testing.assert_close(in_place(x.clone()), expected)  # the two models are one function
    config = config_for(backend)
    quantized = [_prepared(m, backend, config, x, capture) for m in (in_place, out_of_place)]
    with torch.no_grad():
        # quantized: the same quantizers on the same values, so the same outputs, bit for bit
        assert torch.equal(quantized[0](x.clone()), quantized[1](x.clone()))
        disable_all(quantized[0])
        torch.testing.assert_close(quantized[0](x.clone()), expected, rtol=1e-5, atol=1e-5)  # float mode: BN folded


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_skip_pattern_deploys_and_verifies(backend, tmp_path):
    """The text detector's case end to end: near float in simulation, and the files compute the simulation."""
    model, _ = _models("ReLU(inplace=True)")
    x = _inputs()
    qmodel = _prepared(model, backend, host_config(backend), x, "fx")
    with torch.no_grad():
        reference = model(x.clone())
        relative = float((qmodel(x.clone()) - reference).norm() / reference.norm())
    # a skip that read the values before the ReLU would be 0.77 away (computed from the float layers)
    assert relative < 0.1, relative
    result = convert_deploy(qmodel, backend, dummy_input=x.clone(), output_path=tmp_path)
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()

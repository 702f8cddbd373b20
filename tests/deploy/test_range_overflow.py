"""A quantizer whose grid reaches beyond float32 (values near float32's limit: mask arithmetic, unbounded values)
cannot be written in any deployed file: the cast overflows to inf, and the files would compute inf or NaN.
Deploy refuses it on every backend with an error naming the tensor and its quantizer, writes nothing, and a grid
just inside the limit deploys with no overflow in any cast."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.qparams import QParamTable, TensorQParams
from mqbench.utils.state import enable_calibration, enable_quantization

BACKENDS = [backend.value for backend in BackendType]
LIMIT = float(np.finfo(np.float32).max)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.relu(self.first(x)) + 1.0)


def _prepared(backend: str) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    qmodel = prepare_by_platform(TwoLayers().eval(), backend, host_config(backend))
    enable_calibration(qmodel)
    qmodel(x)
    enable_quantization(qmodel)
    return qmodel, x


def _widen(qmodel: nn.Module, factor: float) -> list[str]:
    """Scale every activation quantizer's grid so that its widest end or width is ``factor`` x float32's largest
    (a log grid's data_max: that much, or inf beyond the limit, which is what a float32 statistic becomes)."""
    names = []
    for name, module in qmodel.named_modules():
        if not isinstance(module, QuantizeBase) or "weight" in name:
            continue
        names.append(name)
        if hasattr(module, "data_max"):  # NNIE's log grid is its largest magnitude
            module.data_max.fill_(float("inf") if factor > 1 else factor * LIMIT)
        elif hasattr(module, "log2_threshold"):  # TQT: scale 2 ** ceil(log2_threshold) / 2 ** (bits - 1)
            reach = module.quant_max - module.quant_min
            module.log2_threshold.data.fill_(math.log2(factor * LIMIT / reach * 2 ** (module.bitwidth - 1)))
        else:
            low, high = module.quant_min, module.quant_max
            zero = float(module.zero_point.detach().flatten()[0])
            reach = max(abs(low - zero), abs(high - zero), high - low)
            module.scale.data.fill_(factor * LIMIT / reach)
    assert names
    return names


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grid_beyond_float32_is_refused_naming_the_tensor(backend, tmp_path):
    qmodel, x = _prepared(backend)
    quantizers = _widen(qmodel, 2.5)
    folder = tmp_path / "out"
    with pytest.raises(ValueError, match="cannot be deployed") as raised:
        convert_deploy(qmodel, backend, dummy_input=x, output_path=str(folder), model_name="m")
    message = str(raised.value)
    assert "beyond float32" in message and "exclude" in message, message
    assert any(f"quantizer {name!r}" in message for name in quantizers), message
    assert not folder.exists() or not any(folder.iterdir())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grid_just_inside_float32_deploys_without_overflow(backend, tmp_path):
    qmodel, x = _prepared(backend)
    _widen(qmodel, 0.9)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="overflow encountered", category=RuntimeWarning)
        result = convert_deploy(qmodel, backend, dummy_input=x, output_path=str(tmp_path), model_name="m")
    for entry in result.table.values():
        assert entry.float32_overflow() is None
        low, high = entry.float_range()
        assert np.all(np.isfinite(low)) and np.all(np.isfinite(high))


def test_the_check_is_the_formula_per_channel():
    limit = LIMIT
    scale = np.array([1.0, limit / 200.0, limit / 300.0], np.float64)
    # width 255 steps: channel 1 reaches 255 * limit / 200 > limit, channel 2 stays at 0.85 * limit
    entry = TensorQParams(scale, np.zeros(3, np.int32), -128, 127, axis=0, kind="weight")
    why = entry.float32_overflow()
    assert why is not None and "channel 1, 1 of 3 channels" in why
    inside = TensorQParams(scale[[0, 2]], np.zeros(2, np.int32), -128, 127, axis=0, kind="weight")
    assert inside.float32_overflow() is None
    with pytest.raises(ValueError, match=r"tensor 'w' \(quantizer 'fc.weight_fake_quant'\) cannot be deployed"):
        QParamTable({"w": entry.with_changes(quantizer="fc.weight_fake_quant")})

"""Every backend on every model of the zoo: deploy, every quantized tensor in the parameter files, verify."""

from __future__ import annotations

import pytest
import torch

from backend_configs import config_for
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers import READERS
from mqbench.fake_quantize import QuantizeBase
from mqbench.models.zoo import VISION_MODELS, zoo_model
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

pytestmark = pytest.mark.slow

BACKENDS = [backend.value for backend in BackendType]
# LSBs a runtime may differ from the simulation on one tensor computed from the same inputs:
# a rounding tie decided the other way by a different float summation order.
LSB_TOLERANCE = {"nnie": 2, "vitis": 2}


def quantized_calls(qmodel: torch.nn.Module, x: torch.Tensor) -> int:
    count = 0

    def hook(module: QuantizeBase, *_: object) -> None:
        nonlocal count
        count += bool(module.fake_quant_enabled[0])

    handles = [m.register_forward_hook(hook) for m in qmodel.modules() if isinstance(m, QuantizeBase)]
    with torch.no_grad():
        qmodel.eval()(x)
    for handle in handles:
        handle.remove()
    return count


@pytest.mark.parametrize("name", sorted(VISION_MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_deploy_and_verify(name, backend, tmp_path):
    zoo = zoo_model(name)
    qmodel = prepare_by_platform(zoo.model, backend, prepare_custom_config_dict=config_for(backend))
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(zoo.calibration[:16])
    enable_quantization(qmodel)
    x = zoo.evaluation[:2]
    result = convert_deploy(qmodel, backend, {"x": list(x.shape)}, output_path=tmp_path, model_name=name)
    # Every tensor the simulation quantizes has an entry (the count of quantizer calls is independent).
    assert len(result.table) == quantized_calls(qmodel, x)
    for key in result.artifacts:
        if key in READERS:
            import onnx

            from mqbench.backends import resolve_backend

            read = READERS[key](
                result.artifacts[key], resolve_backend(backend), onnx.load(result.artifacts["deploy_onnx"])
            )
            expected = set(result.table.activations()) if key == "calib_cache" else set(result.table)
            assert expected <= set(read), (key, sorted(expected - set(read))[:5])
    report = verify_deploy(qmodel, result, x)
    tolerance = LSB_TOLERANCE.get(backend, 1)
    for key, art in report.artifacts.items():
        assert art.per_tensor, key
        assert art.max_lsb_diff <= tolerance, (key, art.first_divergence, art.max_lsb_diff)
        if art.runtime.startswith("onnxruntime"):
            # The Q/DQ arithmetic on onnxruntime: bit-exact but for rounding ties decided differently.
            # (OpenVINO runs its own integer kernels and requantization: within 1 LSB, not bit-exact.)
            assert art.tensor_exact_fraction >= 0.99, (key, art.tensor_exact_fraction)

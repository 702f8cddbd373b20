"""Every backend on every model of the zoo: deploy, every quantized tensor in the parameter files, verify."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_configs import config_for
from mqbench.backends import resolve_backend
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.cpu_check import CPU_ARTIFACTS
from mqbench.deploy.verify import verify_deploy
from mqbench.deploy.writers import READERS
from mqbench.fake_quantize import QuantizeBase
from mqbench.models.zoo import VISION_MODELS, zoo_model
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.host import int8_pairs_saturate
from mqbench.utils.state import enable_calibration, enable_quantization

pytestmark = pytest.mark.slow

BACKENDS = [backend.value for backend in BackendType]
# LSBs a runtime may differ from the simulation on one tensor computed from the same inputs:
# a rounding tie decided the other way by a different float summation order.
LSB_TOLERANCE = {"nnie": 2, "vitis": 2}
# This host's int8 CPU kernels sum u8 x s8 product pairs in saturating 16-bit registers (x86 without VNNI).
SATURATES = int8_pairs_saturate()
# The backends whose int8 weights a CPU serves (ONNX_QNN's unsigned weights run on u8 x u8 kernels, which do not
# saturate; its QLinear graph is covered by the QDQ deployment's, written here too).
CPU_SERVED = ["qdq", "openvino"]


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


def _prepared(name: str, backend: str, config: dict | None) -> tuple[torch.nn.Module, torch.Tensor]:
    zoo = zoo_model(name)
    qmodel = prepare_by_platform(zoo.model, backend, prepare_custom_config_dict=config)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(zoo.calibration[:16])
    enable_quantization(qmodel)
    return qmodel, zoo.evaluation[:2]


def _check_host_verdicts(report, tolerance: int) -> None:
    """Where this host's runtime parts from the artifact, the report explains it; without saturation it may not."""
    for key, art in report.artifacts.items():
        host = art.host
        if host is None:
            continue
        assert host.per_tensor, key
        # more than the tolerance only where near-tie roundings of the tensors it is computed from explain it (a tie
        # of a per-channel depthwise input carried through the layer) is no divergence: `diverging` leaves it out
        if host.max_lsb_diff <= tolerance or not host.diverging(tolerance):
            continue
        assert SATURATES, (key, "diverges on a host whose int8 kernels do not saturate", host.diverging(tolerance))
        assert host.predicted, (key, "diverges where the saturation model predicts nothing")
        assert host.cause is not None and "16-bit" in host.cause, (key, host.cause)
        assert host.remedy is not None and "reduce_range" in host.remedy, key
        if host.served:  # a served artifact's divergence fails the report
            assert any(line.startswith(f"{key}:") for line in report.failures()), key


# ResNet-50, the zoo's largest model (25M weights, 2 minutes of the grid on all 14 backends), on three formats of
# different kinds: an engine's calibration table, a CPU-served Q/DQ file, a per-tensor DSP grid. Every backend
# deploys ResNet-18, whose blocks it is built from.
LARGE = {"resnet50": {"tensorrt", "openvino", "snpe"}}
MATRIX = [(n, b) for b in BACKENDS for n in sorted(VISION_MODELS) if b in LARGE.get(n, {b})]


@pytest.mark.parametrize(("name", "backend"), MATRIX)
def test_deploy_and_verify(name, backend, tmp_path):
    qmodel, x = _prepared(name, backend, config_for(backend))
    result = convert_deploy(qmodel, backend, {"x": list(x.shape)}, output_path=tmp_path, model_name=name)
    # Every tensor the simulation quantizes has an entry (the count of quantizer calls is independent).
    assert len(result.table) == quantized_calls(qmodel, x)
    moved: dict[str, set[str]] = {}  # per artifact, the tensors whose scale its format gives back one float32 ulp off
    for key in result.artifacts:
        if key in READERS:
            import onnx

            read = READERS[key](
                result.artifacts[key], resolve_backend(backend), onnx.load(result.artifacts["deploy_onnx"])
            )
            expected = set(result.table.activations()) if key == "calib_cache" else set(result.table)
            assert expected <= set(read), (key, sorted(expected - set(read))[:5])
            moved[key] = {t for t in expected if not np.array_equal(read[t].scale, result.table[t].scale)}
            for tensor in moved[key]:  # TensorRT's amax / 127 cannot give every float32 scale back (test_writers)
                bits = [np.asarray(e.scale, np.float32).view(np.int32) for e in (read[tensor], result.table[tensor])]
                ulps = np.abs(bits[0] - bits[1])
                assert key == "clip_ranges" and int(ulps.max()) == 1, (key, tensor)
    # This host's runtimes, where a CPU serves the deployment (elsewhere the host verdict is informational,
    # and the artifact's arithmetic is what the hardware toolchain consumes).
    served = resolve_backend(backend).served_on_cpu or any(key in CPU_ARTIFACTS for key in result.artifacts)
    report = verify_deploy(qmodel, result, x, host=served)
    tolerance = LSB_TOLERANCE.get(backend, 1)
    assert report.tolerance == tolerance
    for key, art in report.artifacts.items():  # the artifacts' arithmetic: the same on every host
        assert art.per_tensor, key
        assert art.max_lsb_diff <= tolerance, (key, art.first_divergence, art.max_lsb_diff)
        if art.runtime.startswith(("onnxruntime", "integer reference")):
            # The Q/DQ arithmetic on onnxruntime: bit-exact but for rounding ties decided differently; a tensor whose
            # scale the file moved by one ulp has the same integers, its values a float32 ulp away.
            exact = {t: d for t, d in art.per_tensor.items() if t not in moved.get(key, ())}
            fraction = sum(d.exact_fraction * d.numel for d in exact.values()) / sum(d.numel for d in exact.values())
            assert fraction >= 0.99, (key, fraction)
            for tensor in moved.get(key, ()):
                diff = art.per_tensor[tensor]
                assert diff.max_lsb_diff == 0 and diff.max_abs_diff <= 2.0**-22 * diff.magnitude, (key, tensor, diff)
    _check_host_verdicts(report, tolerance)


# The remedy is a property of each layer's integers (7-bit weights cannot saturate a pair sum), checked on every
# zoo model but ResNet-50, whose layers are the kinds ResNet-18's and MobileNet's are (its 3x3 and 1x1 convolutions):
# it would add 40 s and no kind of layer.
REMEDY_CASES = [(b, n) for n in sorted(VISION_MODELS) for b in CPU_SERVED if n not in LARGE]


@pytest.mark.parametrize(("backend", "name"), REMEDY_CASES)
def test_reduce_range_serves_like_the_simulation_on_this_host(name, backend, tmp_path):
    """The remedy: 7-bit weights (and right operands of activation products) cannot saturate 16-bit pair sums:
    every host serves every CPU artifact as simulated."""
    qmodel, x = _prepared(name, backend, {**(config_for(backend) or {}), "reduce_range": True})
    shape = {"x": list(x.shape)}
    result = convert_deploy(qmodel, backend, shape, output_path=tmp_path, model_name=name, deploy_to_qlinear=True)
    report = verify_deploy(qmodel, result, x, predict=True)
    served = [key for key, art in report.artifacts.items() if art.host is not None]
    assert "qlinear_onnx" in served and "onnx" in served
    for key in served:
        assert not report.artifacts[key].host.predicted, key  # nothing can saturate
    assert report.passed, report.failures()

"""Every backend on every vision model: prepare, calibrate, quantize, train, save and load."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_configs import config_for
from mqbench.fake_quantize import QuantizeBase
from mqbench.models import bert_tiny
from mqbench.models.zoo import VISION_MODELS, outputs_as_tensor, zoo_labels, zoo_model
from mqbench.prepare_by_platform import BackendType, prepare_by_platform
from mqbench.utils.state import disable_all, enable_calibration, enable_quantization

pytestmark = pytest.mark.slow

BACKENDS = [backend.value for backend in BackendType]


def fidelity_floor(backend: str) -> float:
    """Centered-cosine floor of the quantized outputs.

    0.98 for 8-bit grids with per-channel weights. One weight scale per tensor loses resolution in
    channels with small ranges (depthwise convolutions above all), NNIE's log grid has up to 2.2%
    relative rounding error per element, and Vitis' power-of-two scales are up to 2x coarser than
    min/max ones: those backends lose more on their hardware too, so their floor is 0.95.
    """
    from mqbench.backends import ParamsTable

    weight = ParamsTable[backend].weight
    per_channel = weight is None or weight.scheme.per_channel  # academic: the per-channel config above
    linear = weight is None or (weight.fake_quantize != "NNIEFakeQuantize" and not weight.scheme.pot_scale)
    return 0.98 if per_channel and linear else 0.95


QAT_IMAGES = 16  # the fixed batch QAT fits
WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.ConvTranspose2d)


def centered_cosine(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Cosine of the per-sample deviations from the batch mean (a constant offset cannot pass for fidelity)."""
    reference = reference - reference.mean(0, keepdim=True)
    other = other - other.mean(0, keepdim=True)
    return F.cosine_similarity(reference.flatten(), other.flatten(), dim=0).item()


def calibrated(name: str, backend: str) -> tuple[nn.Module, torch.fx.GraphModule]:
    zoo = zoo_model(name)
    prepared = prepare_by_platform(zoo.model, backend, config_for(backend))
    enable_calibration(prepared)
    with torch.no_grad():
        prepared(zoo.calibration)
    return zoo.model, prepared


# ResNet-50, the zoo's largest model, on the three backends of different kinds the deploy matrix runs it on; every
# backend runs ResNet-18, whose blocks ResNet-50's are made of, and the other models.
LARGE = {"resnet50": {"tensorrt", "openvino", "snpe"}}
CASES = [(n, b) for n in VISION_MODELS for b in BACKENDS if b in LARGE.get(n, {b})]


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_ptq_simulation(name, backend):
    zoo = zoo_model(name)
    model, prepared = calibrated(name, backend)
    weighted = [m for m in prepared.modules() if isinstance(m, WEIGHTED)]
    assert weighted, "no weighted layer found"
    assert all(hasattr(m, "weight_fake_quant") for m in weighted)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in prepared.modules())  # PTQ folds BN
    with torch.no_grad():
        reference = outputs_as_tensor(model(zoo.evaluation))
        calibrating = outputs_as_tensor(prepared(zoo.evaluation))  # still in calibration mode: float
        disable_all(prepared)
        disabled = outputs_as_tensor(prepared(zoo.evaluation))
        enable_quantization(prepared)
        quantized = outputs_as_tensor(prepared(zoo.evaluation))
    scale = reference.abs().max()
    # folding BN into the weights reorders float arithmetic: equal up to float32 rounding
    torch.testing.assert_close(calibrating, reference, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(disabled, reference, rtol=1e-4, atol=1e-5 * scale)
    assert not torch.equal(quantized, reference)
    assert centered_cosine(reference, quantized) > fidelity_floor(backend)


@pytest.mark.parametrize(("name", "backend"), CASES)  # QAT of ResNet-50: 5 s a backend
def test_qat_loss_falls(name, backend):
    """QAT starts from the float model (BatchNorm kept and folded while training) and fits a fixed batch."""
    zoo = zoo_model(name)
    prepared = prepare_by_platform(copy.deepcopy(zoo.model).train(), backend, config_for(backend))
    assert prepared.training
    assert any(hasattr(m, "bn") for m in prepared.modules()) == any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in zoo.model.modules()
    )
    images = zoo.calibration[:QAT_IMAGES]
    enable_calibration(prepared)
    with torch.no_grad():
        prepared(images)
    enable_quantization(prepared)
    with torch.no_grad():
        reference = outputs_as_tensor(zoo.model(images))
    # classifiers fit the digits' labels; the dense models a fixed perturbation of their own output
    labels = zoo_labels(name)
    target = reference.flip(0) if labels is None else labels[:QAT_IMAGES]
    # Quantizer parameters (LSQ steps, zero points, clipping levels) get a 100x smaller learning rate,
    # as QAT recipes do: a 16-bit step (PPLW8A16) is ~1e-6, and the weights' rate would move it by
    # several times its own size in one step.
    quantizer_parameters = {id(p) for m in prepared.modules() if isinstance(m, QuantizeBase) for p in m.parameters()}
    groups = [
        {"params": [p for p in prepared.parameters() if id(p) not in quantizer_parameters]},
        {"params": [p for p in prepared.parameters() if id(p) in quantizer_parameters], "lr": 1e-5},
    ]
    optimizer = torch.optim.SGD(groups, lr=1e-3, momentum=0.9)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        output = outputs_as_tensor(prepared(images))
        loss = F.mse_loss(output, target) if labels is None else F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3", "unet", "vit"])
def test_state_dict_loads_into_fresh_prepared_model(name, backend):
    zoo = zoo_model(name)
    _, prepared = calibrated(name, backend)
    enable_quantization(prepared)
    buffer = io.BytesIO()
    torch.save(prepared.state_dict(), buffer)
    buffer.seek(0)
    fresh = prepare_by_platform(zoo.make().eval(), backend, config_for(backend))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    enable_quantization(fresh)
    with torch.no_grad():
        assert torch.equal(outputs_as_tensor(fresh(zoo.evaluation)), outputs_as_tensor(prepared(zoo.evaluation)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_style_encoder_on_every_backend(backend):
    """Token ids and the attention mask stay integers; the encoder's outputs stay close to float."""
    torch.manual_seed(0)
    model = bert_tiny().eval()
    ids = torch.randint(0, 1000, (16, 24))
    mask = torch.ones(16, 24, dtype=torch.long)
    mask[:, 20:] = 0
    prepared = prepare_by_platform(model, backend, config_for(backend))
    enable_calibration(prepared)
    with torch.no_grad():
        prepared(ids, mask)
    enable_quantization(prepared)
    with torch.no_grad():
        reference, quantized = model(ids, mask), prepared(ids, mask)
    assert all(hasattr(m, "weight_fake_quant") for m in prepared.modules() if isinstance(m, nn.Linear))
    assert centered_cosine(reference, quantized) > 0.98

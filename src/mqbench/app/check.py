"""Deploy-and-verify in one call, shared by ``mqbench verify`` and ``mqbench demo``.

Example:
    >>> from mqbench.app.check import lsb_tolerance
    >>> lsb_tolerance("tensorrt"), lsb_tolerance("nnie")
    (1, 2)
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mqbench.advanced_ptq import restore_smoothing
from mqbench.app.training import academic_config, train
from mqbench.backends import ParamsTable, resolve_backend
from mqbench.convert_deploy import DeployResult, convert_deploy
from mqbench.custom_quantizer.qconfig import resolve_qconfig
from mqbench.data import load_digits_split
from mqbench.deploy.verify import VerifyReport, verify_deploy
from mqbench.deploy.writers import FORMATS
from mqbench.models import DigitsCNN
from mqbench.models.zoo import VISION_MODELS, zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host
from mqbench.utils.state import enable_calibration, enable_quantization

__all__ = [
    "DeployCheck",
    "accuracy",
    "deploy_and_verify",
    "deployed_runner",
    "lsb_tolerance",
    "reduce_range_config",
    "run_verify_command",
]


def lsb_tolerance(backend: Any) -> int:
    """The per-tensor LSB difference a backend's runtimes may show (``BackendSpec.lsb_tolerance``)."""
    return resolve_backend(backend).lsb_tolerance


@dataclass
class DeployCheck:
    backend: str
    result: DeployResult
    report: VerifyReport
    tolerance: int

    @property
    def passed(self) -> bool:
        """Every artifact's arithmetic and every served artifact on this host within tolerance."""
        return self.report.passed


def deploy_and_verify(
    qmodel: nn.Module,
    backend: Any,
    inputs: Tensor,
    output_path: str | Path,
    model_name: str = "mqbench_qmodel",
    reference: bool = False,
) -> DeployCheck:
    """Deploy ``qmodel`` into ``output_path`` with a dynamic batch axis, then verify every artifact on ``inputs``."""
    spec = resolve_backend(backend)
    folder = Path(output_path)
    result = convert_deploy(
        qmodel,
        spec,
        {"x": [1, *inputs.shape[1:]]},
        output_path=folder,
        model_name=model_name,
        dynamic_axes={"x": {0: "batch"}},
    )
    report = verify_deploy(qmodel, result, inputs, reference=reference)
    return DeployCheck(spec.name, result, report, lsb_tolerance(spec))


def deployed_runner(result: DeployResult, output: int = 0) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """The backend's own deployed model as a function of the input, giving its output number ``output``:
    (artifact key, run).

    Of the deployment's models, the one whose format record ranks highest (OpenVINO's model, then
    the QLinear graph, then the Q/DQ model), run as its runtime serves it.
    """
    servers = {key: FORMATS[key] for key in result.artifacts if key in FORMATS}
    servers = {key: record for key, record in servers.items() if record.serve is not None}
    key = max(servers, key=lambda k: servers[k].serve_rank)
    run = servers[key].serve(result)  # type: ignore[misc]  # not None: filtered above
    return key, lambda x: run({result.input_names[0]: x})[output]


def accuracy(run: Callable[[np.ndarray], np.ndarray], images: Tensor, labels: Tensor, batch: int = 256) -> float:
    correct = 0
    for start in range(0, len(images), batch):
        logits = run(images[start : start + batch].numpy())
        correct += int((torch.from_numpy(np.asarray(logits)).argmax(1) == labels[start : start + batch]).sum())
    return correct / len(labels)


def _command_model(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    """(float model, calibration images, verification images) for ``mqbench verify --model``."""

    if name == "digits":
        torch.manual_seed(0)
        train_split, test_split = load_digits_split()
        model = train(DigitsCNN(), train_split, epochs=5, lr=3e-3)
        return model, train_split.images[:256], test_split.images[:32]
    if name not in VISION_MODELS:
        raise ValueError(f"unknown --model {name!r}; choose digits or one of {', '.join(sorted(VISION_MODELS))}")
    zoo = zoo_model(name)
    return zoo.model, zoo.calibration, zoo.evaluation[:8]


def run_verify_command(
    backends: list[str] | None,
    model_name: str,
    state_dict: str | None,
    output_dir: str | None,
    reference: bool,
    tensors: bool,
    log: Callable[[str], None] = print,
    reduce_range: bool = False,
) -> int:
    """``mqbench verify``: returns the exit status (0: every verdict of every artifact within tolerance)."""
    if output_dir is None:
        with tempfile.TemporaryDirectory(prefix="mqbench-verify-") as folder:
            return _verify_command(backends, model_name, state_dict, folder, reference, tensors, log, reduce_range)
    return _verify_command(backends, model_name, state_dict, output_dir, reference, tensors, log, reduce_range)


def reduce_range_config(spec: Any, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` with ``reduce_range`` (7-bit weights) where the weights are on a linear 8-bit grid.

    An explicit 8-bit ``w_qscheme`` width gives way to it (reduce_range sets the width); other
    grids (4-bit, NNIE's log grid) come back unchanged.
    """

    config = dict(config or {})
    extra = dict(config.get("extra_qconfig_dict") or {})
    weight = resolve_qconfig(spec, extra).weight
    low, high = weight.kwargs.get("quant_min"), weight.kwargs.get("quant_max")
    linear = getattr(weight.cls, "deploy_grid", "linear") == "linear"
    if not linear or low is None or high is None or high - low + 1 not in (255, 256):
        return config
    scheme = dict(extra.get("w_qscheme") or {})
    if [scheme.pop(key) for key in ("bit", "bits") if key in scheme]:
        config["extra_qconfig_dict"] = {**extra, "w_qscheme": scheme}
    config["reduce_range"] = True
    return config


def _verify_command(
    backends: list[str] | None,
    model_name: str,
    state_dict: str | None,
    output_dir: str,
    reference: bool,
    tensors: bool,
    log: Callable[[str], None],
    reduce_range: bool,
) -> int:

    names = backends or list(ParamsTable)
    specs = [resolve_backend(name) for name in names]
    if state_dict is not None and len(specs) != 1:
        raise ValueError("--state-dict belongs to one prepared model: give exactly one --backend")
    if state_dict is not None and not Path(state_dict).is_file():
        raise FileNotFoundError(f"--state-dict {state_dict!r} is not a file")
    model, calibration, images = _command_model(model_name)
    log(describe_host())
    failed = 0
    for spec in specs:
        config = academic_config(8) if spec.weight is None else None
        if reduce_range:
            config = reduce_range_config(spec, config)
        qmodel = prepare_by_platform(model, spec, config)
        if state_dict is not None:
            saved = torch.load(state_dict, weights_only=True)
            restore_smoothing(qmodel, saved)  # a smoothed model's scale nodes, if it had any
            qmodel.load_state_dict(saved)
            enable_quantization(qmodel)
        else:
            enable_calibration(qmodel)
            with torch.no_grad():
                qmodel(calibration)
            enable_quantization(qmodel)
        check = deploy_and_verify(qmodel, spec, images, Path(output_dir) / spec.name, model_name, reference)
        status = "ok" if check.passed else f"FAILED (tolerance {check.tolerance} LSB)"
        log(f"== {spec.name}: {status}; artifacts in {Path(check.result.artifacts['onnx']).parent}")
        log(check.report.summary())
        for key, art in check.report.artifacts.items():
            if art.first_divergence:
                log(f"   {key}: first tensor that is not bit-exact: {art.first_divergence}")
            if art.host is not None and art.host.cause and not art.host.served:
                log(f"   {key} (not served on a CPU for {spec.name}; reported only): {art.host.cause}")
            if tensors:
                log("\n".join("   " + diff.row() for diff in art.per_tensor.values()))
        for line in check.report.failures():
            log(f"   FAILED {line}")
        failed += not check.passed
    return 1 if failed else 0

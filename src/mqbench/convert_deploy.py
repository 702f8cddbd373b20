"""Deploy a calibrated or trained model: merge BN, export ONNX with Q/DQ, write the backend's artifacts.

The pipeline (one data flow, the same for every backend):

1. :func:`convert_merge_bn`: BatchNorm folded into the conv / deconv / linear before it, the
   trained weight quantizers kept; every quantizer frozen to its fixed qparams and every
   quantized weight clipped to its integer range.
2. :func:`convert_onnx`: ``torch.onnx.export`` (either path; ``extra_kwargs`` reach it), then the
   strip step: the float ONNX (``deploy_onnx``) and a :class:`~mqbench.qparams.QParamTable`
   of every quantized tensor; the standard Q/DQ model (``onnx``) is built from the two.
3. The backend's writers (``BackendSpec.deploy`` lists their artifact keys) and any step added
   with :func:`register_deploy_function`.

Example:
    >>> import torch, tempfile
    >>> from mqbench.prepare_by_platform import prepare_by_platform, BackendType
    >>> from mqbench.utils.state import enable_calibration, enable_quantization
    >>> from mqbench.convert_deploy import convert_deploy
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU()).eval()
    >>> qmodel = prepare_by_platform(model, BackendType.Tensorrt)
    >>> enable_calibration(qmodel); _ = qmodel(torch.randn(2, 1, 8, 8)); enable_quantization(qmodel)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     result = convert_deploy(qmodel, BackendType.Tensorrt, {"x": [1, 1, 8, 8]}, output_path=folder)
    ...     sorted(result.artifacts)
    ['calib_cache', 'clip_ranges', 'deploy_onnx', 'onnx']
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import numpy_helper
from torch import nn

from mqbench.backends import BackendSpec, ParamsTable, resolve_backend
from mqbench.custom_quantizer.passes import set_submodule
from mqbench.custom_quantizer.plan import plan_of
from mqbench.deploy.context import DeployContext, DeployResult, DeployStep
from mqbench.deploy.cpu_check import cpu_warning
from mqbench.deploy.freeze import freeze_quantizers, merge_bn, merge_bn_in_place
from mqbench.deploy.functions import DeployFunctionRegistry, deploy_functions, register_deploy_function
from mqbench.deploy.inputs import ModelInputs, describe, model_inputs
from mqbench.deploy.onnx_graph import save_model
from mqbench.deploy.op_origin import op_origin, refused_op
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.stepwise import (
    BACKEND_DEPLOY_FUNCTION,
    forget_export,
    remember_export,
    remove_fakequantize_and_collect_params,
)
from mqbench.deploy.strip import export_marked, strip_quantizers
from mqbench.deploy.writers import WRITERS
from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.prepare_by_platform import BACKEND_ATTRIBUTE
from mqbench.qparams import QParamTable
from mqbench.utils.export_capture import DYNAMIC_AXES
from mqbench.utils.host import host_facts
from mqbench.utils.lazy_weights import require_weights
from mqbench.utils.state import integer_quantizers, sync_qparams

__all__ = [
    "BACKEND_DEPLOY_FUNCTION",
    "DeployContext",
    "DeployFunctionRegistry",
    "DeployResult",
    "DeployStep",
    "convert_deploy",
    "convert_merge_bn",
    "convert_onnx",
    "convert_onnx_qlinear",
    "deploy_functions",
    "deploy_qparams_nnie",
    "deploy_qparams_openvino",
    "deploy_qparams_ppl_cuda",
    "deploy_qparams_pplw8a16",
    "deploy_qparams_snpe",
    "deploy_qparams_stpu",
    "deploy_qparams_tengine",
    "deploy_qparams_tensorrt",
    "deploy_qparams_tvm",
    "deploy_qparams_vitis",
    "deployable_copy",
    "register_deploy_function",
]


def convert_merge_bn(model: nn.Module, **kwargs: Any) -> nn.Module:
    """Merge every folded BatchNorm of ``model`` into its conv / deconv / linear, in place, as MQBench does.

    The model is put in eval mode; its fake quantizers stay as they are (it still simulates, and
    can be deployed). Returns ``model``. ``kwargs`` (what ``convert_deploy`` passes to the steps
    registered MQBench's way) are ignored. :func:`deployable_copy` leaves the model unchanged.
    """
    return merge_bn_in_place(model)


def deployable_copy(model: nn.Module) -> nn.Module:
    """A deployable copy of ``model``: eval mode, BN merged, quantizers frozen, weights clipped."""
    return freeze_quantizers(merge_bn(model))


def _example_inputs(
    input_shape_dict: Mapping[str, Sequence[int]] | None, dummy_input: Any, model: nn.Module | None = None
) -> ModelInputs:
    """The call the model is exported for (see :mod:`mqbench.deploy.inputs`): ``dummy_input`` as ``model``'s
    forward takes it, else one random tensor per entry of ``input_shape_dict``."""
    if dummy_input is not None:
        return model_inputs(model, dummy_input, list(input_shape_dict) if input_shape_dict else None)
    if not input_shape_dict:
        raise ValueError('give input_shape_dict (e.g. {"x": [1, 3, 224, 224]}) or dummy_input')
    args_list = []
    for name, shape in input_shape_dict.items():
        try:
            dims = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise ValueError(f"input_shape_dict[{name!r}] must be a list of positive ints, got {shape!r}") from None
        if not dims or any(d <= 0 for d in dims):
            raise ValueError(f"input_shape_dict[{name!r}] must be a list of positive ints, got {shape!r}")
        args_list.append(torch.randn(dims, generator=torch.Generator().manual_seed(0)))
    return model_inputs(model, tuple(args_list), list(input_shape_dict))


# What convert_deploy passes every deploy function registered MQBench's way (besides the model);
# convert_onnx, called as such a function, takes and ignores those it does not use.
STEP_KWARGS = ("output_path", "model_name", "deploy_to_qlinear")


def convert_onnx(
    model: nn.Module,
    input_shape_dict: Mapping[str, Sequence[int]] | None = None,
    dummy_input: Any = None,
    onnx_model_path: str | Path | None = None,
    **extra_kwargs: Any,
) -> tuple[onnx.ModelProto, QParamTable, list[str], list[str]]:
    """Export a merged, frozen model and strip it: (float model, table, input names, output names).

    ``dummy_input`` takes the forms :func:`convert_deploy` takes. With ``onnx_model_path`` (MQBench's
    deploy step), ``model`` may still hold its fake quantizers (after :func:`convert_merge_bn`): they
    are frozen on a copy, and the Q/DQ model is written to ``onnx_model_path``, where
    ``mqbench.deploy.remove_fakequantize_and_collect_params`` reads it.
    """
    for key in STEP_KWARGS:
        extra_kwargs.pop(key, None)
    if onnx_model_path is not None:
        frozen = model
        if any(isinstance(m, QuantizeBase) for m in model.modules()):
            frozen = freeze_quantizers(merge_bn(model))
        float_model, table, input_names, output_names = convert_onnx(
            frozen, input_shape_dict, dummy_input, **extra_kwargs
        )
        qdq_model, _ = insert_qdq(float_model, table)
        save_model(qdq_model, onnx_model_path)
        remember_export(onnx_model_path, float_model, qdq_model, table, input_names, output_names)
        return float_model, table, input_names, output_names
    return _convert_onnx(model, _example_inputs(input_shape_dict, dummy_input, model), extra_kwargs)


def _convert_onnx(
    model: nn.Module, inputs: ModelInputs, extra_kwargs: dict[str, Any]
) -> tuple[onnx.ModelProto, QParamTable, list[str], list[str]]:
    names = inputs.names
    extra_kwargs = dict(extra_kwargs)
    user_names = extra_kwargs.pop("input_names", None)
    if user_names is not None:
        if len(user_names) != len(inputs.tensors):
            raise ValueError(
                f"input_names has {len(user_names)} names for {len(inputs.tensors)} inputs (the tensors of "
                f"dummy_input, in order: {names})"
            )
        names = list(user_names)
    captured = getattr(model, DYNAMIC_AXES, None)
    if captured and "dynamic_axes" not in extra_kwargs:
        # the dimensions torch.export kept dynamic (batch, sequence), by position: the forward's tensor inputs
        kept = list(captured.values())
        axes = {name: kept[i] for i, name in enumerate(names) if i < len(kept) and kept[i]}
        extra_kwargs = {**extra_kwargs, "dynamic_axes": axes}
    structure = inputs.structure if inputs.structured else None
    shown = describe(inputs.args)
    try:
        exported = export_marked(model, tuple(inputs.tensors), names, structure=structure, **extra_kwargs)
    except torch.onnx.errors.OnnxExporterError as error:  # an op of the model ONNX export cannot write
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        message = message.split(" Please feel free")[0]
        owner = _refused_op_owner(model, inputs, message)
        raise NotImplementedError(
            f"the model cannot be written as ONNX for {shown}: {message.rstrip('. ')}. {owner}"
        ) from None
    except RuntimeError as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RuntimeError(f"ONNX export failed for {shown}: {message}") from error
    float_model, table = strip_quantizers(exported)
    return float_model, table, exported.input_names, exported.output_names


def _refused_op_owner(model: nn.Module, inputs: ModelInputs, message: str) -> str:
    """Who calls the op the exporter refused (the model's own code, or a library's it calls) and what to do."""
    op = refused_op(message)
    origin = op_origin(model, inputs.args, op) if op is not None else None
    if origin is None:
        return (
            "Change that op of the model (or the input shape it is deployed for), or give the ONNX exporter a way to "
            "write it (torch.onnx.register_custom_op_symbolic)"
        )
    return origin.explain()


def _signature(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return ""


def _create_folder(folder: Path) -> list[Path]:
    """Create ``folder`` (and missing parents) and check it is writable; the folders created, deepest first."""
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        _remove_created(created)
        raise ValueError(f"output_path {str(folder)!r} cannot be created: {error.strerror}") from None
    if not folder.is_dir():
        raise ValueError(f"output_path {str(folder)!r} exists and is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        _remove_created(created)
        raise ValueError(f"output_path {str(folder)!r} is not writable: {error.strerror}") from None
    return created


def _remove_created(created: Sequence[Path]) -> None:
    """Remove the folders convert_deploy created (deepest first), each only while it is empty."""
    for path in created:
        try:
            path.rmdir()
        except OSError:
            return  # not empty (someone else's file) or already gone: leave it and its parents


def _check_deployable(model: nn.Module, spec: BackendSpec, allow_backend_mismatch: bool) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"convert_deploy takes the prepared nn.Module, got {type(model).__name__}")
    plan = plan_of(model)
    found = [module for module in model.modules() if isinstance(module, QuantizeBase)]
    if not found and plan is not None:
        floats = [f"{d.node} ({d.op}: {d.reason})" for d in plan.decisions.values() if not d.quantized]
        shown = "; ".join(floats[:6]) + (f"; and {len(floats) - 6} more" if len(floats) > 6 else "")
        raise ValueError(
            f"the prepared model quantizes nothing: backend {plan.backend!r} quantizes none of its ops "
            f"({shown or 'it has no ops'}), so there is nothing to deploy. Export the float model as it is "
            "(torch.onnx.export), or add the ops to quantize with prepare_custom_config_dict['extra_quantizer_dict'] "
            "(additional_function_type, additional_module_type, additional_node_name)"
        )
    if not found:
        raise ValueError(
            f"the model ({type(model).__name__}) has no fake quantizers: convert_deploy takes the model returned by "
            "prepare_by_platform (calibrated or trained), not the float model; prepare it with "
            f"prepare_by_platform(model, {spec.name!r}) and calibrate it first"
        )
    if not any(module._switch("fake_quant") for module in found):
        raise ValueError(
            "no quantizer of the model has fake quantization on, so the deployment would be the float model: "
            "after calibrating, call mqbench.utils.state.enable_quantization(model) (it also stops the observers), "
            "then deploy"
        )
    prepared_for = plan.backend if plan is not None and plan.backend else getattr(model, BACKEND_ATTRIBUTE, None)
    if isinstance(prepared_for, str) and prepared_for != spec.name and not allow_backend_mismatch:
        raise ValueError(
            f"the model was prepared for backend {prepared_for!r} but is deployed for {spec.name!r}: its quantizers "
            f"follow the schemes and placement of {prepared_for!r}, which {spec.name!r} may not run as simulated. "
            f"Deploy it for {prepared_for!r}, or prepare the float model for {spec.name!r}; pass "
            "allow_backend_mismatch=True to deploy it anyway"
        )


def _backend_of(model: nn.Module, backend: Any) -> BackendSpec:
    """The spec to deploy for: ``backend`` itself (a BackendSpec), the spec the model was prepared with where
    ``backend`` names it (prepare resolved it once and the plan carries it, registered or not), else the
    registered backend of that name."""
    plan = plan_of(model)
    name = backend.value if isinstance(backend, Enum) else backend
    if not isinstance(backend, BackendSpec) and plan is not None and plan.spec is not None and plan.spec.name == name:
        return plan.spec
    return resolve_backend(backend)


def convert_deploy(
    model: nn.Module,
    backend_type: Any,
    input_shape_dict: Mapping[str, Sequence[int]] | None = None,
    dummy_input: Any = None,
    output_path: str | Path = "./",
    model_name: str = "mqbench_qmodel",
    deploy_to_qlinear: bool = False,
    allow_backend_mismatch: bool = False,
    qlinear_weight_type: str | None = None,
    **extra_kwargs: Any,
) -> DeployResult:
    """Deploy ``model`` (prepared, calibrated or trained) for ``backend_type``; see the module docstring.

    ``dummy_input`` is how the model is called (:mod:`mqbench.deploy.inputs` gives the rules); each
    of its tensors, in order, is one ONNX input:

    * a tensor, or a tuple of tensors (the positional arguments; inputs ``input_0``, ...);
    * ``torch.onnx.export``'s ``(*args, kwargs)``: positional arguments that may be dicts, tuples
      or lists of tensors, then a dict of keyword inputs, possibly empty: ``({"image": t}, {})``
      for ``forward(self, batch)``, ``(dict(encoded_input),)`` for ``forward(self, input_ids,
      attention_mask)``; a last dict whose keys name no parameter is the forward's one required
      argument (``({"image": t},)``);
    * a dict: the keyword inputs where its keys are the forward's parameters; the value of the one
      required argument where they are not (a detector's ``batch``); for a forward that reads its
      argument as a tensor, input name -> tensor (``{"pixels": x}``).

    A dict's tensors name their ONNX inputs after its keys (``image``; nested dicts after the
    innermost key), keyword inputs after their parameters (``result.input_names``).
    ``verify_deploy`` takes its inputs in the same forms, or as a dict of those input names.

    Artifacts are written to a scratch folder inside ``output_path`` and moved into place only
    when every step succeeded, so a failure leaves no partial set behind (and removes
    ``output_path`` again if this call created it). ``extra_kwargs`` go to ``torch.onnx.export``
    (``input_names``, ``output_names``, ``dynamic_axes``, ``opset_version``, ``dynamo``; the
    TorchScript path is the default).

    ``qlinear_weight_type="uint8"`` holds the QLinear graph's signed weights as uint8 (shifted by
    128, the same values): onnxruntime then runs u8 x u8 kernels, which do not saturate on CPUs
    without VNNI (slower). On such a CPU, writing an artifact a CPU runtime serves with weight
    pairs that can saturate warns, naming the remedy (:mod:`mqbench.deploy.cpu_check`).

    Raises ValueError for a model without fake quantizers (the float model), and for a model
    prepared for another backend (its ``mqbench_backend`` attribute, set by
    ``prepare_by_platform``) unless ``allow_backend_mismatch=True``.
    """
    require_weights(model, "convert_deploy (it writes every weight)")
    if qlinear_weight_type not in (None, "int8", "uint8"):
        raise ValueError(f"qlinear_weight_type must be 'int8', 'uint8' or None, got {qlinear_weight_type!r}")
    spec = _backend_of(model, backend_type)
    _check_deployable(model, spec, allow_backend_mismatch)
    if not model_name or any(c in model_name for c in "/\\\0"):
        raise ValueError(f"model_name must be a plain file name, got {model_name!r}")
    folder = Path(output_path)
    created = _create_folder(folder)
    try:
        return _deploy(
            model,
            spec,
            folder,
            input_shape_dict,
            dummy_input,
            model_name,
            deploy_to_qlinear,
            qlinear_weight_type,
            extra_kwargs,
        )
    except BaseException:
        _remove_created(created)
        raise


def _deploy(
    model: nn.Module,
    spec: BackendSpec,
    folder: Path,
    input_shape_dict: Mapping[str, Sequence[int]] | None,
    dummy_input: Any,
    model_name: str,
    deploy_to_qlinear: bool,
    qlinear_weight_type: str | None,
    extra_kwargs: dict[str, Any],
) -> DeployResult:
    keys = list(spec.deploy) + (["qlinear_onnx"] if deploy_to_qlinear and "qlinear_onnx" not in spec.deploy else [])
    extra_steps = deploy_functions[spec.name]
    missing = [key for key in keys if key not in extra_steps and key not in WRITERS]
    if missing:  # before the export: say so at once
        raise ValueError(
            f"backend {spec.name!r} lists the artifact(s) {missing}, which no built-in format writes "
            f"(built-in: {sorted(WRITERS)}) and no deploy step was registered for; register one with "
            f"@register_deploy_function({spec.name!r}, {missing[0]!r})"
        )
    sync_qparams(model)  # a model left calibrating holds its histogram observers' qparams only when asked
    merged = merge_bn(model)
    example = _example_inputs(input_shape_dict, dummy_input, merged)
    try:
        integer = integer_quantizers(merged, example.args)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, (KeyError, AttributeError)):
            message = f"{type(error).__name__}: {message}"
        hint = ""
        if example.structured or isinstance(error, (KeyError, AttributeError)):
            hint = (
                f"; give dummy_input as the model's forward{_signature(merged)} takes it (see convert_deploy's "
                "docstring for the forms)"
            )
        raise RuntimeError(f"the model does not run on {describe(example.args)}: {message}{hint}") from error
    for name in integer:  # they pass integers through: no quantizer there
        set_submodule(merged, name, nn.Identity())
    deployed = freeze_quantizers(merged)
    float_model, table, input_names, output_names = _convert_onnx(deployed, example, extra_kwargs)
    _refuse_groups_in(keys, table, spec)
    qdq_model, dequantized = insert_qdq(float_model, table)
    scratch = Path(tempfile.mkdtemp(prefix=".mqbench-deploy-", dir=folder))
    try:
        context = DeployContext(
            spec,
            model_name,
            scratch,
            float_model,
            qdq_model,
            table,
            input_names,
            output_names,
            qlinear_weight_type,
            module=deployed,
        )
        written = {
            "onnx": save_model(qdq_model, context.path(".onnx")),
            "deploy_onnx": save_model(float_model, context.path("_deploy_model.onnx")),
        }
        for key in keys:
            path = (extra_steps.get(key) or WRITERS[key])(context)
            if path is not None:  # None: the model has no such form (a Hugging Face checkpoint of another model)
                written[key] = str(path)
        for key, step in extra_steps.items():
            if key not in written or key in ("onnx", "deploy_onnx"):
                path = step(context)
                if path is not None:
                    written[key] = str(path)
        _refuse_shared_files(spec, written)
        steps = [f for f in BACKEND_DEPLOY_FUNCTION.get(spec.name, []) if f not in _pipeline_steps(spec)]
        if steps:
            kwargs = {
                "input_shape_dict": input_shape_dict,
                "dummy_input": dummy_input,
                "output_path": str(scratch),
                "model_name": model_name,
                "deploy_to_qlinear": deploy_to_qlinear,
                **extra_kwargs,
            }
            written.update(_run_mqbench_steps(steps, merge_bn(model), context, written, kwargs))
        artifacts = {}
        for key, path in written.items():
            source = Path(path)
            if not source.is_file() and not (source.is_dir() and scratch in source.parents):
                raise RuntimeError(f"deploy step {key!r} returned {path!r}, which is not a file it wrote")
            target = folder / source.relative_to(scratch)
            artifacts[key] = str(target)
        for key, path in written.items():
            target = Path(artifacts[key])
            target.parent.mkdir(parents=True, exist_ok=True)
            if Path(path).is_dir() and target.is_dir():  # a folder artifact replaces an earlier deployment's whole
                shutil.rmtree(target)
            shutil.move(path, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _warn_if_this_cpu_differs(spec, artifacts, table, float_model, qlinear_weight_type)
    return DeployResult(
        spec.name,
        model_name,
        artifacts,
        table,
        input_names,
        output_names,
        dequantized,
        spec=spec,
        input_structure=example.structure,
    )


# The artifact formats that hold group-wise weights besides the Q/DQ model (blocked DequantizeLinear).
GROUP_FORMATS = frozenset({"matmulnbits_onnx", "compressed_tensors", "gguf", "genai"})


def _refuse_groups_in(keys: list[str], table: QParamTable, spec: BackendSpec) -> None:
    grouped = [tensor for tensor, entry in table.items() if entry.group_size is not None]
    unable = [key for key in keys if key not in GROUP_FORMATS]
    if grouped and unable:
        raise ValueError(
            f"{len(grouped)} weight(s) are quantized in groups ({', '.join(grouped[:4])}), which backend "
            f"{spec.name!r}'s format(s) {unable} cannot hold (one scale per tensor or per channel); deploy group-wise "
            "weights with a weight-only backend ('llm_w4a16', 'llm_w8a16'), or drop group_size from the w_qscheme"
        )


def _files(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def _run_mqbench_steps(
    steps: Sequence[Any], model: nn.Module, context: DeployContext, written: Mapping[str, str], kwargs: dict[str, Any]
) -> dict[str, str]:
    """Call deploy functions registered MQBench's way; the files they write or rewrite, by artifact key."""
    onnx_path = context.path(".onnx")
    remember_export(
        onnx_path,
        context.float_model,
        context.qdq_model,
        context.table,
        context.input_names,
        context.output_names,
    )
    before = _files(context.folder)
    try:
        for step in steps:
            step(model, onnx_model_path=str(onnx_path), **kwargs)
    finally:
        forget_export(onnx_path)
    known = {Path(path): key for key, path in written.items()}
    added: dict[str, str] = {}
    for path, stamp in sorted(_files(context.folder).items()):
        if path in known or before.get(path) == stamp:
            continue
        name = path.relative_to(context.folder).as_posix()
        stem = name[len(context.model_name) :] if name.startswith(context.model_name) else name
        key = stem.lstrip("_").split(".")[0] or name
        while key in written or key in added:
            key = f"{key}_"
        added[key] = str(path)
    return added


def _pipeline_steps(spec: BackendSpec) -> set[Any]:
    """The functions MQBench registers for every backend that this pipeline carries out itself."""
    own = _DEPLOY_QPARAMS.get(spec.name)
    return {convert_merge_bn, convert_onnx, convert_onnx_qlinear, *(() if own is None else (own,))}


def _deploy_qparams(backend: str, name: str) -> Any:
    def deploy_qparams(model: nn.Module, onnx_model_path: str, model_name: str, **kwargs: Any) -> list[str]:
        return remove_fakequantize_and_collect_params(onnx_model_path, model_name, backend)

    deploy_qparams.__name__ = deploy_qparams.__qualname__ = name
    deploy_qparams.__doc__ = (
        f"MQBench's deploy step for {backend!r}: its parameter files beside ``onnx_model_path`` "
        "(see :func:`mqbench.deploy.stepwise.remove_fakequantize_and_collect_params`)."
    )
    return deploy_qparams


def convert_onnx_qlinear(model: nn.Module, onnx_model_path: str, model_name: str, **kwargs: Any) -> str | None:
    """MQBench's step: with ``deploy_to_qlinear=True``, the QLinear ONNX model beside ``onnx_model_path``."""
    if not kwargs.get("deploy_to_qlinear"):
        return None
    written = remove_fakequantize_and_collect_params(onnx_model_path, model_name, "onnx_qnn")
    return next(path for path in written if path.endswith(".onnx") and "_deploy_model" not in path)


deploy_qparams_tensorrt = _deploy_qparams("tensorrt", "deploy_qparams_tensorrt")
deploy_qparams_snpe = _deploy_qparams("snpe", "deploy_qparams_snpe")
deploy_qparams_pplw8a16 = _deploy_qparams("pplw8a16", "deploy_qparams_pplw8a16")
deploy_qparams_ppl_cuda = _deploy_qparams("pplcuda", "deploy_qparams_ppl_cuda")
deploy_qparams_vitis = _deploy_qparams("vitis", "deploy_qparams_vitis")
deploy_qparams_nnie = _deploy_qparams("nnie", "deploy_qparams_nnie")
deploy_qparams_openvino = _deploy_qparams("openvino", "deploy_qparams_openvino")
deploy_qparams_tengine = _deploy_qparams("tengine_u8", "deploy_qparams_tengine")
deploy_qparams_tvm = _deploy_qparams("onnx_qnn", "deploy_qparams_tvm")
deploy_qparams_stpu = _deploy_qparams("stpu", "deploy_qparams_stpu")
_DEPLOY_QPARAMS = {
    "tensorrt": deploy_qparams_tensorrt,
    "snpe": deploy_qparams_snpe,
    "pplw8a16": deploy_qparams_pplw8a16,
    "pplcuda": deploy_qparams_ppl_cuda,
    "vitis": deploy_qparams_vitis,
    "nnie": deploy_qparams_nnie,
    "openvino": deploy_qparams_openvino,
    "tengine_u8": deploy_qparams_tengine,
    "onnx_qnn": deploy_qparams_tvm,
    "stpu": deploy_qparams_stpu,
}
for _backend in ParamsTable:  # MQBench's registrations: merge BN, export, the backend's parameter files
    BACKEND_DEPLOY_FUNCTION[_backend] = [
        convert_merge_bn,
        convert_onnx,
        *((convert_onnx_qlinear,) if _backend == "tensorrt" else ()),
        *((_DEPLOY_QPARAMS[_backend],) if _backend in _DEPLOY_QPARAMS else ()),
    ]


def _refuse_shared_files(spec: BackendSpec, written: Mapping[str, str]) -> None:
    """ValueError when two artifacts went to one file (several formats share a name, e.g. ``_clip_ranges.json``)."""
    keys: dict[Path, str] = {}
    for key, path in written.items():
        resolved = Path(path).resolve()
        if resolved in keys:
            raise ValueError(
                f"backend {spec.name!r}: the artifacts {keys[resolved]!r} and {key!r} are both written to "
                f"{resolved.name}, so one would overwrite the other; list only one of them in the backend's "
                "deploy keys, or register a deploy step for one of them that writes a file of another name"
            )
        keys[resolved] = key


def _warn_if_this_cpu_differs(
    spec: BackendSpec,
    artifacts: Mapping[str, str],
    table: QParamTable,
    float_model: onnx.ModelProto,
    qlinear_weight_type: str | None,
) -> None:
    keys = [key for key in artifacts if not (key == "qlinear_onnx" and qlinear_weight_type == "uint8")]
    weights = {i.name: numpy_helper.to_array(i) for i in float_model.graph.initializer if i.name in table}
    message = cpu_warning(keys, spec.served_on_cpu, table, weights, host_facts())
    if message:
        warnings.warn(message, stacklevel=3)

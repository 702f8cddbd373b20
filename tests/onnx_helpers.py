"""Test helpers: exporting to ONNX and running the result in onnxruntime."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch

# The newest IR version this onnxruntime loads; onnx may stamp a newer one on models it writes.
ORT_MAX_IR_VERSION = 10


def ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def export_onnx(module: torch.nn.Module, example: torch.Tensor, dynamo: bool, tmp_path) -> onnx.ModelProto:
    """Export with a dynamic batch axis through either torch.onnx.export path."""
    path = tmp_path / ("dynamo.onnx" if dynamo else "torchscript.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=1024)
            torch.onnx.export(
                module, (example,), str(path), dynamo=True, dynamic_shapes=({0: batch},), input_names=["x"]
            )
        else:
            torch.onnx.export(
                module,
                (example,),
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=["x"],
                output_names=["y"],
                dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            )
    return onnx.load(str(path))


def run_onnx(model: onnx.ModelProto, x: torch.Tensor) -> np.ndarray:
    session = ort_session(model)
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def reload(module_state: dict) -> dict:
    """A state dict round-tripped through torch.save / torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(module_state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)

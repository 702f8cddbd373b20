"""Test helpers: exporting to ONNX and running the result in onnxruntime."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

# The newest IR version this onnxruntime loads; onnx may stamp a newer one on models it writes.
ORT_MAX_IR_VERSION = 10


def ort_session(model: onnx.ModelProto, optimize: bool = False) -> ort.InferenceSession:
    """A session computing the model as written (graph optimizations off: no fusion into int8 kernels, whose
    results depend on the CPU); ``optimize=True`` for onnxruntime as it serves the model."""
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
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


def model_of(nodes: list, inputs: dict, outputs: list[str], inits: dict, opset: int = 17) -> onnx.ModelProto:
    """A hand-built float model: graph inputs shaped like the arrays of ``inputs``, float initializers."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_exposing(
    model: onnx.ModelProto, feeds: dict, names: list[str], optimize: bool = False
) -> dict[str, np.ndarray]:
    """Run ``model`` on onnxruntime and return the tensors ``names`` (intermediate ones become outputs)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    declared = {v.name for v in model.graph.output}
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in declared)
    return dict(zip(names, ort_session(model, optimize).run(names, feeds), strict=True))

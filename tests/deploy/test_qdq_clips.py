"""TensorRT's Q/DQ file on onnxruntime. The Clip in front of a QuantizeLinear whose range is narrower than its integer
type ([-127, 127] in int8) is written only where a value can pass the range's end, since it sits between a layer and
its QuantizeLinear, where onnxruntime would otherwise run the two as one int8 kernel; TensorRT's own grid, int8's
[-128, 127], needs none, and its attention products are int8 too."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization


def _deployed(model: nn.Module, calibration: torch.Tensor, tmp_path, config: dict | None = None):
    """``model`` prepared for TensorRT, calibrated on one batch and deployed: (the simulation, the DeployResult)."""
    qmodel = prepare_by_platform(model, "tensorrt", config)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(calibration)
    enable_quantization(qmodel)
    shape = [1, *calibration.shape[1:]]
    return qmodel, convert_deploy(qmodel, "tensorrt", {"x": shape}, output_path=tmp_path)


def _file_computes_the_simulation(qmodel: nn.Module, path: str, x: torch.Tensor) -> None:
    """The file's own arithmetic (onnxruntime with its graph optimizations off: no fused int8 kernels, whose pair
    sums saturate on CPUs without VNNI) gives the simulation's output to float32 rounding."""
    with torch.no_grad():
        simulated = qmodel(x).numpy()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(served, simulated, rtol=0, atol=1e-5 * float(np.abs(simulated).max()))


def _optimized_ops(path: str, tmp_path) -> list[str]:
    """The op types of the graph onnxruntime optimizes the file into (on x86 it retypes int8 Q/DQ activations to
    uint8 and then fuses, whatever the CPU: a build-time choice, so the graph is the same with or without VNNI)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


def test_a_clip_only_where_values_can_pass_the_narrow_range(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    narrow = {"extra_qconfig_dict": {"a_qscheme": {"symmetric_range": True}}}  # implicit int8's [-127, 127]
    qmodel, result = _deployed(model, torch.randn(8, 3, 6, 6), tmp_path, narrow)
    entries = {t: e for t, e in result.table.items() if e.kind == "activation"}
    assert len(entries) == 2 and all((e.quant_min, e.quant_max) == (-127, 127) for e in entries.values())
    graph = onnx.load(result.artifacts["onnx"]).graph
    producers = {output: node for node in graph.node for output in node.output}
    feeding = {
        node.name: producers[node.input[0]].op_type
        for node in graph.node
        if node.op_type == "QuantizeLinear" and node.input[0] in producers
    }
    # the network input can be anything: clipped; the ReLU's output never goes below zero: quantized directly
    assert sorted(feeding.values()) == ["Clip", "Relu"], feeding

    # exact where it matters: an input far below the grid's low end lands on -127 steps, not on int8's -128
    x = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    scale = float(np.asarray(entries["x"].scale).reshape(-1)[0])
    x[0, 0, :2] = -130.0 * scale
    _file_computes_the_simulation(qmodel, result.artifacts["onnx"], x)
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()


def test_tensorrts_int8_grid_needs_no_clip_and_onnxruntime_fuses_the_layer(tmp_path):
    """TensorRT's explicit grid is int8's own [-128, 127]: nothing stands between a layer and its QuantizeLinear, the
    file computes the simulation's integers down to -128, and onnxruntime runs the convolution as one int8 kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).eval()
    qmodel, result = _deployed(model, torch.randn(8, 3, 6, 6), tmp_path)
    entries = {t: e for t, e in result.table.items() if e.kind == "activation"}
    assert len(entries) == 2 and all((e.quant_min, e.quant_max) == (-128, 127) for e in entries.values())
    graph = onnx.load(result.artifacts["onnx"]).graph
    assert not [node.name for node in graph.node if node.op_type in ("Clip", "Max", "Min")]

    x = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    scale = float(np.asarray(entries["x"].scale).reshape(-1)[0])
    x[0, 0, :2] = -130.0 * scale  # saturates at -128 steps in both
    _file_computes_the_simulation(qmodel, result.artifacts["onnx"], x)
    optimized = _optimized_ops(result.artifacts["onnx"], tmp_path)
    assert optimized.count("QLinearConv") == 1, optimized  # the first layer; the second's output is the network's


class _Attention(nn.Module):
    """One head of self-attention over 16 tokens, products by torch.matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) * 32**-0.5
        return self.out(torch.matmul(scores.softmax(-1), self.v(x)))


def test_tensorrt_quantizes_attentions_products_and_onnxruntime_runs_them_in_int8(tmp_path):
    """Both inputs of both products are int8 in TensorRT's file, as TensorRT runs them; onnxruntime then runs the
    projections and the products on int8 kernels, and the file computes the simulation."""
    torch.manual_seed(0)
    qmodel, result = _deployed(_Attention().eval(), torch.randn(4, 16, 32), tmp_path)
    graph = onnx.load(result.artifacts["onnx"]).graph
    producers = {output: node for node in graph.node for output in node.output}
    weights = {init.name for init in graph.initializer}

    def source(name: str) -> onnx.NodeProto | None:  # through the heads' data movement
        node = producers.get(name)
        while node is not None and node.op_type in ("Transpose", "Reshape"):
            node = producers.get(node.input[0])
        return node

    def weight(name: str) -> bool:  # a layer's weight: an initializer through its Q/DQ pair
        node = source(name)
        if node is None or node.op_type != "DequantizeLinear":
            return False
        quantize = producers.get(node.input[0])
        return node.input[0] in weights or (quantize is not None and quantize.input[0] in weights)

    products = [node for node in graph.node if node.op_type == "MatMul" and not any(weight(i) for i in node.input)]
    assert len(products) == 2, [n.name for n in products]
    assert all(source(i).op_type == "DequantizeLinear" for node in products for i in node.input)

    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1))
    _file_computes_the_simulation(qmodel, result.artifacts["onnx"], x)
    optimized = _optimized_ops(result.artifacts["onnx"], tmp_path)
    # q, k and v as QGemm, the products as QLinearMatMul / MatMulIntegerToFloat (out's output is the network's)
    integer = {"QGemm", "QLinearMatMul", "MatMulIntegerToFloat"}
    assert sum(op in integer for op in optimized) == 5, optimized

"""The Clip in front of a QuantizeLinear whose range is narrower than its integer type ([-127, 127] in int8):
written only where a value can pass the range's end, since it sits between a layer and its QuantizeLinear, where
onnxruntime would otherwise run the two as one int8 kernel."""

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


def test_a_clip_only_where_values_can_pass_the_narrow_range(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    narrow = {"extra_qconfig_dict": {"a_qscheme": {"symmetric_range": True}}}  # implicit int8's [-127, 127]
    qmodel = prepare_by_platform(model, "tensorrt", narrow)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.randn(8, 3, 6, 6))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "tensorrt", {"x": [1, 3, 6, 6]}, output_path=tmp_path)
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
    with torch.no_grad():
        simulated = qmodel(x).numpy()
    # the file's own arithmetic (no fused int8 kernels, whose pair sums saturate on CPUs without VNNI)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(result.artifacts["onnx"], options, providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(served, simulated, rtol=0, atol=1e-5 * float(np.abs(simulated).max()))
    report = verify_deploy(qmodel, result, x)
    assert report.passed, report.failures()


def test_tensorrts_int8_grid_needs_no_clip_and_onnxruntime_fuses_the_layer(tmp_path):
    """TensorRT's explicit grid is int8's own [-128, 127]: nothing stands between a layer and its QuantizeLinear, the
    file computes the simulation's integers down to -128, and onnxruntime runs the convolution as one int8 kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).eval()
    qmodel = prepare_by_platform(model, "tensorrt")
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(torch.randn(8, 3, 6, 6))
    enable_quantization(qmodel)
    result = convert_deploy(qmodel, "tensorrt", {"x": [1, 3, 6, 6]}, output_path=tmp_path)
    entries = {t: e for t, e in result.table.items() if e.kind == "activation"}
    assert len(entries) == 2 and all((e.quant_min, e.quant_max) == (-128, 127) for e in entries.values())
    graph = onnx.load(result.artifacts["onnx"]).graph
    assert not [node.name for node in graph.node if node.op_type in ("Clip", "Max", "Min")]

    x = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    scale = float(np.asarray(entries["x"].scale).reshape(-1)[0])
    x[0, 0, :2] = -130.0 * scale  # saturates at -128 steps in both
    with torch.no_grad():
        simulated = qmodel(x).numpy()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(result.artifacts["onnx"], options, providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(served, simulated, rtol=0, atol=1e-5 * float(np.abs(simulated).max()))

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(result.artifacts["onnx"], options, providers=["CPUExecutionProvider"])
    optimized = [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]
    assert optimized.count("QLinearConv") == 1, optimized  # the first layer; the second's output is the network's

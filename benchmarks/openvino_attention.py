"""What a ``Max`` after attention outputs costs where OpenVINO serves the ``openvino_onnx`` file.

OpenVINO 2026.4's ``compile_model`` ends the process on one quantized attention pattern (a segmentation fault;
tests/deploy/test_openvino_attention.py); the writer reads such an attention output through ``Max(x, x)``, which
avoids it, and only there. This measures why only there, on a file that compiles either way: a ViT (``vit_tiny``
at width 256, 4 blocks, 4 heads, 64 px images: 256 tokens) prepared for ``openvino``, calibrated on 8 random
images and deployed as written ("written": the pattern is not in a ViT block, so no ``Max``), without the rewrite
("without"), and with a ``Max`` after every attention output ("every attention"); each file compiled by OpenVINO's
CPU plugin (2 threads, f32 inference precision as verification runs it) and run on one image, interleaved; the
median of per-repeat ratios to "without".

Run: .venv/bin/python benchmarks/openvino_attention.py [--repeats 200]; prints the table and writes
benchmarks/results/openvino_attention.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from pathlib import Path

import onnx
import torch

from _timing import interleaved_samples, print_table, write_json


def _max_after_every_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every MatMul that reads a Softmax (through its FakeQuantize or not) read, past its output's
    FakeQuantize, through ``Max(x, x)``."""
    from onnx import helper

    from mqbench.deploy.onnx_graph import consumers_of, topological_sort

    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    readers = consumers_of(graph)
    for node in list(graph.node):
        source = producers.get(node.input[0]) if node.op_type == "MatMul" else None
        if source is not None and source.op_type == "FakeQuantize":
            source = producers.get(source.input[0])
        if source is None or source.op_type != "Softmax":
            continue
        tensor = node.output[0]
        after = readers.get(tensor, [])
        if len(after) == 1 and after[0].op_type == "FakeQuantize":
            tensor = after[0].output[0]
        for reader in readers.get(tensor, []):
            reader.input[:] = [f"{tensor}_kept" if name == tensor else name for name in reader.input]
        graph.node.append(helper.make_node("Max", [tensor, tensor], [f"{tensor}_kept"]))
    topological_sort(graph)
    return model


def main() -> None:
    import openvino as ov

    from mqbench.convert_deploy import convert_deploy
    from mqbench.deploy.writers import openvino_layout as writer
    from mqbench.models.transformers import vit_tiny
    from mqbench.prepare_by_platform import prepare_by_platform
    from mqbench.utils.host import describe_host
    from mqbench.utils.state import enable_calibration, enable_quantization

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(describe_host())
    torch.manual_seed(0)
    model = vit_tiny(image_size=64, patch_size=4, dim=256, depth=4, heads=4).eval()
    qmodel = prepare_by_platform(model, "openvino")
    enable_calibration(qmodel)
    with torch.no_grad():
        for _ in range(8):
            qmodel(torch.randn(1, 3, 64, 64))
    enable_quantization(qmodel)
    image = {"x": torch.randn(1, 3, 64, 64).numpy()}
    kept = writer._attention_outputs_kept
    core = ov.Core()
    compiled, maxes = {}, {}
    config = {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "f32"}
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, rewrite in (("written", kept), ("without", lambda graph: None)):
            writer._attention_outputs_kept = rewrite
            try:
                result = convert_deploy(
                    qmodel, "openvino", {"x": [1, 3, 64, 64]}, output_path=str(Path(folder) / label)
                )
            finally:
                writer._attention_outputs_kept = kept
            path = result.artifacts["openvino_onnx"]
            if label == "without":
                every = _max_after_every_attention(onnx.load(path))
                onnx.save(every, str(Path(folder) / "every.onnx"))
                maxes["every attention"] = sum(node.op_type == "Max" for node in every.graph.node)
                compiled["every attention"] = core.compile_model(str(Path(folder) / "every.onnx"), "CPU", config)
            maxes[label] = sum(node.op_type == "Max" for node in onnx.load(path).graph.node)
            compiled[label] = core.compile_model(path, "CPU", config)
        feeds = {compiled["written"].inputs[0].get_any_name(): image["x"]}
        samples = interleaved_samples({k: (lambda c=c: c(feeds)) for k, c in compiled.items()}, repeats=args.repeats)
    rows = {
        k: {
            "median_ms": 1000 * statistics.median(v),
            "max_nodes": maxes[k],
            "ratio_to_without": statistics.median(a / b for a, b in zip(v, samples["without"], strict=True)),
        }
        for k, v in samples.items()
    }
    print_table(
        ["file", "Max nodes", "median ms", "/ without"],
        [[k, r["max_nodes"], f"{r['median_ms']:.3f}", f"{r['ratio_to_without']:.3f}"] for k, r in rows.items()],
    )
    path = write_json("openvino_attention", {"rows": rows, "repeats": args.repeats})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Deployed int8 latency on onnxruntime, and convert_deploy's own time.

ResNet-18 and MobileNetV2 at 224 px, batch 1 and 8, onnxruntime on the CPU with 2 intra-op
threads and spinning off. In one run, interleaved: the float ONNX model; mqbench's QDQ
deployment as its standard QuantizeLinear/DequantizeLinear model and as the QLinear integer
graph (``deploy_to_qlinear=True``); mqbench's ONNX_QNN deployment (its QLinear graph); and
onnxruntime's own ``quantize_static`` (QDQ format, per-channel int8 weights, uint8
activations, MinMax calibration on the same images). Targets: >= 2.5x faster than float on
ResNet-18 at batch 8, and never slower than ``quantize_static``. Also: convert_deploy's wall
time for ResNet-50 (224 px).

Run: ``.venv/bin/python benchmarks/deploy_speed.py [--repeats N] [--quick]``; writes
benchmarks/results/deploy_speed.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from _timing import steady_allocator, time_interleaved, write_json
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.onnx_graph import ort_session, save_model
from mqbench.models import mobilenet_v2, resnet18, resnet50
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

MODELS = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2}


def calibration_images(size: int, count: int = 8) -> torch.Tensor:
    """Natural-image statistics without downloads: crops of scikit-learn's two sample photos."""
    from sklearn.datasets import load_sample_images

    photos = [
        torch.from_numpy(np.asarray(p, dtype=np.float32) / 255.0).permute(2, 0, 1) for p in load_sample_images().images
    ]
    generator = torch.Generator().manual_seed(0)
    crops = []
    for index in range(count):
        photo = photos[index % len(photos)]
        top = int(torch.randint(0, photo.shape[1] - size, (1,), generator=generator))
        left = int(torch.randint(0, photo.shape[2] - size, (1,), generator=generator))
        crops.append(photo[:, top : top + size, left : left + size])
    images = torch.stack(crops)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (images - mean) / std


def deploy(
    model: nn.Module, backend: str, images: torch.Tensor, folder: Path, artifact: str = "onnx"
) -> tuple[str, float]:
    qmodel = prepare_by_platform(model, backend)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(images)
    enable_quantization(qmodel)
    start = time.perf_counter()
    result = convert_deploy(
        qmodel,
        backend,
        {"x": [1, *images.shape[1:]]},
        output_path=folder / backend,
        deploy_to_qlinear=artifact == "qlinear_onnx",
        dynamic_axes={"x": {0: "batch"}},
    )
    seconds = time.perf_counter() - start
    return result.artifacts[artifact], seconds


def float_onnx(model: nn.Module, images: torch.Tensor, path: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (images[:1],),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    return save_model(onnx.load(str(path)), path)


def ort_quantize_static(float_path: str, images: torch.Tensor, path: Path) -> str:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": images[i : i + 1].numpy()} for i in range(len(images))])

        def get_next(self):  # type: ignore[no-untyped-def]
            return next(self.batches, None)

    quantize_static(
        float_path,
        str(path),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="112 px, few repeats (a smoke run)")
    args = parser.parse_args()
    steady_allocator()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    size = 112 if args.quick else 224
    repeats = 3 if args.quick else args.repeats
    images = calibration_images(size)
    rows = []
    deploy_seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for name, factory in MODELS.items():
            model = factory(num_classes=1000).eval()
            paths = {"float": float_onnx(model, images, folder / f"{name}_float.onnx")}
            paths["mqbench QDQ: Q/DQ"], deploy_seconds[f"{name} qdq"] = deploy(model, "qdq", images, folder / name)
            paths["mqbench QDQ: QLinear"], deploy_seconds[f"{name} qdq + qlinear"] = deploy(
                model, "qdq", images, folder / f"{name}_qlinear", "qlinear_onnx"
            )
            paths["mqbench ONNX_QNN"], deploy_seconds[f"{name} onnx_qnn"] = deploy(
                model, "onnx_qnn", images, folder / name, "qlinear_onnx"
            )
            paths["ort quantize_static"] = ort_quantize_static(paths["float"], images, folder / f"{name}_ort.onnx")
            sessions = {label: ort_session(onnx.load(path)) for label, path in paths.items()}
            for batch in (1, 8):
                x = images[:batch].numpy() if batch <= len(images) else np.repeat(images.numpy(), 2, 0)[:batch]
                calls = {label: (lambda s=s, x=x: s.run(None, {"x": x})) for label, s in sessions.items()}
                median = time_interleaved(calls, repeats)
                for label, seconds in median.items():
                    rows.append(
                        {
                            "model": name,
                            "batch": batch,
                            "variant": label,
                            "ms": seconds * 1e3,
                            "speedup_vs_float": median["float"] / seconds,
                            "vs_quantize_static": median["ort quantize_static"] / seconds,
                        }
                    )
        big = resnet50(num_classes=1000).eval()
        _, deploy_seconds["resnet50 qdq"] = deploy(big, "qdq", images, folder / "resnet50")
    print(f"{'model':<14}{'batch':>6}  {'variant':<22}{'ms':>9}{'x float':>9}{'x ort static':>13}")
    for row in rows:
        print(
            f"{row['model']:<14}{row['batch']:>6}  {row['variant']:<22}{row['ms']:>9.2f}"
            f"{row['speedup_vs_float']:>9.2f}{row['vs_quantize_static']:>13.2f}"
        )
    print("\nconvert_deploy wall time (export, strip, Q/DQ, writers):")
    for key, seconds in deploy_seconds.items():
        print(f"  {key:<24}{seconds:>7.2f} s")
    path = write_json(
        "deploy_speed", {"size": size, "repeats": repeats, "latency": rows, "convert_deploy_s": deploy_seconds}
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

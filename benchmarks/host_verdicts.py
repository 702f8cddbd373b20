"""Artifact arithmetic vs this host's runtimes, with and without reduce_range, for the CPU-served artifacts.

For each zoo model and CPU-served backend (QDQ, OpenVINO), the model is calibrated on 16 training
images and deployed with the QLinear graph; ``verify_deploy(..., predict=True)`` then gives per
artifact the max LSB of its arithmetic (host-independent), of this host's runtime serving it, the
tensors beyond tolerance, and the layers the saturation model predicts (onnxruntime's and
OpenVINO's kernels without VNNI). The same again prepared with ``reduce_range=True``. Prints a
markdown table (the one in docs/backends.md) and writes benchmarks/results/host_verdicts.json with
the host facts: on a VNNI host the runtimes agree everywhere, without VNNI the 8-bit columns part.

Run: .venv/bin/python benchmarks/host_verdicts.py [--models resnet18 vit]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

from _timing import write_json
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.models.zoo import zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host
from mqbench.utils.state import enable_calibration, enable_quantization

BACKENDS = ("qdq", "openvino")


def measure(name: str, backend: str, reduce_range: bool) -> dict[str, dict[str, object]]:
    zoo = zoo_model(name)
    config = {"reduce_range": True} if reduce_range else None
    qmodel = prepare_by_platform(zoo.model, backend, prepare_custom_config_dict=config)
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(zoo.calibration[:16])
    enable_quantization(qmodel)
    x = zoo.evaluation[:2]
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the saturation warning: measured below instead
        result = convert_deploy(qmodel, backend, {"x": list(x.shape)}, output_path=folder, deploy_to_qlinear=True)
        report = verify_deploy(qmodel, result, x, predict=True)
    rows = {}
    for key, artifact in report.artifacts.items():
        host = artifact.host
        if host is None:
            continue
        rows[key] = {
            "artifact_lsb": artifact.max_lsb_diff,
            "host_runtime": host.runtime,
            "host_lsb": host.max_lsb_diff,
            "tensors_beyond": len(host.diverging(report.tolerance)),
            "predicted": len(host.predicted),
            "counts": host.served,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "vit"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(describe_host())
    results: dict[str, dict[str, object]] = {}
    print(
        "| model, backend, artifact | 8-bit: artifact / host LSB | tensors > tol. | predicted layers "
        "| `reduce_range`: artifact / host LSB | predicted |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        for backend in BACKENDS:
            plain, reduced = measure(name, backend, False), measure(name, backend, True)
            for key, row in plain.items():
                other = reduced[key]
                results[f"{name}/{backend}/{key}"] = {"8bit": row, "reduce_range": other}
                print(
                    f"| {name}, {backend}, `{key}` | {row['artifact_lsb']:g} / {row['host_lsb']:g} "
                    f"| {row['tensors_beyond']} | {row['predicted']} "
                    f"| {other['artifact_lsb']:g} / {other['host_lsb']:g} | {other['predicted']} |"
                )
    path = write_json("host_verdicts", {"results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

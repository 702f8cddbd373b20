"""Cosine similarity between float and quantized outputs, for every backend x every vision model.

Each model is conditioned first (mqbench.models.zoo: classifiers trained briefly on digits,
BatchNorm statistics re-estimated), prepared for the backend (post-training quantization),
calibrated on 32 training images and evaluated on 32 test images. Prints a markdown table
(the one in docs/backends.md) and writes benchmarks/results/backend_fidelity.json.

Run: .venv/bin/python benchmarks/backend_fidelity.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _timing import write_json
from mqbench.backends import ParamsTable
from mqbench.models.zoo import VISION_MODELS, outputs_as_tensor, zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

ACADEMIC_8BIT = {
    "extra_qconfig_dict": {
        "w_observer": "MinMaxObserver",
        "a_observer": "EMAMinMaxObserver",
        "w_fakequantize": "LearnableFakeQuantize",
        "a_fakequantize": "LearnableFakeQuantize",
        "w_qscheme": {"bit": 8, "symmetry": True, "per_channel": True, "pot_scale": False},
        "a_qscheme": {"bit": 8, "symmetry": False, "per_channel": False, "pot_scale": False},
    }
}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def main() -> None:
    torch.set_num_threads(2)
    results: dict[str, dict[str, float]] = {}
    for name in VISION_MODELS:
        zoo = zoo_model(name)
        with torch.no_grad():
            reference = outputs_as_tensor(zoo.model(zoo.evaluation))
        results[name] = {}
        for backend, spec in ParamsTable.items():
            config = ACADEMIC_8BIT if spec.weight is None else None
            prepared = prepare_by_platform(zoo.model, backend, config)
            enable_calibration(prepared)
            with torch.no_grad():
                prepared(zoo.calibration)
                enable_quantization(prepared)
                quantized = outputs_as_tensor(prepared(zoo.evaluation))
            results[name][backend] = cosine(reference, quantized)
    backends = list(ParamsTable)
    print("| backend | " + " | ".join(VISION_MODELS) + " |")
    print("| --- |" + " --- |" * len(VISION_MODELS))
    for backend in backends:
        print(f"| {backend} | " + " | ".join(f"{results[m][backend]:.4f}" for m in VISION_MODELS) + " |")
    path = write_json("backend_fidelity", {"cosine": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

"""AIMET's standard post-training recipe for SNPE on one image classifier: cross-layer equalization, then QuantSim.

Runs in benchmarks/peers/.venv-aimet (torch, aimet-torch and the torchvision copy of
``torchvision_without_extensions.py``), never in the project's venv, and does not import mqbench: AIMET quantizes
modules, which a ``torch.export`` program does not hold, so the model is torchvision's definition of the same
architecture (MobileNetV2 only) with the project's weights (``float_state.pt``; its float logits are checked against
the project's) and the images come as tensors, both written by ``run.py``. The recipe is AIMET's documented one for
a CNN: ``equalize_model`` (batch-norm folding, cross-layer scaling, high-bias absorption), then
``QuantizationSimModel`` with TF-enhanced ranges (``post_training_tf_enhanced``), 8-bit parameters and outputs and
AIMET's DSP configuration (``dsp_quantsim_config.json``: SNPE's per-tensor asymmetric uint8), ``compute_encodings``
over the calibration images, and ``export`` (the ONNX file and its ``.encodings``, which SNPE's converter reads).
``seconds`` is equalization, QuantSim and encodings.

There is no SNPE runtime here: the agreement with the float logits is QuantSim's simulation on the evaluation
images, beside mqbench's own simulation of the ``snpe`` backend in ``run.py``.
"""

from __future__ import annotations

import json
import time
from importlib.metadata import version
from pathlib import Path

import aimet_torch
import torch
import torchvision
from aimet_torch.common.defs import QuantScheme
from aimet_torch.cross_layer_equalization import equalize_model
from aimet_torch.quantsim import QuantizationSimModel
from peer_io import peer_parser, read_work

BATCH = 32
TORCHVISION_MODELS = {"mobilenet_v2": torchvision.models.mobilenet_v2}


def main() -> None:
    args = peer_parser(__doc__).parse_args()
    data = read_work(args)
    # AIMET quantizes modules, which a torch.export program does not hold: the same architecture from torchvision
    if args.work.name not in TORCHVISION_MODELS:
        raise SystemExit(f"AIMET gets modules here only for torchvision's models {sorted(TORCHVISION_MODELS)}")
    model = TORCHVISION_MODELS[args.work.name]()
    model.load_state_dict(torch.load(args.work / "float_state.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        float_outputs = torch.cat([model(batch) for batch in data["evaluation"].split(BATCH)])
    # the same function as the project's model: the float logits run.py wrote
    float_error = float((float_outputs - data["reference"]).abs().max())
    if float_error > 1e-3:
        raise SystemExit(f"torchvision's model computes other logits than the project's (max difference {float_error})")
    dummy = data["calibration"][:1]
    config = Path(aimet_torch.__file__).parent / "common" / "quantsim_config" / "dsp_quantsim_config.json"

    def calibrate(sim_model: torch.nn.Module, _: object) -> None:
        with torch.no_grad():
            for batch in data["calibration"].split(BATCH):
                sim_model(batch)

    start = time.perf_counter()
    equalize_model(model, dummy_input=dummy)
    sim = QuantizationSimModel(
        model,
        dummy,
        quant_scheme=QuantScheme.post_training_tf_enhanced,
        default_param_bw=8,
        default_output_bw=8,
        config_file=str(config),
    )
    sim.compute_encodings(calibrate, None)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        outputs = torch.cat([sim.model(batch) for batch in data["evaluation"].split(BATCH)])
    agreement = float((outputs.argmax(1) == data["reference"].argmax(1)).float().mean())
    args.out.mkdir(parents=True, exist_ok=True)
    sim.export(str(args.out), "aimet", dummy)
    record = {
        "peer": "aimet",
        "versions": {name: version(name) for name in ("aimet-torch", "torch")},
        "recipe": "equalize_model, QuantizationSimModel(tf_enhanced, 8/8 bits, dsp_quantsim_config), compute_encodings",
        "seconds": seconds,
        "top1_agreement": agreement,
        "runtime": "AIMET QuantSim (simulation)",
        "files": sorted(path.name for path in args.out.iterdir()),
        "float_logits_max_difference": float_error,
    }
    (args.out / "aimet.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()

"""AIMET's standard post-training recipe for SNPE on one image classifier: cross-layer equalization, then QuantSim.

Runs in benchmarks/peers/.venv-aimet (torch, aimet-torch and the torchvision copy of
``torchvision_without_extensions.py``), never in the project's venv, and does not import mqbench: AIMET quantizes
modules, which a ``torch.export`` program does not hold, so the model is torchvision's definition of the same
architecture with the project's weights (``float_state.pt``; its float logits are checked against the project's) and
the images come as tensors, both written by ``run.py``. MobileNetV2 and ResNet-50 share torchvision's parameter names;
the zoo ViT computes torchvision's ``VisionTransformer`` (pre-norm blocks, a class token, learned positions) and its
parameters are renamed onto it (q, k and v stacked into the attention's ``in_proj``).
The recipe is AIMET's documented one: ``equalize_model`` (batch-norm folding, cross-layer scaling,
high-bias absorption), then ``QuantizationSimModel`` with TF-enhanced ranges (``post_training_tf_enhanced``), 8-bit
parameters and outputs and AIMET's DSP configuration (``dsp_quantsim_config.json``: SNPE's per-tensor asymmetric
uint8), ``compute_encodings`` over the calibration images, and ``export`` (the ONNX file and its ``.encodings``,
which SNPE's converter reads). ``seconds`` is equalization, QuantSim and encodings.

There is no SNPE runtime here: the agreement with the float logits is QuantSim's simulation on the evaluation
images, beside mqbench's own simulation of the ``snpe`` backend in ``run.py``.
"""

from __future__ import annotations

import json
import time
from functools import partial
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


def zoo_vit(state: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """torchvision's ViT with the zoo ViT's shape, and the zoo's parameters under torchvision's names."""
    depth = 1 + max(int(name.split(".")[1]) for name in state if name.startswith("blocks."))
    dim = state["patch_embed.weight"].shape[0]
    patch = state["patch_embed.weight"].shape[-1]
    patches = state["pos_embed"].shape[1] - 1
    model = torchvision.models.VisionTransformer(
        image_size=patch * round(patches**0.5),
        patch_size=patch,
        num_layers=depth,
        num_heads=4,  # the zoo ViT's heads (vit_tiny); a wrong count fails run.py's float check
        hidden_dim=dim,
        mlp_dim=state["blocks.0.mlp.0.weight"].shape[0],
        num_classes=state["head.weight"].shape[0],
        norm_layer=partial(torch.nn.LayerNorm, eps=1e-5),  # torch's default, which the zoo's norms use
    )
    renamed = {
        "conv_proj.weight": state["patch_embed.weight"],
        "conv_proj.bias": state["patch_embed.bias"],
        "class_token": state["cls_token"],
        "encoder.pos_embedding": state["pos_embed"],
        "encoder.ln.weight": state["norm.weight"],
        "encoder.ln.bias": state["norm.bias"],
        "heads.head.weight": state["head.weight"],
        "heads.head.bias": state["head.bias"],
    }
    for i in range(depth):
        mine, theirs = f"blocks.{i}.", f"encoder.layers.encoder_layer_{i}."
        for kind in ("weight", "bias"):
            renamed[f"{theirs}ln_1.{kind}"] = state[f"{mine}norm1.{kind}"]
            renamed[f"{theirs}ln_2.{kind}"] = state[f"{mine}norm2.{kind}"]
            stacked = [state[f"{mine}attn.{part}.{kind}"] for part in ("q", "k", "v")]
            renamed[f"{theirs}self_attention.in_proj_{kind}"] = torch.cat(stacked)
            renamed[f"{theirs}self_attention.out_proj.{kind}"] = state[f"{mine}attn.out.{kind}"]
            renamed[f"{theirs}mlp.0.{kind}"] = state[f"{mine}mlp.0.{kind}"]
            renamed[f"{theirs}mlp.3.{kind}"] = state[f"{mine}mlp.2.{kind}"]
    return model, renamed


def torchvision_model(name: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """torchvision's module for the project's model ``name``, holding ``state`` (the project's parameters)."""
    if name == "mobilenet_v2":
        model = torchvision.models.mobilenet_v2(num_classes=state["classifier.1.weight"].shape[0])
    elif name == "resnet50":
        model = torchvision.models.resnet50(num_classes=state["fc.weight"].shape[0])
    elif name == "vit":
        model, state = zoo_vit(state)
    else:
        raise SystemExit(f"no torchvision module here for {name!r}: AIMET gets mobilenet_v2, resnet50 and vit")
    model.load_state_dict(state)
    return model.eval()


def main() -> None:
    args = peer_parser(__doc__).parse_args()
    data = read_work(args)
    # attention as its separate operations rather than inference's fused kernel (QuantSim still leaves the
    # nn.MultiheadAttention module float: the record's `float_weights` lists what it did not quantize)
    torch.backends.mha.set_fastpath_enabled(False)
    # AIMET quantizes modules, which a torch.export program does not hold: the same architecture from torchvision
    model = torchvision_model(args.work.name, torch.load(args.work / "float_state.pt", weights_only=True))
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
    encodings = json.loads((args.out / "aimet.encodings").read_text())
    quantized = {entry["name"] for entry in encodings["param_encodings"]}
    weights = [name for name, parameter in model.named_parameters() if name.endswith("weight") and parameter.dim() > 1]
    record = {
        "peer": "aimet",
        "versions": {name: version(name) for name in ("aimet-torch", "torch")},
        "recipe": "equalize_model, QuantizationSimModel(tf_enhanced, 8/8 bits, dsp_quantsim_config), compute_encodings",
        "seconds": seconds,
        "top1_agreement": agreement,
        "runtime": "AIMET QuantSim (simulation)",
        "files": sorted(path.name for path in args.out.iterdir()),
        "float_logits_max_difference": float_error,
        "activation_encodings": len(encodings["activation_encodings"]),
        "weight_encodings": len(quantized & set(weights)),
        "float_weights": [name for name in weights if name not in quantized],
    }
    (args.out / "aimet.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()

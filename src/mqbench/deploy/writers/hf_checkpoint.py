"""What the checkpoints of a Hugging Face architecture (compressed-tensors, GGUF, the KV-cache decoder) are written
from: the deployed model's weights, named as the source model names them, once it is known that the source
architecture computes what the simulation computes.

Two things the simulation can do leave the architecture: a Hadamard rotation with inputs rotated online or norms
without their gains (``model.meta["rotation"]``), and the per-channel input scales of SmoothQuant and AWQ
(:class:`~mqbench.advanced_ptq.smoothing.ChannelScale` nodes). A scale whose input is a norm that feeds nothing
else is folded into that norm's gain (and bias): ``norm(x) * s`` is a norm with gain ``g * s``. Any other scale
(the input of an output projection, of a down projection) has no place in the architecture: the checkpoint is
not written, with a warning naming the scales, and the ONNX artifacts hold the model. ``calibrate(smooth=
"after_norm")`` smooths only the inputs whose scales fold.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mqbench.advanced_ptq.smoothing import ChannelScale, after_foldable_norm
from mqbench.utils.hf_capture import SOURCE_CONFIG

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["Checkpoint", "hf_checkpoint"]


@dataclass
class Checkpoint:
    """A Hugging Face model's deployment, as its checkpoints are written: ``module`` (the deployed model),
    ``config`` (the source model's configuration) and ``weights`` (every parameter by name, tied ones under each
    name, the quantizers' own left out; norms with a scale folded in)."""

    module: nn.Module
    config: Mapping[str, Any]
    weights: dict[str, torch.Tensor]


def _fold_scales(module: nn.Module, weights: dict[str, torch.Tensor]) -> list[str]:
    """Fold each ChannelScale of ``module``'s graph into the norm before it (in ``weights``); the names of the
    scales that have no norm to go into."""
    if not isinstance(module, torch.fx.GraphModule):
        return []
    modules = dict(module.named_modules())
    unfolded = []
    for node in module.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(str(node.target)), ChannelScale):
            continue
        scale = modules[str(node.target)].scale.detach().float()
        source = node.args[0]
        if not after_foldable_norm(node, modules) or modules[str(source.target)].weight.numel() != scale.numel():
            unfolded.append(str(node.target))
            continue
        norm = modules[str(source.target)]
        for leaf in ("weight", "bias"):
            key = f"{source.target}.{leaf}"
            if getattr(norm, leaf, None) is not None and key in weights:
                weights[key] = weights[key] * scale
    return unfolded


def hf_checkpoint(context: DeployContext, key: str, model_types: tuple[str, ...] | None = None) -> Checkpoint | None:
    """The deployment as a checkpoint of its source architecture is written from, or None: not a Hugging Face
    model, or not one of ``model_types``, silently; a model the architecture cannot compute (rotated, or scaled
    where no norm takes the scale), with a warning saying why (``key`` names the artifact)."""
    module = context.module
    config = getattr(module, SOURCE_CONFIG, None) if module is not None else None
    if module is None or not isinstance(config, Mapping):
        return None
    if model_types is not None and config.get("model_type") not in model_types:
        return None
    architecture = (config.get("architectures") or ["Hugging Face"])[0]
    rotation = module.meta.get("rotation") if isinstance(module, torch.fx.GraphModule) else None
    if rotation and (rotation.get("online") or rotation.get("streams")):
        changed = [*rotation.get("online", ()), *(n for s in rotation.get("streams", ()) for n in s["norms"])]
        warnings.warn(
            f"{key}: not written, the Hadamard rotation changed the architecture ({len(changed)} layer(s): inputs "
            f"rotated online, norms without their gains, e.g. {', '.join(changed[:3])}), which a {architecture} "
            "checkpoint cannot compute; the ONNX artifacts hold it",
            stacklevel=4,
        )
        return None
    weights = {
        name: parameter.detach()
        for name, parameter in module.named_parameters(remove_duplicate=False)
        if ".weight_fake_quant." not in name and "_fake_quantizer." not in name
    }
    unfolded = _fold_scales(module, weights)
    if unfolded:
        warnings.warn(
            f"{key}: not written, {len(unfolded)} per-channel input scale(s) of SmoothQuant or AWQ are not after a "
            f"norm they could be folded into ({', '.join(unfolded[:3])}{' ...' if len(unfolded) > 3 else ''}), "
            f"and a {architecture} checkpoint has no place for them; the ONNX artifacts hold them (for this "
            "checkpoint, calibrate with smooth='after_norm' or smooth=False, or give awq's config 'layers' only the "
            "projections that follow a norm)",
            stacklevel=4,
        )
        return None
    return Checkpoint(module, config, weights)

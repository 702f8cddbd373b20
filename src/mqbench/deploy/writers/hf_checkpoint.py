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

A model that computes an architecture without being its class (the project's decoder, written as OPT) declares
it with ``checkpoint_config()``: the checkpoint holds its parameters under the architecture's names
(:meth:`Names.rename`), with the zero rows the architecture puts in front of a table.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mqbench.advanced_ptq.smoothing import ChannelScale, after_foldable_norm
from mqbench.utils.hf_capture import INPUT_NAMES, LEADING_ROWS, PARAMETER_NAMES, SOURCE_CONFIG

if TYPE_CHECKING:
    from mqbench.deploy.context import DeployContext

__all__ = ["Checkpoint", "Names", "hf_checkpoint", "unlike_gpt2"]


class Names:
    """The names a checkpoint's architecture gives the deployed model's parameters, layers and inputs (the same names
    for a Hugging Face model; mapped for a model that declares its architecture, :data:`PARAMETER_NAMES`, its
    inputs in order by :data:`INPUT_NAMES`).

    Example:
        >>> names = Names({"mqbench_parameter_names": {"blocks.0.fc.weight": "layers.0.fc1.weight"}})
        >>> names.rename("blocks.0.fc.weight_scale"), names.layer("blocks.0.fc"), names.rename("other.weight")
        ('layers.0.fc1.weight_scale', 'layers.0.fc1', 'other.weight')
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.parameters: dict[str, str] = dict(config.get(PARAMETER_NAMES) or {})
        self.inputs: list[str] = list(config.get(INPUT_NAMES) or ())
        self.layers = {ours.rpartition(".")[0]: theirs.rpartition(".")[0] for ours, theirs in self.parameters.items()}

    def layer(self, name: str) -> str:
        """The architecture's name of the layer (module) ``name``."""
        return self.layers.get(name, name)

    def rename(self, key: str) -> str:
        """The architecture's name of a parameter, or of a tensor ``layer.leaf`` the checkpoint stores for a layer."""
        if key in self.parameters:
            return self.parameters[key]
        owner, dot, leaf = key.rpartition(".")
        return f"{self.layer(owner)}.{leaf}" if dot else key

    def arguments(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The deployment's inputs (in the model's order) as the architecture's forward takes them, by name."""
        return dict(zip(self.inputs, feeds.values(), strict=True)) if self.inputs else dict(feeds)


@dataclass
class Checkpoint:
    """A Hugging Face model's deployment, as its checkpoints are written: ``module`` (the deployed model),
    ``config`` (the source model's configuration) and ``weights`` (every parameter by the deployed model's name,
    tied ones under each name, the quantizers' own left out; norms with a scale folded in, tables with the
    architecture's leading rows); ``names`` maps the deployed model's names onto the architecture's."""

    module: nn.Module
    config: Mapping[str, Any]
    weights: dict[str, torch.Tensor]
    names: Names


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
    for name, rows in (config.get(LEADING_ROWS) or {}).items():
        if name in weights:
            table = weights[name]
            weights[name] = torch.cat([table.new_zeros((int(rows), *table.shape[1:])), table])
    return Checkpoint(module, config, weights, Names(config))


def unlike_gpt2(source: Mapping[str, Any]) -> str:
    """Why an OPT model's blocks are not GPT-2's ("" where they are: pre-norm, tanh-approximated GELU, an MLP 4x
    wide, biases and norm gains, no projections around the blocks), which GPT-2's and the KV-cache decoder
    compute."""
    hidden = int(source["hidden_size"])
    if source.get("activation_function") not in ("gelu_new", "gelu_pytorch_tanh"):
        return f"its activation {source.get('activation_function')!r} (GPT-2's computes the tanh GELU)"
    if not source.get("do_layer_norm_before", True) or source.get("_remove_final_layer_norm"):
        return "its post-norm blocks (GPT-2's normalizes before each block)"
    if int(source.get("word_embed_proj_dim") or hidden) != hidden:
        return "its projections around the blocks (GPT-2's has none)"
    if int(source["ffn_dim"]) != 4 * hidden:
        return f"an MLP {source['ffn_dim']} wide (transformers' GGUF reader builds GPT-2's, 4 x {hidden})"
    if not source.get("enable_bias", True) or not source.get("layer_norm_elementwise_affine", True):
        return "layers without biases or norms without gains (GPT-2's has both)"
    return ""

"""BackendSpec: everything that differs between hardware backends, as data.

Example:
    >>> from mqbench.backends import ParamsTable
    >>> spec = ParamsTable["tensorrt"]
    >>> spec.weight.scheme.quant_range, spec.activation.fake_quantize
    ((-127, 127), 'LearnableFakeQuantize')
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from mqbench.fake_quantize import FakeQuantizeDict
from mqbench.observer import ObserverDict
from mqbench.scheme import QuantScheme
from mqbench.utils.factory import Factory

__all__ = [
    "FLOAT_LAYER_ROLES",
    "OP_KINDS",
    "BackendSpec",
    "PTQRecipe",
    "Placement",
    "QuantizerSpec",
    "check_float_layers",
]

# The roles of layers a backend (or prepare_custom_config_dict["float_layers"]) can leave float.
FLOAT_LAYER_ROLES = ("lm_head", "embedding")


def check_float_layers(value: Any, where: str) -> tuple[str, ...]:
    """``value`` as a tuple of roles of :data:`FLOAT_LAYER_ROLES`; ``ValueError`` naming ``where`` otherwise."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"{where}: float_layers must be a list of roles from {list(FLOAT_LAYER_ROLES)}, got {value!r}")
    unknown = [role for role in value if role not in FLOAT_LAYER_ROLES]
    if unknown:
        raise ValueError(f"{where}: float_layers has unknown roles {unknown}; valid: {list(FLOAT_LAYER_ROLES)}")
    return tuple(role for role in FLOAT_LAYER_ROLES if role in value)


# The op kinds placement rules speak of (see mqbench.custom_quantizer.ops for how nodes map to them).
OP_KINDS = frozenset(
    {
        "conv",
        "linear",
        "deconv",
        "pool",
        "add",
        "mul",
        "matmul",
        "concat",
        "interpolate",
        "relu",
        "bn",
        "flatten",
        "dropout",
        "reshape",
        "hardswish",
        "sigmoid",
        "embedding",
        "layernorm",
        "softmax",
        "gelu",
    }
)


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class QuantizerSpec:
    """One quantizer: its scheme, fake-quantizer and observer (registry names or classes), extra kwargs."""

    scheme: QuantScheme
    fake_quantize: str | type = "LearnableFakeQuantize"
    observer: str | type = "MinMaxObserver"
    fake_quantize_kwargs: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))
    observer_kwargs: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))

    def __post_init__(self) -> None:
        object.__setattr__(self, "fake_quantize_kwargs", _frozen(self.fake_quantize_kwargs))
        object.__setattr__(self, "observer_kwargs", _frozen(self.observer_kwargs))

    def __reduce__(self) -> tuple[Any, ...]:
        # copied and pickled with plain dicts (a mappingproxy is neither); the constructor freezes them again
        kwargs = (dict(self.fake_quantize_kwargs), dict(self.observer_kwargs))
        return (QuantizerSpec, (self.scheme, self.fake_quantize, self.observer, *kwargs))

    def factory(self) -> Factory:
        """A factory building this quantizer (resolving registry names now, so typos fail early)."""

        fake_quantize = FakeQuantizeDict.resolve(self.fake_quantize)
        observer = ObserverDict.resolve(self.observer)
        kwargs = {**self.scheme.observer_kwargs(), **self.observer_kwargs, **self.fake_quantize_kwargs}
        return fake_quantize.with_args(observer=observer, **kwargs)

    def with_scheme(self, **changes: Any) -> QuantizerSpec:
        return replace(self, scheme=replace(self.scheme, **changes))

    def describe(self) -> str:
        s = self.scheme
        parts = [
            f"{s.bits}-bit",
            "sym" if s.symmetric else "asym",
            f"per-channel(axis {s.ch_axis})" if s.per_channel else "per-tensor",
            *([f"groups of {s.group_size}"] if s.group_size is not None else []),
            f"[{s.quant_min}, {s.quant_max}]",
        ]
        if s.pot_scale:
            parts.append("pot")
        name = lambda c: c if isinstance(c, str) else c.__name__  # noqa: E731
        return f"{' '.join(parts)} {name(self.fake_quantize)}/{name(self.observer)}"


@dataclass(frozen=True)
class Placement:
    """Where a backend's activation quantizers go: the integer boundaries of its hardware.

    Attributes:
        inputs_of: op kinds whose tensor inputs are quantized (each consumer gets the
            quantized value; other consumers of the same tensor keep the float one).
        outputs_of: op kinds whose outputs are quantized for every consumer.
        passthrough: kinds an output quantizer moves past when they are the sole consumer
            (ReLU after a conv: the hardware quantizes after the activation).
        network_inputs / network_outputs: quantize the model's inputs / outputs.
        fused_mul_add: no quantizer between a ``mul`` and the ``add`` it alone feeds.
        add_needs_activations: quantize an ``add`` only when every input descends from a
            weighted or normalising op (skips embedding sums and additive attention masks).
        shared_inputs_of: kinds whose inputs share one quantizer (concat on power-of-two hardware).
        unsigned_after: kinds whose output is non-negative: quantizers fed by them use an
            unsigned grid (the activation scheme with ``unsigned=True``).
        first_last_8bit: the first and last weighted layers keep 8-bit weights and inputs.
        per_channel_depthwise_inputs: a quantizer read only by depthwise convolutions (groups equal to the
            input channels, more than one) has a scale per channel (axis 1): each channel of a depthwise
            convolution is its own dot product, so a per-channel input scale folds into that channel's
            weights and the integer kernel stays the same (OpenVINO's CPU rules).
        float_residual_adds: an add on a transformer's residual stream keeps float inputs: one whose output or one
            of whose inputs a layernorm reads (post- and pre-norm blocks). Those streams carry outlier channels
            (near +-200 beside values below 1 in BERT) that no per-tensor 8-bit grid holds; adds elsewhere (a
            CNN's) are quantized as ``inputs_of`` says.
        float_attention_values: a matmul reading a softmax's output (attention weights times values) keeps float
            inputs; the scores' matmul (queries times keys) is quantized as ``inputs_of`` says.
        matmul_inputs_at_layers: a matmul's input that a linear or convolution layer produces through data
            movement alone (the heads' reshapes and transposes, each read by nothing else) is quantized at the
            layer's output: the same values on a per-tensor grid, and a runtime that folds a quantizer into the
            layer producing its input (OpenVINO's CPU plugin) does so; after the reshape it runs on its own.
    """

    inputs_of: AbstractSet[str] = frozenset()
    outputs_of: AbstractSet[str] = frozenset()
    passthrough: AbstractSet[str] = frozenset()
    network_inputs: bool = False
    network_outputs: bool = False
    fused_mul_add: bool = False
    add_needs_activations: bool = False
    shared_inputs_of: AbstractSet[str] = frozenset()
    unsigned_after: AbstractSet[str] = frozenset()
    first_last_8bit: bool = False
    per_channel_depthwise_inputs: bool = False
    float_residual_adds: bool = False
    float_attention_values: bool = False
    matmul_inputs_at_layers: bool = False

    def __post_init__(self) -> None:
        for name in ("inputs_of", "outputs_of", "passthrough", "shared_inputs_of", "unsigned_after"):
            value = frozenset(getattr(self, name))
            unknown = value - OP_KINDS
            if unknown:
                raise ValueError(f"Placement.{name} has unknown op kinds {sorted(unknown)}; valid: {sorted(OP_KINDS)}")
            object.__setattr__(self, name, value)

    def describe(self) -> str:
        parts = []
        if self.inputs_of:
            parts.append(f"inputs of {', '.join(sorted(self.inputs_of))}")
        if self.outputs_of:
            parts.append(f"outputs of {', '.join(sorted(self.outputs_of))}")
        if self.passthrough:
            parts.append(f"moved past {', '.join(sorted(self.passthrough))}")
        flags = {
            "network_inputs": "network inputs",
            "network_outputs": "network outputs",
            "fused_mul_add": "no quantizer between mul and its add",
            "add_needs_activations": "residual adds only",
            "first_last_8bit": "first/last layer 8-bit",
            "per_channel_depthwise_inputs": "per-channel inputs of depthwise convolutions",
            "float_residual_adds": "residual adds of normalised streams in float",
            "float_attention_values": "attention weights x values in float",
            "matmul_inputs_at_layers": "matmul inputs quantized at the layers producing them",
        }
        parts += [text for attr, text in flags.items() if getattr(self, attr)]
        if self.shared_inputs_of:
            parts.append(f"shared input quantizer for {', '.join(sorted(self.shared_inputs_of))}")
        if self.unsigned_after:
            parts.append(f"unsigned after {', '.join(sorted(self.unsigned_after))}")
        return "; ".join(parts)


@dataclass(frozen=True)
class PTQRecipe:
    """What post-training calibration does by default on a backend (``mqbench.advanced_ptq.calibrate``,
    ``mqbench ptq``), each step overridable there.

    Attributes:
        activation_observer: the observer the activation quantizers calibrate with where the model keeps the
            backend's default one (an ``a_observer`` the user chose is kept); None: the default stays. The
            running min/max suits training; after one calibration pass a clipping observer loses less.
        equalize: cross-layer equalization of the weights before calibrating (per-tensor weight grids).
        bias_correction: empirical bias correction after calibrating (one forward pass of the quantized model).
        fast_bias_correction: with ``bias_correction``, each layer's correction from the mean of its float input,
            recorded during the calibration pass (``mqbench.advanced_ptq.fast_bias_correction``): no further pass.
        guard_pair_saturation: on a host whose int8 CPU kernels sum two u8 x s8 products in a saturating
            16-bit register (x86 without VNNI: ``mqbench.utils.host.int8_pairs_saturate``), the layers reading a
            signed or asymmetric 8-bit input get 7-bit weights ([-64, 63]). A CPU runtime shifts a signed input by
            128 to run it on u8 kernels, so its values sit around 128 and reach 255 (an asymmetric input's fill
            the grid from its zero point), where a pair of 8-bit weights overflows the register; unsigned inputs
            on a symmetric grid (after ReLU) are mostly small. Elsewhere nothing changes.
        smooth: migrate the activation outliers of linear inputs into the weights first (SmoothQuant,
            ``mqbench.advanced_ptq.smooth_quant``), with strength ``smooth_alpha`` (None: searched per input,
            which costs a pass of error measurements).

    A model with LayerNorm or RMSNorm (a transformer, whose outlier channels must not be clipped) gets its backend's
    ``transformer_recipe`` instead (plain calibration unless the backend says otherwise), and a recipe given
    explicitly is used as given.
    """

    activation_observer: str | None = None
    equalize: bool = False
    bias_correction: bool = False
    fast_bias_correction: bool = False
    guard_pair_saturation: bool = False
    smooth: bool = False
    smooth_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.fast_bias_correction and not self.bias_correction:
            raise ValueError("PTQRecipe.fast_bias_correction chooses how bias_correction runs: set bias_correction too")
        if self.smooth_alpha is not None and not 0.0 <= self.smooth_alpha <= 1.0:
            raise ValueError(f"PTQRecipe.smooth_alpha must be in [0, 1] or None (searched), got {self.smooth_alpha}")

    def describe(self) -> str:
        parts = [f"activations calibrated with {self.activation_observer}"] if self.activation_observer else []
        parts += [
            text
            for flag, text in (
                (self.equalize, "cross-layer equalization"),
                (self.bias_correction, "fast bias correction" if self.fast_bias_correction else "bias correction"),
                (self.guard_pair_saturation, "7-bit weights after signed inputs on CPUs without VNNI"),
                (
                    self.smooth,
                    "outliers of linear inputs migrated into the weights"
                    + (f" (alpha {self.smooth_alpha})" if self.smooth_alpha is not None else ""),
                ),
            )
            if flag
        ]
        return ", ".join(parts) or "plain calibration"


@dataclass(frozen=True)
class BackendSpec:
    """Everything about one backend: default quantizers, placement and fusion.

    ``weight`` / ``activation`` may be None (the Academic backends): the user's
    ``extra_qconfig_dict`` must then supply them. A ``weight_only`` backend has no activation
    quantizers (``activation`` None, an empty placement).
    """

    name: str
    weight: QuantizerSpec | None
    activation: QuantizerSpec | None
    placement: Placement
    fuse: bool = True
    description: str = ""
    model_quantizer: type | None = None  # a ModelQuantizer subclass; None: the rule-driven default
    deploy: tuple[str, ...] = ()  # artifact keys its writers produce besides `onnx` and `deploy_onnx`
    # LSBs a runtime may differ from the simulation on one tensor computed from the same inputs: a
    # rounding tie decided the other way by another float summation order is 1.
    lsb_tolerance: int = 1
    # Its Q/DQ ONNX is what a CPU runtime (onnxruntime, OpenVINO) serves: verify then fails when this
    # host's runtime computes it differently (the QLinear and OpenVINO artifacts always are).
    served_on_cpu: bool = False
    # mqbench.advanced_ptq.calibrate migrates activation outliers of linear inputs into the weights
    # first (SmoothQuant, strength searched per input): for transformers on per-tensor 8-bit grids.
    smooth_linear_inputs: bool = False
    # A declarative rule set (a mqbench.backend_config.BackendConfig) deciding per node what is
    # quantized; its model_quantizer reads it. None: the placement decides, by op kind.
    declared: Any = None
    # The bit widths its format deploys per quantizer besides the defaults' (mixed precision through
    # prepare_custom_config_dict["quantizer_bits"]); empty: one width per quantizer kind.
    mixed_precision_bits: tuple[int, ...] = ()
    # What post-training calibration does by default (mqbench.advanced_ptq.calibrate; mqbench ptq).
    ptq_recipe: PTQRecipe = PTQRecipe()
    # What it does by default to a model with LayerNorm or RMSNorm (a transformer); ptq_recipe's clipping and bias
    # correction are for CNNs.
    transformer_recipe: PTQRecipe = PTQRecipe()
    # The activation quantizer of a model with LayerNorm or RMSNorm (a transformer), where it differs from
    # ``activation`` (None: the same): prepare_by_platform chooses it from the captured graph
    # (mqbench.custom_quantizer.ops.normalizes_layers); an a_qscheme the user gives changes it as it changes
    # ``activation``. The operands of a product of two activations (attention's queries and keys) keep
    # ``activation``: they take the weights' place in an int8 kernel. Keep its observer ``activation``'s (the
    # recipes replace that one).
    transformer_activation: QuantizerSpec | None = None
    # Weights only: activations stay float (W4A16, W8A16); ``activation`` is None and needs no user settings.
    weight_only: bool = False
    # Layers left float by role (FLOAT_LAYER_ROLES): "lm_head", a language model's projection onto its vocabulary
    # (a Linear writing a model output, as wide as an Embedding table's vocabulary), and "embedding", its Embedding
    # tables. The LLM formats keep both float, as their runtimes do; prepare_custom_config_dict["float_layers"]
    # overrides it ([] quantizes them).
    float_layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "deploy", tuple(self.deploy))
        object.__setattr__(self, "mixed_precision_bits", tuple(self.mixed_precision_bits))
        object.__setattr__(self, "float_layers", check_float_layers(self.float_layers, f"backend {self.name!r}"))
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"backend names are lowercase and non-empty, got {self.name!r}")
        if self.weight_only and (self.weight is None or self.activation is not None or self.placement != Placement()):
            raise ValueError(
                f"backend {self.name!r} is weight-only: give it a weight quantizer, no activation quantizer and an "
                "empty placement (Placement())"
            )

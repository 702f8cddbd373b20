"""The integer layer with a weight (Linear, Conv, ConvTranspose): quantized weight and bias, conversion.

A layer holds its weight as integers (``weight_int``: int8 / uint8, or int16 / int32 for wider
ranges) with ``weight_scale`` and ``weight_zero_point`` (one per output channel for per-channel
weights), the bias on the accumulator grid ``input_scale * weight_scale`` as int32
(``bias_int``, round half to even) and the fixed-point ``multiplier`` and ``shift`` of
``input_scale * weight_scale / output_scale`` (per channel where the weight is). Its integer
forward accumulates ``(x - x_zp) * (w - w_zp)`` exactly, adds the bias and requantizes.

``from_float`` builds a layer from a float module and explicit parameters; ``from_observed``
reads them from mqbench fake quantizers: the input and output quantizers given and the weight
quantizer ``module.weight_fake_quant`` (or ``weight_quantizer=``).

Example:
    >>> import numpy as np
    >>> import torch
    >>> from torch import nn
    >>> from mqbench.qparams import TensorQParams
    >>> from mqbench.nn.quantized import Linear
    >>> act = TensorQParams(np.array([2.0**-6]), np.array([0]), -128, 127)
    >>> wq = TensorQParams(np.array([2.0**-5]), np.array([0]), -127, 127, kind="weight")
    >>> layer = nn.Linear(2, 1)
    >>> with torch.no_grad():
    ...     _ = layer.weight.copy_(torch.tensor([[0.09375, -0.0625]])), layer.bias.fill_(0.0625)
    >>> q = Linear.from_float(layer, act, wq, TensorQParams(np.array([0.125]), np.array([0]), -128, 127))
    >>> q.weight_int.tolist(), q.bias_int.tolist(), q(torch.tensor([[0.5, -0.25]])).tolist()
    ([[3, -2]], [128], [[0.125]])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from mqbench.nn.intrinsic.modules.fused import ACTIVATIONS, FusedModule
from mqbench.nn.qat.modules.base import QATModule
from mqbench.nn.quantized import functional as QF
from mqbench.nn.quantized.base import QuantizedModule, check_qparams, qparams_from_quantizer, to_numpy
from mqbench.qparams import TensorQParams
from mqbench.utils.fusion import fold_bn_into, layer_init_kwargs

__all__ = ["WeightedQuantizedModule", "integer_container", "integer_module_for"]

LayerT = TypeVar("LayerT", bound="WeightedQuantizedModule")


def integer_container(quant_min: int, quant_max: int) -> torch.dtype:
    """The narrowest torch integer type holding ``[quant_min, quant_max]`` (int8, uint8, int16, int32).

    >>> integer_container(-127, 127), integer_container(0, 255), integer_container(-512, 511)
    (torch.int8, torch.uint8, torch.int16)
    """
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= quant_min and quant_max <= info.max:
            return dtype
    raise ValueError(f"the integer range [{quant_min}, {quant_max}] does not fit in 32 bits")


def _activation_bound(activation: nn.Module) -> float | None:
    """``None`` for a ReLU, the upper clamp for a ReLU6 / Hardtanh(0, max); TypeError otherwise."""
    if isinstance(activation, nn.ReLU):
        return None
    if isinstance(activation, nn.Hardtanh) and activation.min_val == 0 and activation.max_val > 0:
        return float(activation.max_val)
    raise TypeError(f"the activation must be ReLU or ReLU6, got {type(activation).__name__}")


class WeightedQuantizedModule(QuantizedModule):
    """Base of the integer layers; subclasses set the class attributes and implement ``_accumulate``.

    ``_FLOAT_LAYER``: the float layer type; ``_RELU``: whether the layer ends with a ReLU;
    ``_WEIGHT_AXIS``: the weight axis of the output channels (0, or 1 for transposed
    convolutions); ``_SPATIAL``: the number of spatial dimensions (0 for Linear).
    """

    _FLOAT_LAYER: ClassVar[type[nn.Module]]
    _RELU: ClassVar[bool] = False
    _WEIGHT_AXIS: ClassVar[int] = 0
    _SPATIAL: ClassVar[int] = 0

    input_scale: Tensor
    input_quant_min: int
    input_quant_max: int
    weight_quant_min: int
    weight_quant_max: int
    input_zero_point: Tensor
    weight_int: Tensor
    weight_scale: Tensor
    weight_zero_point: Tensor
    bias_int: Tensor | None
    multiplier: Tensor
    shift: Tensor

    def __init__(
        self,
        out_channels: int,
        weight_shape: tuple[int, ...],
        groups: int,
        input_qparams: TensorQParams,
        weight_qparams: TensorQParams,
        output_qparams: TensorQParams,
        bias: bool,
        relu_max: float | None,
        rounding: str,
    ) -> None:
        super().__init__(output_qparams, self._RELU, relu_max, rounding)
        input_qparams = check_qparams(input_qparams, "input")
        weight_qparams = check_qparams(weight_qparams, "weight", per_tensor=False)
        self.out_channels = int(out_channels)
        self._register_grid("input_", input_qparams)
        self._register_grid("weight_", weight_qparams)
        self.weight_axis = weight_qparams.axis
        per_channel = weight_qparams.scale.size
        if weight_qparams.axis is not None:
            if weight_qparams.axis % len(weight_shape) != self._WEIGHT_AXIS:
                raise ValueError(
                    f"per-channel weight parameters must lie along axis {self._WEIGHT_AXIS} (the output channels) "
                    f"of the {type(self).__name__} weight, got axis {weight_qparams.axis}"
                )
            self.weight_axis = self._WEIGHT_AXIS
            if per_channel != weight_shape[self._WEIGHT_AXIS]:
                raise ValueError(
                    f"the weight parameters have {per_channel} channels but axis {self._WEIGHT_AXIS} of the "
                    f"{type(self).__name__} weight {list(weight_shape)} has {weight_shape[self._WEIGHT_AXIS]}"
                )
        # the accumulator scale of each output channel: input scale * weight scale, exact in float64
        weight_scale = weight_qparams.scale.astype(np.float64)
        if per_channel > 1 and per_channel != self.out_channels:  # transposed: per channel within each group
            weight_scale = np.tile(weight_scale, groups)
        accumulator_scale = input_qparams.scale.astype(np.float64)[0] * weight_scale
        m0, shift = QF.requantize_multipliers(accumulator_scale / output_qparams.scale.astype(np.float64)[0])
        self.register_buffer("multiplier", torch.from_numpy(m0))
        self.register_buffer("shift", torch.from_numpy(shift))
        dtype = integer_container(weight_qparams.quant_min, weight_qparams.quant_max)
        self.register_buffer("weight_int", torch.zeros(weight_shape, dtype=dtype))
        self.register_buffer("bias_int", torch.zeros(self.out_channels, dtype=torch.int32) if bias else None)

    # -- weights ---------------------------------------------------------------------------------
    def _accumulator_scale(self) -> np.ndarray:
        """``input_scale * weight_scale`` per output channel (size 1 for per-tensor weights), float64."""
        weight_scale = to_numpy(self.weight_scale).astype(np.float64)
        if weight_scale.size > 1 and weight_scale.size != self.out_channels:
            weight_scale = np.tile(weight_scale, self.out_channels // weight_scale.size)
        return to_numpy(self.input_scale).astype(np.float64)[0] * weight_scale

    def _weight_param(self, values: Tensor, dtype: Any) -> np.ndarray:
        """A weight parameter shaped to broadcast against the weight."""
        array = to_numpy(values).astype(dtype)
        if self.weight_axis is None:
            return array.reshape(())
        shape = [1] * self.weight_int.dim()
        shape[self.weight_axis] = -1
        return array.reshape(shape)

    def set_weight_bias(self, weight: Tensor, bias: Tensor | None) -> None:
        """Quantize the float ``weight`` (round half to even, clamp) and ``bias`` (to the accumulator grid)."""
        if tuple(weight.shape) != tuple(self.weight_int.shape):
            raise ValueError(f"the weight has shape {list(weight.shape)}, expected {list(self.weight_int.shape)}")
        w = QF.quantize(
            to_numpy(weight.float()),
            self._weight_param(self.weight_scale, np.float32),
            self._weight_param(self.weight_zero_point, np.int64),
            self.weight_quant_min,
            self.weight_quant_max,
        )
        self.weight_int.copy_(torch.from_numpy(w))
        if (bias is None) != (self.bias_int is None):
            raise ValueError("the layer was built " + ("without a bias" if bias is not None else "with a bias"))
        if bias is not None and self.bias_int is not None:
            if bias.numel() != self.out_channels:
                raise ValueError(f"the bias has {bias.numel()} values, expected {self.out_channels}")
            bias_q = QF.quantize_bias(to_numpy(bias.float()).reshape(-1), self._accumulator_scale())
            self.bias_int.copy_(torch.from_numpy(QF.check_int32(bias_q, "the quantized bias")))

    def centered_weight(self) -> np.ndarray:
        """``weight_int - weight_zero_point`` as int64."""
        return to_numpy(self.weight_int).astype(np.int64) - self._weight_param(self.weight_zero_point, np.int64)

    # -- forward ---------------------------------------------------------------------------------
    def _accumulate(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Exact int64 accumulation of centred inputs (batched) and centred weights, without bias."""
        raise NotImplementedError

    def _channel_shape(self, ndim: int) -> tuple[int, ...]:
        """Shape broadcasting a per-channel value against a batched accumulator of rank ``ndim``."""
        if self._SPATIAL == 0:
            return (-1,)
        return (-1, *([1] * self._SPATIAL))

    def _batched(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """``x`` with a batch axis (and whether one was added)."""
        rank = self._SPATIAL + 2
        if self._SPATIAL and x.ndim == rank - 1:
            return x[None], True
        if self._SPATIAL and x.ndim != rank:
            raise ValueError(f"{type(self).__name__} takes inputs of rank {rank - 1} or {rank}, got shape {x.shape}")
        return x, False

    def _accumulator(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """The batched int64 accumulators (bias included) of input integers, and whether a batch axis was added."""
        x, unbatched = self._batched(x)
        acc = self._accumulate(x - self._grid("input_")[1], self.centered_weight())
        if self.bias_int is not None:
            acc = acc + to_numpy(self.bias_int).astype(np.int64).reshape(self._channel_shape(acc.ndim))
        return acc, unbatched

    def _integer_forward(self, x: np.ndarray) -> np.ndarray:
        acc, unbatched = self._accumulator(x)
        m0, shift = to_numpy(self.multiplier), to_numpy(self.shift)
        if m0.size > 1:
            shape = self._channel_shape(acc.ndim)
            m0, shift = m0.reshape(shape), shift.reshape(shape)
        y = self._requantize(acc, m0, shift)
        return y[0] if unbatched else y

    def accumulate(self, x: Tensor) -> Tensor:
        """Accumulators of input integers ``x``: ``sum (x - x_zp) * (w - w_zp) + bias_int`` (before requantization)."""
        acc, unbatched = self._accumulator(self._integers("input_", x))
        return torch.from_numpy(acc[0] if unbatched else acc).to(x.device)

    def quantize_input(self, x: Tensor) -> Tensor:
        """The float input on the input grid (int64)."""
        return self._quantize("input_", x)

    def forward_integer(self, x: Tensor) -> Tensor:
        """Input integers (on the input grid) to output integers (on the output grid), int64."""
        return torch.from_numpy(self._integer_forward(self._integers("input_", x))).to(x.device)

    def forward(self, x: Tensor) -> Tensor:
        """Quantize ``x``, run the integer layer, dequantize (float32, or ``x``'s float type)."""
        q = to_numpy(self.quantize_input(x))
        return self._float_output(self._integer_forward(q), x)

    # -- conversion ------------------------------------------------------------------------------
    @classmethod
    def _layer_kwargs(cls, layer: nn.Module) -> dict[str, Any]:
        kwargs = layer_init_kwargs(layer)
        kwargs.pop("device", None)
        kwargs.pop("dtype", None)
        return kwargs

    @classmethod
    def _split(cls, mod: nn.Module) -> tuple[nn.Module, float | None]:
        """The float layer (BatchNorm folded) and the ReLU upper bound of ``mod``; TypeError where it does not fit."""
        if isinstance(mod, QATModule):
            mod = mod.to_float()  # BatchNorm folded, the activation kept
        parts = list(mod) if isinstance(mod, FusedModule) else [mod]
        layer, relu_max, activation = parts[0], None, None
        for part in parts[1:]:
            if isinstance(part, _BatchNorm):
                layer = fold_bn_into(layer, part)
            else:
                activation = part
                relu_max = _activation_bound(part)
        name = cls.__name__
        if not isinstance(layer, cls._FLOAT_LAYER):
            expected = cls._FLOAT_LAYER.__name__
            raise TypeError(f"{name}.from_float expects a float {expected} (or a fused one), got {type(mod).__name__}")
        if cls._RELU and activation is None:
            raise TypeError(f"{name}.from_float expects a layer followed by a ReLU (a fused module), got a plain layer")
        if not cls._RELU and activation is not None:
            raise TypeError(f"{name}.from_float got a layer with an activation; use the ReLU variant of {name}")
        return layer, relu_max

    @classmethod
    def _build(
        cls: type[LayerT],
        mod: nn.Module,
        input_qparams: TensorQParams,
        weight_qparams: TensorQParams,
        output_qparams: TensorQParams,
        rounding: str,
        transform: Callable[[Tensor], Tensor] | None = None,
    ) -> LayerT:
        layer, relu_max = cls._split(mod)
        extra: dict[str, Any] = {"relu_max": relu_max} if cls._RELU else {}
        quantized = cls(
            **cls._layer_kwargs(layer),
            input_qparams=input_qparams,
            weight_qparams=weight_qparams,
            output_qparams=output_qparams,
            rounding=rounding,
            **extra,
        )
        weight = layer.weight
        if not isinstance(weight, Tensor):
            raise ValueError(f"{type(layer).__name__} has no weight tensor")
        weight = weight.detach()
        if transform is not None:
            weight = transform(weight).detach()
        bias = layer.bias
        quantized.set_weight_bias(weight, bias.detach() if isinstance(bias, Tensor) else None)
        return quantized

    @classmethod
    def from_float(
        cls: type[LayerT],
        mod: nn.Module,
        input_qparams: TensorQParams,
        weight_qparams: TensorQParams,
        output_qparams: TensorQParams,
        rounding: str = "half_up",
    ) -> LayerT:
        """The integer layer of the float ``mod`` with the given input, weight and output parameters.

        ``mod`` is the float layer, a fused module of :mod:`mqbench.nn.intrinsic` (BatchNorm
        folded; the ReLU variants take a ReLU or ReLU6) or a QAT module (its float weights).
        """
        return cls._build(mod, input_qparams, weight_qparams, output_qparams, rounding)

    @classmethod
    def from_observed(
        cls: type[LayerT],
        mod: nn.Module,
        input_quantizer: nn.Module,
        output_quantizer: nn.Module,
        weight_quantizer: nn.Module | None = None,
        rounding: str = "half_up",
    ) -> LayerT:
        """The integer layer of a QAT (or float) module, with parameters read from mqbench fake quantizers.

        The weight quantizer is ``weight_quantizer`` or ``mod.weight_fake_quant``; its
        ``deploy_weight`` transform is applied to the float weight before quantization.
        """
        if weight_quantizer is None:
            weight_quantizer = getattr(mod, "weight_fake_quant", None)
        if weight_quantizer is None:
            raise ValueError(
                f"{type(mod).__name__} has no weight_fake_quant; pass weight_quantizer= to {cls.__name__}.from_observed"
            )
        transform: Any = getattr(weight_quantizer, "deploy_weight", None)
        return cls._build(
            mod,
            qparams_from_quantizer(input_quantizer, "activation"),
            qparams_from_quantizer(weight_quantizer, "weight"),
            qparams_from_quantizer(output_quantizer, "activation"),
            rounding,
            transform if callable(transform) else None,
        )

    def _weight_repr(self) -> str:
        return ", per_channel_weight=True" if self.weight_axis is not None else ""


def integer_module_for(cls: type[nn.Module]) -> type[WeightedQuantizedModule] | None:
    """The integer layer a float, fused or QAT layer class lowers to (ReLU kept); None if there is none.

    BatchNorm-folding QAT modules have none: their BatchNorm is merged first (``merge_bn``).
    """
    if issubclass(cls, FusedModule):
        layer: type[nn.Module] = cls.PARTS[0][1][0]
        relu = any(set(accepted) & set(ACTIVATIONS) for _, accepted in cls.PARTS)
    elif getattr(cls, "_BN", None) is not None:  # a BatchNorm-folding QAT module
        return None
    else:
        layer, relu = cls, bool(getattr(cls, "ends_with_relu", False))
    for candidate in _integer_layers():
        if issubclass(layer, candidate._FLOAT_LAYER) and relu == candidate._RELU:
            return candidate
    return None


def _integer_layers() -> list[type[WeightedQuantizedModule]]:
    """Every concrete integer layer (the subclasses that name their float layer)."""
    found, stack = [], list(WeightedQuantizedModule.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "_FLOAT_LAYER" in vars(cls) or "_RELU" in vars(cls):
            found.append(cls)
    return found

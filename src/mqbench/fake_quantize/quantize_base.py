"""QuantizeBase: an observer, a scheme and a fake-quant function, with two switches."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mqbench.functional import bits_of_range, fake_quantize_for_export, from_groups, to_groups
from mqbench.observer import MinMaxObserver
from mqbench.scheme import SCALE_DTYPES, check_group_size
from mqbench.utils.factory import Factory
from mqbench.utils.state_dict import resize_to_state_dict

__all__ = ["QuantizeBase"]


def _exporting() -> bool:
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


class QuantizeBase(nn.Module):
    """Base of every fake quantizer (MQBench's ``QuantizeBase(observer, **observer_kwargs)``).

    Holds the observer as ``activation_post_process`` and two uint8 buffers of
    shape ``[1]``, ``observer_enabled`` and ``fake_quant_enabled``. In calibration
    (observer on) each forward updates the observer and the quantizer's qparams;
    with fake quant on, the output is quantized. An observer whose qparams are a
    search (``defers_qparams``: the histogram observers) is asked once, when they are
    next needed, if fake quant is off while it observes: when the observer is switched
    off or fake quant on, at the next forward that quantizes, when the state dict is
    read, or on :meth:`sync_qparams`. A batch then costs its recording only.

    Subclasses implement ``quantize(x)`` (the training/simulation forward),
    ``update_qparams()`` (pull qparams from the observer) and ``export_qparams()``
    (the fixed scale and integer zero point the quantizer is equivalent to, used
    by ONNX export, where every quantizer becomes its fixed Q/DQ form).

    The switch buffers are the source of truth; a plain Python copy of each is
    refreshed on every eager call so that ``torch.onnx.export(dynamo=True)``, which
    cannot branch on buffer values, sees the same state.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import FixedFakeQuantize
        >>> from mqbench.observer import MinMaxObserver
        >>> fq = FixedFakeQuantize(MinMaxObserver, quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> fq(torch.tensor([-1.27, 0.333])).tolist()
        [-1.2699999809265137, 0.32999998331069946]
    """

    observer_enabled: Tensor
    fake_quant_enabled: Tensor
    is_quantization_leaf = True  # traced as one call, never entered
    deploy_grid = "linear"  # "log": a logarithmic grid described by ``data_max`` (NNIE)
    deploys_activations = True  # False: qparams depend on each input, so only weights deploy

    def __init__(self, observer: Any = MinMaxObserver, **observer_kwargs: Any) -> None:
        super().__init__()
        group_size = observer_kwargs.pop("group_size", None)
        self.scale_dtype: str | None = observer_kwargs.pop("scale_dtype", None)
        if self.scale_dtype is not None:
            if self.scale_dtype not in SCALE_DTYPES:
                raise ValueError(f"scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {self.scale_dtype!r}")
            if not getattr(self, "observer_scales", False):
                raise ValueError(
                    f"{type(self).__name__} learns or computes its own scale; scale_dtype rounds the scale an observer "
                    "gives: use FixedFakeQuantize"
                )
        if observer_kwargs.pop("fp8", None) is not None:  # FP8FakeQuantize takes it as its own argument
            raise ValueError(f"{type(self).__name__} quantizes to integers; an fp8 scheme needs FP8FakeQuantize")
        self.activation_post_process = observer(**observer_kwargs)
        post = self.activation_post_process
        self.dtype = post.dtype
        self.qscheme = post.qscheme
        self.quant_min: int = post.quant_min
        self.quant_max: int = post.quant_max
        self.ch_axis: int = post.ch_axis if post.is_per_channel else -1
        self.pot_scale: bool = post.pot_scale
        # group-wise: the weight is quantized as rows of group_size input channels (mqbench.functional.to_groups)
        self.group_size: int | None = None
        if group_size is not None:
            self.group_size = check_group_size(group_size, post.is_per_channel, self.ch_axis)
            if type(self).forward is not QuantizeBase.forward or self.deploy_grid != "linear":
                raise ValueError(
                    f"{type(self).__name__} does not quantize in groups (its forward or grid is its own); use "
                    "FixedFakeQuantize or LearnableFakeQuantize with group_size"
                )
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.uint8))
        self._switches = {"observer": True, "fake_quant": True}
        self._stale_qparams = False  # the observer saw data since the qparams were last computed

    @classmethod
    def with_args(cls, **kwargs: Any) -> Factory:
        """A factory that builds this class with ``kwargs`` bound (PyTorch's observer idiom)."""
        return Factory(cls, kwargs)

    # -- identity and scheme ------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The quantizer's qualified name in its model (set by the switches in mqbench.utils.state)."""
        return self.activation_post_process.name

    @name.setter
    def name(self, value: str) -> None:
        self.activation_post_process.name = value

    @property
    def is_per_channel(self) -> bool:
        return bool(self.activation_post_process.is_per_channel)

    @property
    def symmetric(self) -> bool:
        return bool(self.activation_post_process.symmetric)

    @property
    def bitwidth(self) -> int:
        return bits_of_range(self.quant_min, self.quant_max)

    @property
    def axis(self) -> int | None:
        """The channel axis, or None per-tensor (the form the functional API takes)."""
        return self.ch_axis if self.is_per_channel else None

    # -- switches ----------------------------------------------------------------------------
    def enable_observer(self, enabled: bool = True) -> None:
        self.observer_enabled[0] = 1 if enabled else 0
        self._switches["observer"] = bool(enabled)
        if not enabled:
            self.sync_qparams()

    def disable_observer(self) -> None:
        self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> None:
        self.fake_quant_enabled[0] = 1 if enabled else 0
        self._switches["fake_quant"] = bool(enabled)
        if enabled:
            self.sync_qparams()

    def sync_qparams(self) -> None:
        """Compute the qparams from what the observer has seen, where it deferred them (a no-op otherwise)."""
        if self.__dict__.get("_stale_qparams", False):  # (a quantizer pickled before this flag has none)
            self._stale_qparams = False
            self.update_qparams()

    def disable_fake_quant(self) -> None:
        self.enable_fake_quant(False)

    def _switch(self, which: str) -> bool:
        if _exporting():
            return self._switches[which]
        buffer = self.observer_enabled if which == "observer" else self.fake_quant_enabled
        value = bool(buffer[0])
        self._switches[which] = value
        return value

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        if not x.is_floating_point():  # integer arithmetic (position ids, indices) is not quantized
            return x
        if self.group_size is not None:  # one row per group, quantized per row; back to the weight's shape
            return from_groups(self._forward(to_groups(x, self.group_size)), x.shape, self.group_size)
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        if _exporting():
            return self.export_forward(x) if self._switch("fake_quant") else x
        quantizing = self._switch("fake_quant")
        if self._switch("observer"):
            self.activation_post_process(x.detach())
            self._stale_qparams = True
            if quantizing or not getattr(self.activation_post_process, "defers_qparams", False):
                self.sync_qparams()
        if quantizing:
            self.sync_qparams()
            x = self.quantize(x)
        return x

    def quantize_folded(self, weight: Tensor, factor: Tensor) -> Tensor | None:
        """``self(weight * factor) / factor`` per output channel (axis 0) in fused passes, or None.

        BatchNorm folding in training quantizes the folded weight and divides the result back; a
        quantizer class that can do this in one pass implements ``_quantize_folded``. None where
        that would not be what calling the quantizer computes: the observer or hooks would run,
        fake quantization is off, a subclass quantizes otherwise, the model is being traced, or a
        factor is 0 (the caller then runs the separate ops).
        """
        owner = next(k for k in type(self).__mro__ if "_quantize_folded" in vars(k))
        if (
            owner is QuantizeBase
            or type(self).quantize is not owner.quantize  # type: ignore[attr-defined]
            or not self._switch("fake_quant")
            or self._switch("observer")
            or self._forward_hooks
            or self._forward_pre_hooks
            or torch.jit.is_tracing()
            or _exporting()
            or bool((factor == 0).any())
            or self.group_size is not None
        ):
            return None
        self.sync_qparams()
        return self._quantize_folded(weight, factor)

    def _quantize_folded(self, weight: Tensor, factor: Tensor) -> Tensor | None:
        """The fused form of ``quantize(weight * factor) / factor`` (see :meth:`quantize_folded`)."""
        return None

    def calculate_qparams(self) -> tuple[Tensor, Tensor]:
        return self.activation_post_process.calculate_qparams()

    def update_qparams(self) -> None:
        raise NotImplementedError

    def quantize(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def export_qparams(self) -> tuple[Tensor, Tensor]:
        """The fixed (scale, integer zero point) this quantizer is equivalent to.

        Default: its ``scale`` and rounded ``zero_point`` attributes, where a subclass holds them
        (MQBench's quantizers do, and compute their forward from them).
        """
        scale, zero_point = getattr(self, "scale", None), getattr(self, "zero_point", None)
        if isinstance(scale, Tensor) and isinstance(zero_point, Tensor):
            return scale.detach(), torch.round(zero_point.detach()).to(torch.int32)
        raise NotImplementedError(
            f"{type(self).__name__} has no scale and zero_point tensors: implement export_qparams() to say which "
            "fixed (scale, zero_point) it is equivalent to when deployed"
        )

    def export_forward(self, x: Tensor) -> Tensor:
        scale, zero_point = self.export_qparams()
        return fake_quantize_for_export(x, scale, zero_point, self.quant_min, self.quant_max, self.axis)

    def deploy_weight(self, weight: Tensor) -> Tensor:
        """The float weight the deployed linear grid quantizes (a transform such as DoReFa's; default: as is)."""
        return weight

    # -- state -------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        self.sync_qparams()  # a state dict holds the qparams of what was observed
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        resize_to_state_dict(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._switches = {"observer": bool(self.observer_enabled[0]), "fake_quant": bool(self.fake_quant_enabled[0])}
        self._stale_qparams = False  # the loaded qparams are those of the observer's loaded state

    def extra_repr(self) -> str:
        return (
            f"fake_quant_enabled={int(self.fake_quant_enabled[0])}, observer_enabled={int(self.observer_enabled[0])}, "
            f"quant_min={self.quant_min}, quant_max={self.quant_max}, qscheme={self.qscheme}, ch_axis={self.ch_axis}"
            + (f", group_size={self.group_size}" if self.group_size is not None else "")
        )

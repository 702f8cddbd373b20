"""The weight and activation quantizer factories of a prepare call: backend defaults + user overrides."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.observer import ObserverDict
from mqbench.scheme import QuantScheme
from mqbench.utils.config import check_keys
from mqbench.utils.factory import Factory

__all__ = ["QConfigPair", "eight_bit_variant", "reduced_range_variant", "resolve_qconfig", "unsigned_variant"]

_SIDES = {"w": "weight", "a": "activation"}
_KEYS = ("observer", "fakequantize", "fakeq_params", "qscheme", "observer_extra_args")
_REQUIRED = ("observer", "fakequantize", "qscheme")  # when the backend has no default quantizer
VALID_QCONFIG_KEYS = tuple(f"{side}_{key}" for side in _SIDES for key in _KEYS)


@dataclass(frozen=True)
class QConfigPair:
    """The weight and activation factories of one prepare call.

    ``reduce_range``: every weight grid is 7-bit (see :func:`reduced_range_variant`), also where
    a placement rule widens a layer to 8 bits. ``product_activation``: the factory of the inputs of a product of
    two activations (attention's queries and keys) where it is not ``activation`` (a transformer's activation
    grid, ``BackendSpec.transformer_activation``, leaves them on the backend's own).
    """

    weight: Factory
    activation: Factory | None  # None: a weight-only backend (no activation quantizers)
    weight_spec: QuantizerSpec
    activation_spec: QuantizerSpec | None
    reduce_range: bool = False
    product_activation: Factory | None = None


# Scheme keys that are observer arguments rather than grid properties (MQBench passes them on).
_OBSERVER_SCHEME_KEYS = ("p",)  # p: the Lp norm the MSE observers minimise


def _takes(observer: str | type, argument: str) -> bool:
    cls = ObserverDict.resolve(observer) if isinstance(observer, str) else observer
    constructors = [k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__]  # cooperative kwargs
    return any(argument in inspect.signature(init).parameters for init in constructors)


def _side(spec: QuantizerSpec | None, side: str, extra: Mapping[str, Any]) -> QuantizerSpec:
    given = {key: extra[f"{side}_{key}"] for key in _KEYS if f"{side}_{key}" in extra}
    observer_args = {}
    if "qscheme" in given:
        scheme = dict(given["qscheme"])
        observer_args = {key: scheme.pop(key) for key in _OBSERVER_SCHEME_KEYS if key in scheme}
        given["qscheme"] = scheme
    if spec is None:
        spec = QuantizerSpec(QuantScheme.from_dict(given["qscheme"]), given["fakequantize"], given["observer"])
    changes: dict[str, Any] = {}
    if "qscheme" in given:  # a partial scheme changes the keys it names; the backend's others stay
        changes["scheme"] = spec.scheme.updated(given["qscheme"])
    if "observer" in given:
        changes["observer"] = given["observer"]
    if "fakequantize" in given:
        changes["fake_quantize"] = given["fakequantize"]
    if "fakeq_params" in given:
        changes["fake_quantize_kwargs"] = {**spec.fake_quantize_kwargs, **given["fakeq_params"]}
    if "observer_extra_args" in given:
        changes["observer_kwargs"] = {**spec.observer_kwargs, **given["observer_extra_args"]}
    if observer_args:
        observer = changes.get("observer", spec.observer)
        for key in observer_args:
            if not _takes(observer, key):
                name = observer if isinstance(observer, str) else observer.__name__
                raise ValueError(
                    f"extra_qconfig_dict['{side}_qscheme'] key {key!r} is an argument of the observer, and {name} "
                    f"takes none; use an observer that does (MSEObserver, EMAMSEObserver) or drop {key!r}"
                )
        changes["observer_kwargs"] = {**changes.get("observer_kwargs", spec.observer_kwargs), **observer_args}
    return replace(spec, **changes)


def resolve_qconfig(
    spec: BackendSpec, extra_qconfig_dict: Mapping[str, Any] | None, reduce_range: bool = False
) -> QConfigPair:
    """Weight and activation factories for ``spec`` with ``extra_qconfig_dict`` applied.

    ``w_qscheme`` / ``a_qscheme`` merge with the backend's default scheme: the keys given
    override, the others are kept (``{"bit": 4}`` on TensorRT stays per-channel, symmetric,
    narrow: [-7, 7]). ``reduce_range`` makes the 8-bit weight grid 7-bit (see
    :func:`reduced_range_variant`). Unknown keys raise ValueError listing the valid ones; names
    of observers and fake quantizers are resolved now, so a typo fails here rather than mid-model.
    """
    extra = dict(extra_qconfig_dict or {})
    check_keys(extra, VALID_QCONFIG_KEYS, "extra_qconfig_dict")
    if spec.weight_only:
        activation_keys = [key for key in extra if key.startswith("a_")]
        if activation_keys:
            raise ValueError(
                f"backend {spec.name!r} quantizes weights only (activations stay float), so extra_qconfig_dict's "
                f"{activation_keys} have nothing to set; quantize activations on a backend that does (e.g. 'academic')"
            )
        weight_only = _side(spec.weight, "w", extra)
        try:
            factory = weight_only.factory()
        except KeyError as error:
            raise ValueError(str(error.args[0])) from None
        _check_grid(spec, "w", spec.weight, factory)
        if reduce_range:
            raise ValueError(
                f"reduce_range is for 8-bit int8 CPU kernels; backend {spec.name!r} quantizes weights only"
            )
        return QConfigPair(factory, None, weight_only, None, False)
    missing = [
        f"{side}_{key}"
        for side, default in (("w", spec.weight), ("a", spec.activation))
        if default is None
        for key in _REQUIRED
        if f"{side}_{key}" not in extra
    ]
    if missing:  # every missing key at once, weight and activation
        raise ValueError(
            f"backend {spec.name!r} takes its quantizers from prepare_custom_config_dict['extra_qconfig_dict']; "
            f"missing keys: {', '.join(missing)}"
        )
    weight = _side(spec.weight, "w", extra)
    activation = _side(spec.activation, "a", extra)
    try:
        weight_factory, activation_factory = weight.factory(), activation.factory()
    except KeyError as error:
        raise ValueError(str(error.args[0])) from None
    for side, default, chosen in (("w", spec.weight, weight_factory), ("a", spec.activation, activation_factory)):
        _check_grid(spec, side, default, chosen)
    if reduce_range:
        given = extra.get("w_qscheme") or {}
        if "bit" in given or "bits" in given:
            raise ValueError(
                "reduce_range sets the weight width (7 bits) and cannot be combined with "
                f"extra_qconfig_dict['w_qscheme'] bit={given.get('bit', given.get('bits'))}; give one of the two"
            )
        grid = getattr(weight_factory.cls, "deploy_grid", "linear")
        if grid != "linear":
            raise ValueError(
                f"reduce_range needs a linear 8-bit weight grid; backend {spec.name!r} quantizes weights with "
                f"{weight_factory.cls.__name__} on a {grid} grid"
            )
        weight_factory = reduced_range_variant(weight_factory, spec.name)
    return QConfigPair(weight_factory, activation_factory, weight, activation, reduce_range)


def _check_grid(spec: BackendSpec, side: str, default: QuantizerSpec | None, chosen: Factory) -> None:
    """A backend whose format holds one kind of grid (NNIE's log grid) takes only quantizers of that grid."""
    if default is None:
        return
    expected = getattr(default.factory().cls, "deploy_grid", "linear")
    got = getattr(chosen.cls, "deploy_grid", "linear")
    if expected != got:
        raise ValueError(
            f"backend {spec.name!r} deploys {_SIDES[side]}s on its {expected!r} grid, but "
            f"extra_qconfig_dict['{side}_fakequantize'] = {chosen.cls.__name__} quantizes on a {got!r} grid; "
            f"use a quantizer of the {expected!r} grid ({default.factory().cls.__name__})"
        )


def reduced_range_variant(factory: Factory, backend: str = "") -> Factory:
    """The 8-bit grid of ``factory`` on 7 bits of the same signedness: [-64, 63] or [0, 127].

    For int8 CPU kernels without VNNI, which sum two u8 x s8 products in a saturating 16-bit
    register: with weights within [-64, 64], 2 * 255 * 64 = 32640 fits. Raises ValueError for a
    grid that is not 8-bit.
    """
    low, high = factory.kwargs.get("quant_min"), factory.kwargs.get("quant_max")
    if low is None or high is None or not 255 <= high - low + 1 <= 256:
        owner = f"backend {backend!r}'s" if backend else "the"
        grid = "no fixed integer range" if low is None or high is None else f"[{low}, {high}]"
        raise ValueError(f"reduce_range makes 8-bit weights 7-bit, but {owner} weight grid is {grid}")
    return factory.with_args(**({"quant_min": -64, "quant_max": 63} if low < 0 else {"quant_min": 0, "quant_max": 127}))


def unsigned_variant(factory: Factory) -> Factory:
    """The same quantizer on an unsigned grid of equal width (inputs known to be non-negative)."""
    low, high = factory.kwargs.get("quant_min"), factory.kwargs.get("quant_max")
    if low is None or high is None or low >= 0:
        return factory
    return factory.with_args(quant_min=0, quant_max=high - low)


def eight_bit_variant(factory: Factory) -> Factory:
    """The same quantizer with an 8-bit grid of the same signedness (first and last layers)."""
    low = factory.kwargs.get("quant_min")
    if low is None:
        return factory
    return factory.with_args(
        **({"quant_min": -128, "quant_max": 127} if low < 0 else {"quant_min": 0, "quant_max": 255})
    )

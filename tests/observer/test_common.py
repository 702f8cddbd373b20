"""Properties every built-in observer has, checked for all 15 of them.

Observer-specific references (formulas, brute-force searches) live in the per-family files; what is here
must hold for any observer: per-channel statistics equal per-slice ones on any axis, constant input gives
a usable grid, bad input is rejected with a useful message, and state survives a weights-only reload.
"""

from __future__ import annotations

import copy
import io
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqbench.observer import (
    AffineHistogramObserver,
    ClipStdObserver,
    EMAMinMaxObserver,
    EMAMSEObserver,
    EMAQuantileObserver,
    HistogramObserver,
    KLDObserver,
    LSQObserver,
    LSQPlusObserver,
    MeanMinMaxObserver,
    MinMaxFloorObserver,
    MinMaxObserver,
    MSEObserver,
    ObserverBase,
    ObserverDict,
    PercentileObserver,
    PoTModeObserver,
)
from observer_helpers import assert_same_state, batches, check_per_channel_matches_slices, observe

_CHANNEL_CHANGE = r"recorded statistics of shape \[{before}\].*shape \[{after}\] along ch_axis={axis}"
_HISTOGRAM_CHANNEL_CHANGE = r"saw {after} channels after {before}"


@dataclass(frozen=True)
class Spec:
    """What the generic tests need to know about one observer."""

    cls: type[ObserverBase]
    rtol: float = 1e-6  # per-channel scale against per-slice scale
    histogram: bool = False  # takes ``bins``
    channel_change: str = _CHANNEL_CHANGE  # the message when the channel count changes
    constant_exact: bool = True  # a per-tensor affine grid hits a constant input exactly
    # the per-tensor observer a per-channel one equals on each channel's slice (None: the same class); a mean
    # over samples per tensor keeps each channel's extremes per channel
    slice_reference: type[ObserverBase] | None = None

    def make(self, bins: int | None = None, **kwargs):
        """The observer with ``kwargs``; ``bins`` goes to histogram observers only."""
        if self.histogram and bins is not None:
            kwargs["bins"] = bins
        return self.cls(**kwargs)


# Statistics accumulated in float64 (moments, quantiles) and the MSE search agree per channel to 1e-5 only.
# LSQ's scale comes from mean |x|, not from the range, and the histogram observers' grid is symmetric in |x|
# for mixed or negative data: neither puts a constant input exactly on the grid.
_SPECS = [
    Spec(MinMaxObserver),
    Spec(EMAMinMaxObserver),
    Spec(MeanMinMaxObserver, slice_reference=MinMaxObserver),
    Spec(MinMaxFloorObserver),
    Spec(PoTModeObserver),
    Spec(EMAQuantileObserver, rtol=1e-5),
    Spec(ClipStdObserver, rtol=1e-5),
    Spec(LSQObserver, rtol=1e-5, constant_exact=False),
    Spec(LSQPlusObserver, rtol=1e-5),
    Spec(MSEObserver, rtol=1e-5),
    Spec(
        EMAMSEObserver,
        rtol=1e-5,
    ),
    Spec(HistogramObserver, histogram=True, channel_change=_HISTOGRAM_CHANNEL_CHANGE, constant_exact=False),
    Spec(KLDObserver, histogram=True, channel_change=_HISTOGRAM_CHANNEL_CHANGE, constant_exact=False),
    Spec(PercentileObserver, histogram=True, channel_change=_HISTOGRAM_CHANNEL_CHANGE, constant_exact=False),
    Spec(
        AffineHistogramObserver,
        rtol=1e-5,
        histogram=True,
        channel_change=_HISTOGRAM_CHANNEL_CHANGE,
        constant_exact=False,
    ),
]
SPECS = {spec.cls.__name__: spec for spec in _SPECS}
each_observer = pytest.mark.parametrize("spec", _SPECS, ids=list(SPECS))


def test_every_builtin_observer_is_covered_and_registered() -> None:
    builtin = {name for name, cls in ObserverDict.items() if cls.__module__.startswith("mqbench.observer.")}
    assert builtin == set(SPECS)
    for name, spec in SPECS.items():
        assert ObserverDict[name] is spec.cls


# -- per-channel ------------------------------------------------------------------------------------


def _scaled_mixed_sign() -> list[torch.Tensor]:
    data = [x * torch.arange(1, 5).view(1, 4, 1) for x in batches(6, (3, 4, 60), 3)]
    data[1][0, 0] = data[1][0, 0].abs()  # one channel is non-negative in this batch only
    return data


# name: (data, quant_min, quant_max); histogram observers use 128 bins.
PER_CHANNEL_CASES = {
    "few-values-8bit": (lambda: batches(5, (3, 4, 5), 3), -128, 127),
    "gauss40-8bit": (lambda: batches(8, (3, 4, 40), 3), -128, 127),
    "gauss50-8bit": (lambda: batches(7, (3, 4, 50), 3), -128, 127),
    "scaled-mixed-sign-4bit": (_scaled_mixed_sign, -8, 7),
}


@each_observer
@pytest.mark.parametrize("case", list(PER_CHANNEL_CASES))
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("qscheme", [torch.per_channel_symmetric, torch.per_channel_affine], ids=["sym", "affine"])
def test_per_channel_equals_per_slice(spec: Spec, case: str, axis: int, qscheme) -> None:
    data, qmin, qmax = PER_CHANNEL_CASES[case]

    def make(**kw):
        return spec.make(quant_min=qmin, quant_max=qmax, bins=128, **kw)

    def make_single(**kw):
        return spec.slice_reference(quant_min=qmin, quant_max=qmax, **kw) if spec.slice_reference else make(**kw)

    check_per_channel_matches_slices(make, data(), axis, qscheme, rtol=spec.rtol, make_single=make_single)


# (quant_min, quant_max, qscheme): 4-bit unsigned both ways, 8-bit unsigned affine, 4-bit signed symmetric.
PROPERTY_GRIDS = [
    (0, 15, torch.per_channel_symmetric),
    (0, 15, torch.per_channel_affine),
    (0, 255, torch.per_channel_affine),
    (-8, 7, torch.per_channel_symmetric),
]


@each_observer
@pytest.mark.parametrize(
    ("qmin", "qmax", "qscheme"), PROPERTY_GRIDS, ids=["u4-sym", "u4-affine", "u8-affine", "s4-sym"]
)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    axis_choice=st.integers(0, 10),
    seed=st.integers(0, 2**16),
    relu=st.booleans(),
)
@settings(max_examples=10, deadline=None)
def test_per_channel_property(
    spec: Spec, qmin: int, qmax: int, qscheme, shape: list[int], axis_choice: int, seed: int, relu: bool
) -> None:
    axis = axis_choice % len(shape) - (len(shape) if axis_choice % 2 else 0)
    data = batches(seed, tuple(shape), 2)
    if relu:
        data = [x.relu() for x in data]

    def make(**kw):
        return spec.make(quant_min=qmin, quant_max=qmax, bins=64, **kw)

    def make_single(**kw):
        return spec.slice_reference(quant_min=qmin, quant_max=qmax, **kw) if spec.slice_reference else make(**kw)

    check_per_channel_matches_slices(make, data, axis, qscheme, rtol=spec.rtol, make_single=make_single)


@each_observer
def test_memory_is_constant_across_batches(spec: Spec) -> None:
    obs = spec.make(qscheme=torch.per_channel_affine, ch_axis=0)
    sizes = []
    for x in batches(9, (4, 30), 6):
        obs(x)
        sizes.append(sum(b.numel() for b in obs.buffers()))
    assert len(set(sizes)) == 1


@pytest.mark.parametrize("spec", [pytest.param(spec, id=name) for name, spec in SPECS.items()])
@pytest.mark.parametrize(("axis", "before", "after"), [(1, (2, 4, 3), (2, 5, 3)), (0, (4, 4), (5, 4))])
def test_channel_count_change_is_an_error_not_a_reset(spec: Spec, axis: int, before, after) -> None:
    obs = spec.make(quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=axis)
    obs(torch.randn(before))
    message = spec.channel_change.format(before=before[axis], after=after[axis], axis=axis)
    with pytest.raises(ValueError, match=message):
        obs(torch.randn(after))


@each_observer
@pytest.mark.parametrize("ch_axis", [2, 3, 5, -3])
def test_out_of_range_ch_axis_raises(spec: Spec, ch_axis: int) -> None:
    obs = spec.make(qscheme=torch.per_channel_symmetric, ch_axis=ch_axis)
    with pytest.raises(ValueError, match="ch_axis"):
        obs(torch.randn(2, 3))


# -- edge cases -------------------------------------------------------------------------------------


@each_observer
def test_uncalibrated_defaults_then_calibrated(spec: Spec) -> None:
    obs = spec.make()
    assert not obs.calibrated
    scale, zero_point = obs.calculate_qparams()
    assert scale.tolist() == [1.0] and zero_point.tolist() == [0]
    obs(torch.randn(3))
    assert obs.calibrated
    assert int(obs.num_batches) == 1


@each_observer
@pytest.mark.parametrize(("value", "word"), [(math.nan, "NaN"), (math.inf, "infinite"), (-math.inf, "infinite")])
@pytest.mark.parametrize("after_good_batch", [False, True], ids=["first-batch", "later-batch"])
def test_non_finite_input_raises_and_leaves_no_trace(spec: Spec, value: float, word: str, after_good_batch: bool):
    obs = spec.make()
    obs.name = "layer1.act"
    if after_good_batch:
        obs(torch.ones(3))
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    with pytest.raises(ValueError, match=word) as info:
        obs(torch.tensor([1.0, value, 2.0]))
    assert "layer1.act" in str(info.value)
    assert_same_state(obs.state_dict(), before)  # the bad batch left no trace


@each_observer
@pytest.mark.parametrize("value", [0.0, 3.5, -2.0, 1e-30, 1e30])
@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_channel_symmetric], ids=["pt-affine", "pc-sym"])
@pytest.mark.parametrize("repeats", [1, 2])
def test_constant_input_gives_finite_positive_scale(spec: Spec, value: float, qscheme, repeats: int) -> None:
    obs = spec.make(quant_min=-128, quant_max=127, qscheme=qscheme, ch_axis=0, bins=256)
    x = torch.full((3, 8), value)
    observe(obs, [x] * repeats)
    scale, zero_point = obs.calculate_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert ((zero_point >= -128) & (zero_point <= 127)).all()
    if spec.constant_exact and qscheme == torch.per_tensor_affine and abs(value) in (0.0, 2.0, 3.5):
        # An affine grid represents a constant exactly (1e-30 falls below eps, 1e30 is not on the grid).
        fq = torch.clamp(torch.round(x / scale[:, None]) + zero_point[:, None], -128, 127) - zero_point[:, None]
        torch.testing.assert_close(fq * scale[:, None], x, rtol=1e-6, atol=0)


# -- state ------------------------------------------------------------------------------------------

# name: (qscheme, quant range, data seed, data shape)
STATE_CASES = {
    "s8-pt-sym": (torch.per_tensor_symmetric, {"quant_min": -128, "quant_max": 127}, 6, (4, 16)),
    "s8-pc-sym": (torch.per_channel_symmetric, {"quant_min": -128, "quant_max": 127}, 6, (4, 16)),
    "default-pt-affine": (torch.per_tensor_affine, {}, 10, (4, 16)),
    "default-pc-sym": (torch.per_channel_symmetric, {}, 10, (4, 16)),
    "default-pt-affine-wide": (torch.per_tensor_affine, {}, 7, (4, 300)),
    "default-pc-sym-wide": (torch.per_channel_symmetric, {}, 7, (4, 300)),
}


@each_observer
@pytest.mark.parametrize("case", list(STATE_CASES))
def test_state_dict_round_trip(spec: Spec, case: str) -> None:
    qscheme, quant_range, seed, shape = STATE_CASES[case]

    def make():
        return spec.make(qscheme=qscheme, ch_axis=0, bins=512, **quant_range)

    obs = observe(make(), batches(seed, shape, 3))
    buffer = io.BytesIO()
    torch.save(obs.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    extra = batches(seed + 1, shape, 1)[0]
    # Loading restores the running statistics too: a further batch inside the range, or one growing it
    # (the histograms re-bin), leaves the original and the reloaded observer equal.
    for x in (extra, extra * 10):
        original, fresh = copy.deepcopy(obs), make()
        fresh.load_state_dict(state)
        for a, b in zip(original.calculate_qparams(), fresh.calculate_qparams(), strict=True):
            assert torch.equal(a, b)
        original(x)
        fresh(x)
        assert_same_state(original.state_dict(), fresh.state_dict())
        for a, b in zip(original.calculate_qparams(), fresh.calculate_qparams(), strict=True):
            assert torch.equal(a, b)

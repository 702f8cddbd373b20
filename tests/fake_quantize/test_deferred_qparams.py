"""Histogram observers' qparams are searched once, when calibration ends, with the same result as after every batch.

The reference is the same quantizer calibrated while quantizing (fake quant on), which computes its qparams after
every batch; a histogram's statistics do not depend on the batch order, so the last of those is the grid of all
the data.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mqbench.fake_quantize import FixedFakeQuantize, LearnableFakeQuantize
from mqbench.observer import AffineHistogramObserver, HistogramObserver, MinMaxObserver, PercentileObserver
from mqbench.utils.state import sync_qparams

OBSERVERS = [AffineHistogramObserver, HistogramObserver, PercentileObserver]


def batches() -> list[torch.Tensor]:
    torch.manual_seed(3)
    return [torch.nn.functional.gelu(torch.randn(2000) * s) for s in (1.0, 3.0, 0.5, 2.0)]


def counting(quantizer: nn.Module) -> list[int]:
    """Counts the observer's searches (calls of calculate_qparams) in the returned one-element list."""
    calls = [0]
    observer = quantizer.activation_post_process
    search = observer.calculate_qparams

    def counted() -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return search()

    observer.calculate_qparams = counted
    return calls


def make(observer: type, cls: type = FixedFakeQuantize) -> nn.Module:
    return cls(observer, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine)


def reference(observer: type, cls: type = FixedFakeQuantize) -> nn.Module:
    quantizer = make(observer, cls)  # observer and fake quant on: qparams after every batch
    for x in batches():
        quantizer(x)
    return quantizer


@pytest.mark.parametrize("cls", [FixedFakeQuantize, LearnableFakeQuantize])
@pytest.mark.parametrize("observer", OBSERVERS)
def test_calibrating_without_quantizing_searches_once_when_fake_quant_goes_on(observer, cls):
    quantizer = make(observer, cls)
    quantizer.disable_fake_quant()
    calls = counting(quantizer)
    for x in batches():
        assert torch.equal(quantizer(x), x)  # fake quant off: the float values
    assert calls[0] == 0
    quantizer.enable_fake_quant()
    assert calls[0] == 1
    want = reference(observer, cls)
    assert float(want.scale.detach()) != 1.0  # calibrated
    torch.testing.assert_close(quantizer.scale.detach(), want.scale.detach(), rtol=0, atol=0)
    torch.testing.assert_close(quantizer.zero_point.detach(), want.zero_point.detach(), rtol=0, atol=0)
    x = batches()[1]
    torch.testing.assert_close(quantizer(x), want(x), rtol=0, atol=0)
    assert calls[0] == 2  # observer still on, quantizing: every batch again


@pytest.mark.parametrize(
    "finish",
    [
        lambda q: q.disable_observer(),
        lambda q: q.state_dict(),
        lambda q: sync_qparams(nn.Sequential(q)),
        # the switch buffers set directly (as a loaded state does): the next forward that quantizes
        lambda q: (q.observer_enabled.fill_(0), q.fake_quant_enabled.fill_(1), q(torch.zeros(3))),
    ],
    ids=["observer-off", "state-dict", "sync_qparams", "next-quantizing-forward"],
)
def test_every_way_calibration_ends_gives_the_qparams_of_all_the_data(finish):
    quantizer = make(AffineHistogramObserver)
    quantizer.disable_fake_quant()
    for x in batches():
        quantizer(x)
    finish(quantizer)
    want = reference(AffineHistogramObserver)
    assert torch.equal(quantizer.scale, want.scale) and torch.equal(quantizer.zero_point, want.zero_point)


def test_a_state_dict_read_while_calibrating_holds_the_searched_grid_and_loads_as_such():
    quantizer = make(AffineHistogramObserver)
    quantizer.disable_fake_quant()
    for x in batches():
        quantizer(x)
    state = quantizer.state_dict()
    want = reference(AffineHistogramObserver)
    assert torch.equal(state["scale"], want.scale)
    loaded = make(AffineHistogramObserver)
    loaded.load_state_dict(state)
    calls = counting(loaded)
    loaded.disable_observer()  # loaded: nothing to search
    assert calls[0] == 0
    assert torch.equal(loaded.scale, want.scale)


def test_a_min_max_observer_still_updates_after_every_batch():
    quantizer = make(MinMaxObserver)
    quantizer.disable_fake_quant()
    seen = torch.tensor([])
    for x in batches():
        quantizer(x)
        seen = torch.cat([seen, x])
        lo, hi = min(float(seen.min()), 0.0), max(float(seen.max()), 0.0)
        assert float(quantizer.scale) == pytest.approx((hi - lo) / 255, rel=1e-6)

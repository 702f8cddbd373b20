import pytest
import torch

from mqbench.observer import EMAMinMaxObserver, MinMaxObserver, PoTModeObserver


@pytest.mark.parametrize("cls", [MinMaxObserver, EMAMinMaxObserver, PoTModeObserver])
def test_channel_count_change_is_an_error_not_a_reset(cls):
    observer = cls(quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=1)
    observer(torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match=r"recorded statistics of shape \[4\].*shape \[5\] along ch_axis=1"):
        observer(torch.randn(2, 5, 3))


def test_uncalibrated_observer_reports_it():
    observer = MinMaxObserver()
    assert not observer.calibrated
    observer(torch.randn(3))
    assert observer.calibrated
    assert int(observer.num_batches) == 1

"""Test helpers shared by the observer tests: batches of data, observing them, and the per-channel check."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

EPS = float(torch.finfo(torch.float32).eps)
PER_TENSOR = {
    torch.per_channel_affine: torch.per_tensor_affine,
    torch.per_channel_symmetric: torch.per_tensor_symmetric,
}


def batches(seed: int, shape: tuple[int, ...], count: int = 3) -> list[torch.Tensor]:
    """``count`` Gaussian batches, each wider and further from zero than the last."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * (1 + i) + 0.3 * i for i in range(count)]


def observe(obs, data: Iterable[torch.Tensor]):
    """Feed every batch to ``obs`` and return it."""
    for x in data:
        obs(x)
    return obs


def np_fake_quant(x: np.ndarray, scale: float, zero_point: int, qmin: int, qmax: int) -> np.ndarray:
    """Fake quantization written independently of mqbench.functional."""
    return (np.clip(np.round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale


def check_per_channel_matches_slices(
    make: Callable[..., torch.nn.Module],
    batch_list: list[torch.Tensor],
    axis: int,
    qscheme,
    rtol: float = 1e-6,
    make_single: Callable[..., torch.nn.Module] | None = None,
) -> None:
    """A per-channel observer on ``axis`` gives, channel by channel, the qparams of a per-tensor one on that slice
    (made by ``make_single``, default ``make``)."""
    make_single = make_single or make
    per_channel = observe(make(qscheme=qscheme, ch_axis=axis), batch_list)
    scale, zero_point = per_channel.calculate_qparams()
    channels = batch_list[0].shape[axis]
    assert scale.shape == (channels,) and zero_point.shape == (channels,)
    for c in range(channels):
        single = observe(make_single(qscheme=PER_TENSOR[qscheme]), [x.select(axis, c) for x in batch_list])
        s, z = single.calculate_qparams()
        assert s.shape == (1,)
        torch.testing.assert_close(scale[c : c + 1], s, rtol=rtol, atol=0)
        torch.testing.assert_close(zero_point[c : c + 1], z, rtol=0, atol=0)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two state dicts hold the same buffers, bit for bit."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

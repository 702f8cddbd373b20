"""AWQ's two searches against brute force written here, on a model against rounding to nearest, and deployed."""

from __future__ import annotations

import onnx
import pytest
import torch
from torch import Tensor, nn

from mqbench.advanced_ptq import awq
from mqbench.advanced_ptq.smoothing import ChannelScale
from mqbench.advanced_ptq.weight_only import calibrate_weights
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_quantization

GROUP = 16
GRID = 10
RATIOS = [1.0 - i * 0.5 / 10 for i in range(11)]


def _rtn(w: Tensor, low: Tensor | None = None, high: Tensor | None = None) -> Tensor:
    """Symmetric 4-bit groups of 16 on [-8, 7], scale max(|min|, |max|) / 7.5 of each group (of [low, high] when
    given per (row, group))."""
    out = torch.empty_like(w)
    for g in range(w.shape[1] // GROUP):
        block = w[:, g * GROUP : (g + 1) * GROUP]
        lo = block.amin(1).clamp(max=0) if low is None else low[:, g]
        hi = block.amax(1).clamp(min=0) if high is None else high[:, g]
        scale = (torch.maximum(-lo, hi) / 7.5)[:, None]
        out[:, g * GROUP : (g + 1) * GROUP] = torch.clamp(torch.round(block / scale), -8, 7) * scale
    return out


def _inputs(seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    spread = torch.ones(64)
    spread[[3, 17, 40]] = 20.0  # salient channels
    return [torch.randn(32, 64, generator=generator) * spread for _ in range(4)]


def _prepared(model: nn.Module) -> nn.Module:
    return prepare_by_platform(model, "llm_w4a16", {"extra_qconfig_dict": {"w_qscheme": {"group_size": GROUP}}})


def test_the_scale_and_clip_searches_are_their_brute_force():
    torch.manual_seed(0)
    layer = nn.Linear(64, 24, bias=False).eval()
    weight = layer.weight.detach().clone()
    data = _inputs(1)
    x = torch.cat(data)
    qmodel = awq(_prepared(nn.Sequential(layer)), data, {"grid": GRID, "clip_grid": 10, "sample_rows": 10_000})
    # alpha: the least output error of rounding W * s, with s = mean|x| ** alpha normalised
    mean = x.abs().mean(0)
    errors = []
    for alpha in [i / GRID for i in range(GRID)]:
        s = mean.clamp(min=1e-4) ** alpha
        s = s / torch.sqrt(s.max() * s.min())
        errors.append(float((((x / s) @ _rtn(weight * s).T - x @ weight.T) ** 2).sum()) / x.shape[0])
    best = min(range(GRID), key=lambda i: errors[i])
    site = qmodel.meta["awq"]["sites"]["0"]
    assert site["alpha"] == best / GRID and best > 0  # the salient channels make scaling pay
    assert site["error"] == pytest.approx(errors[best], rel=1e-4)
    s = mean.clamp(min=1e-4) ** site["alpha"]
    s = s / torch.sqrt(s.max() * s.min())
    scaled = weight * s
    torch.testing.assert_close(qmodel.get_submodule("0").weight.detach(), scaled)
    scales = [m for m in qmodel.modules() if isinstance(m, ChannelScale)]
    assert len(scales) == 1
    torch.testing.assert_close(scales[0].scale, 1 / s)
    # clip: per (row, group) the ratio whose shrunk range gives the least error of that group's output share
    xs = x / s
    groups = 64 // GROUP
    expected = torch.ones(24, groups)
    for g in range(groups):
        block = scaled[:, g * GROUP : (g + 1) * GROUP]
        cols = xs[:, g * GROUP : (g + 1) * GROUP]
        per_ratio = []
        for r in RATIOS:
            low = (block.amin(1).clamp(max=0) * r)[:, None].expand(-1, groups)
            high = (block.amax(1).clamp(min=0) * r)[:, None].expand(-1, groups)
            q = _rtn(scaled, low, high)[:, g * GROUP : (g + 1) * GROUP]
            per_ratio.append(((cols @ (q - block).T) ** 2).sum(0))
        stacked = torch.stack(per_ratio)  # [ratios, rows]
        expected[:, g] = torch.tensor(RATIOS)[stacked.argmin(0)]
    chosen = qmodel.meta["awq"]["clip"]["0"]
    # all equal here; a host's float32 summation order may decide a near-tie between two ratios the other way
    assert (chosen == expected).float().mean() >= 0.99, (chosen != expected).nonzero()
    assert (chosen < 1).any()


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 128)
        self.gate = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return x + self.down(torch.relu(self.up(h)) * self.gate(h))


def test_awq_beats_rounding_to_nearest_on_held_out_data_and_deploys(tmp_path):
    torch.manual_seed(0)
    model = Mlp().eval()
    with torch.no_grad():  # salient channels after the norm, as in transformers
        model.norm.weight.mul_(torch.where(torch.arange(64) % 13 == 0, 15.0, 1.0))
    rtn = _prepared(model)
    calibrate_weights(rtn)
    qmodel = awq(_prepared(model), _inputs(3))
    report = qmodel.meta["awq"]["sites"]
    assert set(report) == {"up", "down"} and report["up"]["layers"] == ["up", "gate"]
    assert all(site["error"] <= site["error_unscaled"] for site in report.values())
    enable_quantization(rtn)
    enable_quantization(qmodel)
    held_out = torch.cat(_inputs(4))
    with torch.no_grad():
        reference = model(held_out)
        errors = {name: float(((m(held_out) - reference) ** 2).mean()) for name, m in (("rtn", rtn), ("awq", qmodel))}
    assert errors["awq"] < 0.9 * errors["rtn"], errors  # measured 0.74
    result = convert_deploy(qmodel, "llm_w4a16", dummy_input=held_out[:4], output_path=str(tmp_path), model_name="m")
    assert verify_deploy(qmodel, result, held_out[:4]).passed
    ops = [n.op_type for n in onnx.load(result.artifacts["matmulnbits_onnx"]).graph.node]
    assert ops.count("MatMulNBits") == 3 and "Mul" in ops  # the input scale is a Mul before up and gate


def test_awq_config_errors_name_the_valid_keys():
    qmodel = _prepared(Mlp().eval())
    with pytest.raises(ValueError, match="unknown awq config key 'alpha'; valid keys: grid, clip"):
        awq(qmodel, _inputs(0), {"alpha": 0.5})
    with pytest.raises(ValueError, match="max_shrink must be in"):
        awq(qmodel, _inputs(0), {"max_shrink": 0})

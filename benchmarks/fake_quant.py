"""Forward+backward time of every fake quantizer against PyTorch's native kernels, in one run.

Shapes: a [16, 64, 56, 56] activation (per-tensor) and a [256, 256, 3, 3] weight
(per-channel, axis 0). Targets: Fixed and LSQ within 1.1x of the native kernels;
PACT, DSQ, DoReFa and TQT within 3x of Fixed; MSE observer per-channel search on
the weight under 200 ms. Prints a table and writes benchmarks/results/fake_quant.json.

Run: .venv/bin/python benchmarks/fake_quant.py [--repeats N]
"""

from __future__ import annotations

import argparse

import torch

from _timing import print_table, time_interleaved, write_json
from mqbench.fake_quantize import (
    DoReFaFakeQuantize,
    DSQFakeQuantize,
    FixedFakeQuantize,
    LearnableFakeQuantize,
    NNIEFakeQuantize,
    PACTFakeQuantize,
    QuantizeBase,
    TqtFakeQuantize,
)
from mqbench.observer import MinMaxObserver, MSEObserver
from mqbench.utils.memory import keep_freed_memory

ACTIVATION = dict(quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric)
WEIGHT = dict(quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0)


def step(module: torch.nn.Module | None, function, x: torch.Tensor, grad: torch.Tensor):
    def run() -> None:
        x.grad = None
        if module is not None:
            module.zero_grad(set_to_none=True)
        function(x).backward(grad)

    return run


def calibrated(cls: type[QuantizeBase], x: torch.Tensor, **kwargs) -> QuantizeBase:
    quantizer = cls(MinMaxObserver, **kwargs)
    quantizer.disable_fake_quant()
    quantizer(x.detach())
    quantizer.disable_observer()
    quantizer.enable_fake_quant()
    return quantizer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    keep_freed_memory()

    act = torch.randn(16, 64, 56, 56).requires_grad_()
    act_grad = torch.randn_like(act)
    weight = (torch.randn(256, 256, 3, 3) * torch.rand(256, 1, 1, 1)).requires_grad_()
    weight_grad = torch.randn_like(weight)

    fixed_act = calibrated(FixedFakeQuantize, act, **ACTIVATION)
    fixed_weight = calibrated(FixedFakeQuantize, weight, **WEIGHT)
    lsq_act = calibrated(LearnableFakeQuantize, act, **ACTIVATION)
    lsq_weight = calibrated(LearnableFakeQuantize, weight, **WEIGHT)
    pact = calibrated(PACTFakeQuantize, act, **ACTIVATION)
    dsq = calibrated(DSQFakeQuantize, act, **ACTIVATION)
    tqt = calibrated(TqtFakeQuantize, act, **ACTIVATION)
    nnie = calibrated(NNIEFakeQuantize, act, **ACTIVATION)
    dorefa = calibrated(DoReFaFakeQuantize, weight, **WEIGHT)

    # native PyTorch kernels with the same qparams
    act_scale, act_zero = fixed_act.scale.clone(), fixed_act.zero_point.clone()
    w_scale, w_zero = fixed_weight.scale.clone(), fixed_weight.zero_point.clone()
    lsq_scale = act_scale.clone().requires_grad_()
    lsq_zero = act_zero.float().requires_grad_()
    lsq_w_scale = w_scale.clone().requires_grad_()
    lsq_w_zero = w_zero.float().requires_grad_()

    def native_lsq_act(x):
        return torch._fake_quantize_learnable_per_tensor_affine(x, lsq_scale, lsq_zero, -128, 127, 1.0)

    def native_lsq_weight(x):
        return torch._fake_quantize_learnable_per_channel_affine(x, lsq_w_scale, lsq_w_zero, 0, -128, 127, 1.0)

    activation_cases = {
        "native per-tensor": step(
            None, lambda x: torch.fake_quantize_per_tensor_affine(x, act_scale, act_zero, -128, 127), act, act_grad
        ),
        "native learnable per-tensor": step(None, native_lsq_act, act, act_grad),
        "FixedFakeQuantize": step(fixed_act, fixed_act, act, act_grad),
        "LearnableFakeQuantize": step(lsq_act, lsq_act, act, act_grad),
        "PACTFakeQuantize": step(pact, pact, act, act_grad),
        "DSQFakeQuantize": step(dsq, dsq, act, act_grad),
        "TqtFakeQuantize": step(tqt, tqt, act, act_grad),
        "NNIEFakeQuantize": step(nnie, nnie, act, act_grad),
    }
    weight_cases = {
        "native per-channel": step(
            None,
            lambda x: torch.fake_quantize_per_channel_affine(x, w_scale, w_zero, 0, -128, 127),
            weight,
            weight_grad,
        ),
        "native learnable per-channel": step(None, native_lsq_weight, weight, weight_grad),
        "FixedFakeQuantize": step(fixed_weight, fixed_weight, weight, weight_grad),
        "LearnableFakeQuantize": step(lsq_weight, lsq_weight, weight, weight_grad),
        "DoReFaFakeQuantize": step(dorefa, dorefa, weight, weight_grad),
    }
    act_times = time_interleaved(activation_cases, args.repeats)
    weight_times = time_interleaved(weight_cases, args.repeats)

    mse = MSEObserver(**WEIGHT)
    mse_times = time_interleaved({"mse": lambda: mse(weight.detach())}, max(5, args.repeats // 2), warmup=1)

    targets = {
        ("activation", "FixedFakeQuantize"): ("native per-tensor", 1.1),
        ("activation", "LearnableFakeQuantize"): ("native learnable per-tensor", 1.1),
        ("weight", "FixedFakeQuantize"): ("native per-channel", 1.1),
        ("weight", "LearnableFakeQuantize"): ("native learnable per-channel", 1.1),
        ("activation", "PACTFakeQuantize"): ("FixedFakeQuantize", 3.0),
        ("activation", "DSQFakeQuantize"): ("FixedFakeQuantize", 3.0),
        ("activation", "TqtFakeQuantize"): ("FixedFakeQuantize", 3.0),
        ("activation", "NNIEFakeQuantize"): ("FixedFakeQuantize", None),
        ("weight", "DoReFaFakeQuantize"): ("FixedFakeQuantize", 3.0),
    }
    rows, records = [], []
    for (tensor, name), (baseline, target) in targets.items():
        times = act_times if tensor == "activation" else weight_times
        ratio = times[name] / times[baseline]
        ok = "n/a" if target is None else ("yes" if ratio <= target else "NO")
        rows.append(
            [
                tensor,
                name,
                f"{times[name] * 1e3:.2f}",
                baseline,
                f"{times[baseline] * 1e3:.2f}",
                f"{ratio:.2f}x",
                "-" if target is None else f"<= {target}x",
                ok,
            ]
        )
        records.append(
            {
                "tensor": tensor,
                "quantizer": name,
                "ms": times[name] * 1e3,
                "baseline": baseline,
                "baseline_ms": times[baseline] * 1e3,
                "ratio": ratio,
                "target": target,
                "met": None if target is None else ratio <= target,
            }
        )
    print_table(["tensor", "quantizer", "ms", "baseline", "baseline ms", "ratio", "target", "met"], rows)
    mse_ms = mse_times["mse"] * 1e3
    verdict = "yes" if mse_ms < 200 else "NO"
    print(f"\nMSEObserver per-channel search on [256, 256, 3, 3]: {mse_ms:.1f} ms (target < 200 ms: {verdict})")
    path = write_json(
        "fake_quant",
        {
            "shapes": {"activation": list(act.shape), "weight": list(weight.shape)},
            "repeats": args.repeats,
            "fake_quantizers": records,
            "mse_observer_ms": mse_ms,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""DoReFaFakeQuantize: DoReFa-Net's weight quantizer (Zhou et al., 2016), in MQBench's integer-affine form."""

from __future__ import annotations

import torch
from torch import Tensor

from mqbench.fake_quantize.fixed import ObserverQParamsQuantizer
from mqbench.fake_quantize.quantize_base import _exporting
from mqbench.functional import EPS, fake_quantize, fake_quantize_for_export

__all__ = ["DoReFaFakeQuantize"]


class _TanhNormalize(torch.autograd.Function):
    """``t / max|t|`` with ``t = tanh(x)``; an explicit backward in ``x``'s dtype.

    With ``m = |t_k|`` the largest magnitude: ``d/dx_j = g_j (1 - t_j^2) / m`` plus, at ``k``,
    ``-sign(t_k) (1 - t_k^2) sum_i(g_i t_i) / m^2`` (zero when ``m`` sits at its floor).
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        t = torch.tanh(x.double()).to(x.dtype)
        index = t.abs().argmax()
        m = t.reshape(-1)[index].abs()
        floored = bool(m < EPS)
        m = m.clamp(min=EPS)
        ctx.save_for_backward(t, m, index)
        ctx.floored = floored
        return t / m

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        t, m, index = ctx.saved_tensors
        slope = 1 - t * t
        grad_x = grad * slope / m
        if not ctx.floored:
            t_k = t.reshape(-1)[index]
            correction = -torch.sign(t_k) * slope.reshape(-1)[index] * (grad * t).sum() / (m * m)
            grad_x.reshape(-1)[index] += correction
        return grad_x


class DoReFaFakeQuantize(ObserverQParamsQuantizer):
    """Weight quantization of DoReFa-Net: tanh normalisation, then fixed fake quantization.

    The tanh normalisation is part of the quantizer: the output is
    ``fake_quant(w')`` with ``w' = tanh(w) / max|tanh(w)|`` (the maximum over the whole
    tensor, as in the paper), so its values lie in ``[-1, 1]`` whatever the range of ``w``.
    The observer records ``w'`` and gives the scale and zero point (buffers, as in
    :class:`~mqbench.fake_quantize.FixedFakeQuantize`); this is MQBench's variant, an
    integer-affine grid that deploys as QuantizeLinear/DequantizeLinear, rather than the
    paper's ``2 * quantize_k((w' + 1) / 2) - 1``.

    Gradients flow through the normalisation by autograd and straight through the rounding
    (zero outside the grid). ``tanh`` is evaluated in float64 and rounded to the input's
    dtype, which makes it bit-identical between PyTorch and onnxruntime (their float32
    ``tanh`` kernels differ in the last bit). With fake quantization disabled the quantizer
    is the identity (neither normalised nor quantized). The exported graph computes the
    normalisation (Cast, Tanh, Abs, ReduceMax, Div) before the QuantizeLinear/DequantizeLinear.

    Example:
        >>> import torch
        >>> from mqbench.fake_quantize import DoReFaFakeQuantize
        >>> fq = DoReFaFakeQuantize(quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        >>> w = torch.tensor([-3.0, -0.5, 0.0, 0.2, 1.0])
        >>> fq(w).tolist()
        [-1.0, -0.4645669162273407, 0.0, 0.19685038924217224, 0.7637795209884644]
        >>> fq.scale
        tensor([0.0079])
    """

    @staticmethod
    def normalize(x: Tensor) -> Tensor:
        """``tanh(x) / max|tanh(x)|`` (tanh in float64, the rest in ``x``'s dtype; differentiable)."""
        if _exporting():  # plain ops, which both ONNX exporters translate
            t = torch.tanh(x.double()).to(x.dtype)
            return t / t.abs().max().clamp(min=EPS)
        return _TanhNormalize.apply(x)

    def forward(self, x: Tensor) -> Tensor:
        if _exporting():
            return super().forward(x)
        observe, quantize = self._switch("observer"), self._switch("fake_quant")
        if not (observe or quantize) or x.numel() == 0:
            return x
        normalized = self.normalize(x)
        if observe:
            self.activation_post_process(normalized.detach())
            self.update_qparams()
        if quantize:
            return fake_quantize(normalized, self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis)
        return x

    def quantize(self, x: Tensor) -> Tensor:
        return fake_quantize(self.normalize(x), self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis)

    deploys_activations = False  # the normalisation divides by each input's own max

    def deploy_weight(self, weight: Tensor) -> Tensor:
        return self.normalize(weight)

    def export_forward(self, x: Tensor) -> Tensor:
        return fake_quantize_for_export(
            self.normalize(x), self.scale, self.zero_point, self.quant_min, self.quant_max, self.axis
        )

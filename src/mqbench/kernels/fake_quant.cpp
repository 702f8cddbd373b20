// Fused CPU kernels for affine fake quantization with the same arithmetic as ONNX
// QuantizeLinear: q = clamp(nearbyint(x / scale) + zero_point, quant_min, quant_max)
// (a true division, round half to even), y = (q - zero_point) * scale.
//
// A tensor is viewed as [outer, channels, inner]; per-tensor quantization is channels == 1.
// Each kernel makes one pass over the data.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;

struct Layout {
  int64_t channels;
  int64_t inner;
};

Layout layout_of(const torch::Tensor& x, int64_t axis, int64_t channels) {
  if (axis < 0) return {1, x.numel()};
  int64_t inner = 1;
  for (int64_t d = axis + 1; d < x.dim(); ++d) inner *= x.size(d);
  return {channels, inner};
}

// Calls body(begin, end, channel) for runs of elements that share one channel.
template <typename Body>
void for_each_run(int64_t begin, int64_t end, const Layout& layout, const Body& body) {
  int64_t i = begin;
  while (i < end) {
    const int64_t row = i / layout.inner;
    const int64_t stop = std::min(end, (row + 1) * layout.inner);
    body(i, stop, row % layout.channels);
    i = stop;
  }
}

std::vector<torch::Tensor> fake_quant_forward(torch::Tensor x, torch::Tensor scale, torch::Tensor zero_point,
                                              int64_t quant_min, int64_t quant_max, int64_t axis) {
  x = x.contiguous();
  auto scale_f = scale.to(torch::kFloat).contiguous();
  auto zero_f = zero_point.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(x);
  auto mask = torch::empty(x.sizes(), x.options().dtype(torch::kBool));
  const Layout layout = layout_of(x, axis, scale_f.numel());
  const float* xs = x.data_ptr<float>();
  const float* ss = scale_f.data_ptr<float>();
  const float* zs = zero_f.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  bool* ms = mask.data_ptr<bool>();
  const float lo = static_cast<float>(quant_min), hi = static_cast<float>(quant_max);
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for_each_run(begin, end, layout, [&](int64_t b, int64_t e, int64_t c) {
      const float s = ss[c], z = zs[c];
#pragma omp simd
      for (int64_t i = b; i < e; ++i) {
        const float q = std::nearbyint(xs[i] / s) + z;
        ms[i] = (q >= lo) & (q <= hi);
        ys[i] = (std::min(std::max(q, lo), hi) - z) * s;
      }
    });
  });
  return {out, mask};
}

// LSQ / LSQ+ backward. Returns grad_x and the per-channel sums of
// grad * d(y)/d(scale) and grad * d(y)/d(zero_point) (before any gradient scaling).
std::vector<torch::Tensor> learnable_backward(torch::Tensor grad, torch::Tensor x, torch::Tensor scale,
                                              torch::Tensor zero_point, int64_t quant_min, int64_t quant_max,
                                              int64_t axis) {
  grad = grad.contiguous();
  x = x.contiguous();
  auto scale_f = scale.to(torch::kFloat).contiguous();
  auto zero_f = zero_point.to(torch::kFloat).contiguous();
  const Layout layout = layout_of(x, axis, scale_f.numel());
  const int64_t numel = x.numel();
  auto grad_x = torch::empty_like(x);
  const int64_t chunks = std::max<int64_t>(1, (numel + kGrain - 1) / kGrain);
  auto partial_scale = torch::zeros({chunks, layout.channels}, x.options().dtype(torch::kDouble));
  auto partial_zero = torch::zeros({chunks, layout.channels}, x.options().dtype(torch::kDouble));
  const float* gs = grad.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const float* ss = scale_f.data_ptr<float>();
  const float* zs = zero_f.data_ptr<float>();
  float* dx = grad_x.data_ptr<float>();
  double* ps = partial_scale.data_ptr<double>();
  double* pz = partial_zero.data_ptr<double>();
  const float lo = static_cast<float>(quant_min), hi = static_cast<float>(quant_max);
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t begin = chunk * kGrain, end = std::min(numel, begin + kGrain);
      for_each_run(begin, end, layout, [&](int64_t b, int64_t e, int64_t c) {
        const float s = ss[c], z = zs[c];
        float sum_scale = 0.f, sum_zero = 0.f;
#pragma omp simd reduction(+ : sum_scale, sum_zero)
        for (int64_t i = b; i < e; ++i) {
          const float v = xs[i] / s;
          const float r = std::nearbyint(v);
          const float q = r + z;
          const bool below = q < lo, above = q > hi;
          const float g = gs[i];
          dx[i] = (below | above) ? 0.f : g;
          const float local = below ? (lo - z) : (above ? (hi - z) : (r - v));
          sum_scale += g * local;
          sum_zero += (below | above) ? -g * s : 0.f;
        }
        ps[chunk * layout.channels + c] += sum_scale;
        pz[chunk * layout.channels + c] += sum_zero;
      });
    }
  });
  return {grad_x, partial_scale.sum(0).to(torch::kFloat), partial_zero.sum(0).to(torch::kFloat)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fake_quant_forward", &fake_quant_forward, "fused fake quantization forward (output, in-range mask)");
  m.def("learnable_backward", &learnable_backward, "LSQ backward (grad_x, grad_scale sums, grad_zero_point sums)");
}

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
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;
constexpr int64_t kSumBlock = 512;  // elements per float partial sum in the backward kernels

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

// Calls body(c) for every slice c of `channels` slices of `inner` elements each (axis 0 of a
// weight), slices split across threads.
template <typename Body>
void for_each_slice(int64_t channels, int64_t inner, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(inner, 1));
  at::parallel_for(0, channels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) body(c);
  });
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
      // Local copies, not lambda captures: captured references would be reloaded every iteration.
      const float s = ss[c], z = zs[c], low = lo, high = hi;
      const float* x_run = xs;
      float* y_run = ys;
      bool* mask_run = ms;
#pragma omp simd
      for (int64_t i = b; i < e; ++i) {
        const float q = std::nearbyint(x_run[i] / s) + z;
        mask_run[i] = (q >= low) & (q <= high);
        y_run[i] = (std::min(std::max(q, low), high) - z) * s;
      }
    });
  });
  return {out, mask};
}

// One run of the learned-scale forward (elements b..e of one channel); with Drop, element i is
// quantized only when r[i] < limit and is x[i] otherwise.
template <bool Drop>
inline void learnable_forward_run(const float* xs, const uint8_t* rs, float* ys, int64_t b, int64_t e, float s,
                                  float z, float low, float high, float limit) {
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const float v = xs[i];
    const float q = std::nearbyint(v / s) + z;
    const float y = (std::min(std::max(q, low), high) - z) * s;
    if (!Drop) {
      ys[i] = y;
    } else {  // a bitwise blend: a conditional here would keep the loop from vectorizing
      uint32_t y_bits, v_bits;
      std::memcpy(&y_bits, &y, sizeof(float));
      std::memcpy(&v_bits, &v, sizeof(float));
      const uint32_t keep = 0u - static_cast<uint32_t>(static_cast<float>(rs[i]) < limit);
      const uint32_t out_bits = (y_bits & keep) | (v_bits & ~keep);
      std::memcpy(&ys[i], &out_bits, sizeof(float));
    }
  }
}

// Learned-scale forward with QDrop's random dropping: element i is quantized when
// drop[i] < threshold (drop holds one random byte per element) and passed through as float
// otherwise. Without drop every element is quantized.
std::vector<torch::Tensor> learnable_forward(torch::Tensor x, torch::Tensor scale, torch::Tensor zero_point,
                                             int64_t quant_min, int64_t quant_max, int64_t axis,
                                             c10::optional<torch::Tensor> drop, int64_t threshold) {
  x = x.contiguous();
  auto scale_f = scale.to(torch::kFloat).contiguous();
  auto zero_f = zero_point.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(x);
  const Layout layout = layout_of(x, axis, scale_f.numel());
  const bool dropping = drop.has_value();
  torch::Tensor bytes = dropping ? drop->contiguous() : torch::Tensor();
  TORCH_CHECK(!dropping || (bytes.scalar_type() == torch::kUInt8 && bytes.numel() == x.numel()),
              "drop must hold one uint8 per element of x");
  const uint8_t* rs = dropping ? bytes.data_ptr<uint8_t>() : nullptr;
  const float* xs = x.data_ptr<float>();
  const float* ss = scale_f.data_ptr<float>();
  const float* zs = zero_f.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const float lo = static_cast<float>(quant_min), hi = static_cast<float>(quant_max);
  const float limit = static_cast<float>(threshold);
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for_each_run(begin, end, layout, [&](int64_t b, int64_t e, int64_t c) {
      if (rs == nullptr) {
        learnable_forward_run<false>(xs, rs, ys, b, e, ss[c], zs[c], lo, hi, limit);
      } else {
        learnable_forward_run<true>(xs, rs, ys, b, e, ss[c], zs[c], lo, hi, limit);
      }
    });
  });
  return {out};
}

// 1.f where c holds, else 0.f, as bits: written as a conditional, GCC turns the products with it
// in the backward kernels' sums into selects and leaves those loops scalar (several times slower).
inline float unit_if(bool c) {
  const uint32_t bits = (0u - static_cast<uint32_t>(c)) & 0x3f800000u;
  float unit;
  std::memcpy(&unit, &bits, sizeof(float));
  return unit;
}

// One run of the LSQ / LSQ+ backward (elements b..e of one channel); with Drop, element i counts
// as quantized only when r[i] < limit. Adds to the run's scale and zero-point sums.
template <bool Drop>
inline void learnable_backward_run(const float* xs, const float* gs, const uint8_t* rs, float* dx, int64_t b,
                                   int64_t e, float s, float z, float low, float high, float limit, double& sum_scale,
                                   double& sum_zero) {
  // The scale's gradient sum cancels: clipped elements add g (quant_max - z), up to hundreds of
  // times g, and the sum can be far smaller. So it is split into three sums whose terms stay small,
  // g (round(v) - v) inside and g below / above, each in float within a block of kSumBlock
  // elements and in double across blocks; the bounds multiply the last two once, in double.
  double inside_sum = 0.0, below_sum = 0.0, above_sum = 0.0;
  for (int64_t start = b; start < e; start += kSumBlock) {
    const int64_t stop = std::min(e, start + kSumBlock);
    float block_inside = 0.f, block_below = 0.f, block_above = 0.f;
#pragma omp simd reduction(+ : block_inside, block_below, block_above)
    for (int64_t i = start; i < stop; ++i) {
      const float v = xs[i] / s;
      const float r = std::nearbyint(v);
      const float q = r + z;
      const float g = gs[i];
      const bool keep = Drop ? static_cast<float>(rs[i]) < limit : true;
      const float kept = unit_if(keep);
      const float below = unit_if((q < low) & keep), above = unit_if((q > high) & keep);
      const float outside = below + above;
      dx[i] = g - g * outside;
      block_inside += g * (kept - outside) * (r - v);
      block_below += g * below;
      block_above += g * above;
    }
    inside_sum += static_cast<double>(block_inside);
    below_sum += static_cast<double>(block_below);
    above_sum += static_cast<double>(block_above);
  }
  sum_scale += inside_sum + static_cast<double>(low - z) * below_sum + static_cast<double>(high - z) * above_sum;
  sum_zero -= static_cast<double>(s) * (below_sum + above_sum);
}

// LSQ / LSQ+ backward. Returns grad_x and the per-channel sums of
// grad * d(y)/d(scale) and grad * d(y)/d(zero_point) (before any gradient scaling).
// With drop (see learnable_forward) a dropped element passes its gradient to x unchanged and
// gives none to scale or zero point.
std::vector<torch::Tensor> learnable_backward(torch::Tensor grad, torch::Tensor x, torch::Tensor scale,
                                              torch::Tensor zero_point, int64_t quant_min, int64_t quant_max,
                                              int64_t axis, c10::optional<torch::Tensor> drop, int64_t threshold) {
  grad = grad.contiguous();
  x = x.contiguous();
  auto scale_f = scale.to(torch::kFloat).contiguous();
  auto zero_f = zero_point.to(torch::kFloat).contiguous();
  const Layout layout = layout_of(x, axis, scale_f.numel());
  const int64_t numel = x.numel();
  const bool dropping = drop.has_value();
  torch::Tensor bytes = dropping ? drop->contiguous() : torch::Tensor();
  TORCH_CHECK(!dropping || (bytes.scalar_type() == torch::kUInt8 && bytes.numel() == numel),
              "drop must hold one uint8 per element of x");
  const uint8_t* rs = dropping ? bytes.data_ptr<uint8_t>() : nullptr;
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
  const float limit = static_cast<float>(threshold);
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t begin = chunk * kGrain, end = std::min(numel, begin + kGrain);
      for_each_run(begin, end, layout, [&](int64_t b, int64_t e, int64_t c) {
        double sum_scale = 0.0, sum_zero = 0.0;
        if (rs == nullptr) {
          learnable_backward_run<false>(xs, gs, rs, dx, b, e, ss[c], zs[c], lo, hi, limit, sum_scale, sum_zero);
        } else {
          learnable_backward_run<true>(xs, gs, rs, dx, b, e, ss[c], zs[c], lo, hi, limit, sum_scale, sum_zero);
        }
        ps[chunk * layout.channels + c] += sum_scale;
        pz[chunk * layout.channels + c] += sum_zero;
      });
    }
  });
  return {grad_x, partial_scale.sum(0).to(torch::kFloat), partial_zero.sum(0).to(torch::kFloat)};
}

// tanh for the DSQ surrogate gradient, in arithmetic the compiler vectorises:
// tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) = exp(-|y| / 8)^16, the inner exp by
// its Taylor polynomial on [-1.25, 0] (|y| is capped at 10, where tanh is 1 in float32).
// Relative error below 1e-6; only gradients use it.
inline float smooth_tanh(float y) {
  const float r = -std::min(std::fabs(y), 10.f) * 0.125f;
  float p = 1.f / 362880.f;
  p = p * r + 1.f / 40320.f;
  p = p * r + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  p = p * p;  // exp(r)^2
  p = p * p;  // ^4
  p = p * p;  // ^8
  p = p * p;  // ^16 = exp(-2|y|)
  const float t = (1.f - p) / (1.f + p);
  return y < 0.f ? -t : t;
}

// DSQ backward: gradients of the soft staircase
//   soft = (i + (1 + tanh(k u) / (1 - alpha)) / 2 - z) * s,  v = clamp(x / s + z), i = floor(v), u = v - i - 1/2,
//   k = log(2 / alpha - 1),
// to x (zero where x / s + z is outside [quant_min, quant_max]) and the summed gradient to alpha.
std::vector<torch::Tensor> dsq_backward(torch::Tensor grad, torch::Tensor x, torch::Tensor scale,
                                        torch::Tensor zero_point, double alpha, int64_t quant_min, int64_t quant_max,
                                        int64_t axis) {
  grad = grad.contiguous();
  x = x.contiguous();
  auto scale_f = scale.to(torch::kFloat).contiguous();
  auto zero_f = zero_point.to(torch::kFloat).contiguous();
  const Layout layout = layout_of(x, axis, scale_f.numel());
  const int64_t numel = x.numel();
  auto grad_x = torch::empty_like(x);
  const int64_t chunks = std::max<int64_t>(1, (numel + kGrain - 1) / kGrain);
  auto partial_alpha = torch::zeros({chunks}, x.options().dtype(torch::kDouble));
  const float* gs = grad.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const float* ss = scale_f.data_ptr<float>();
  const float* zs = zero_f.data_ptr<float>();
  float* dx = grad_x.data_ptr<float>();
  double* pa = partial_alpha.data_ptr<double>();
  const float lo = static_cast<float>(quant_min), hi = static_cast<float>(quant_max);
  const float a = static_cast<float>(alpha);
  const float k = std::log(2.f / a - 1.f);
  const float c = 1.f / (1.f - a);
  const float dk = -2.f / (a * (2.f - a));
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t begin = chunk * kGrain, end = std::min(numel, begin + kGrain);
      float sum_alpha = 0.f;
      for_each_run(begin, end, layout, [&](int64_t b, int64_t e, int64_t ch) {
        const float s = ss[ch], z = zs[ch];
        const float low = lo, high = hi, k_local = k, c_local = c, dk_local = dk;
        const float* x_run = xs;
        const float* g_run = gs;
        float* dx_run = dx;
        float run_sum = 0.f;
#pragma omp simd reduction(+ : run_sum)
        for (int64_t i = b; i < e; ++i) {
          const float raw = x_run[i] / s + z;
          const bool inside = (raw >= low) & (raw <= high);
          const float v = std::min(std::max(raw, low), high);
          const float nearest = std::nearbyint(v);  // floor(v), written so that it vectorises
          const float u = v - (nearest > v ? nearest - 1.f : nearest) - 0.5f;
          const float t = smooth_tanh(k_local * u);
          const float slope = 1.f - t * t;
          const float g = g_run[i];
          dx_run[i] = inside ? g * 0.5f * c_local * k_local * slope : 0.f;
          run_sum += g * 0.5f * s * (c_local * slope * u * dk_local + t * c_local * c_local);
        }
        sum_alpha += run_sum;
      });
      pa[chunk] += sum_alpha;
    }
  });
  return {grad_x, partial_alpha.sum().to(torch::kFloat).reshape({1})};
}

// PACT backward for y = fake_quant(clip(x, lower, alpha)), lower = -alpha (signed) or 0:
// grad_x = grad inside [lower, alpha) (strictly above -alpha when signed), else 0;
// grad_alpha = sum(grad where x >= alpha) - sum(grad where x <= -alpha) (signed grids only).
std::vector<torch::Tensor> pact_backward(torch::Tensor grad, torch::Tensor x, double alpha, bool is_signed) {
  grad = grad.contiguous();
  x = x.contiguous();
  const int64_t numel = x.numel();
  auto grad_x = torch::empty_like(x);
  const int64_t chunks = std::max<int64_t>(1, (numel + kGrain - 1) / kGrain);
  auto partial_alpha = torch::zeros({chunks}, x.options().dtype(torch::kDouble));
  const float* xs = x.data_ptr<float>();
  const float* gs = grad.data_ptr<float>();
  float* dx = grad_x.data_ptr<float>();
  double* pa = partial_alpha.data_ptr<double>();
  const float top = static_cast<float>(alpha);
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t begin = chunk * kGrain, end = std::min(numel, begin + kGrain);
      const float* x_run = xs;
      const float* g_run = gs;
      float* dx_run = dx;
      const float high = top;
      const bool two_sided = is_signed;
      float sum_alpha = 0.f;
#pragma omp simd reduction(+ : sum_alpha)
      for (int64_t i = begin; i < end; ++i) {
        const float v = x_run[i], g = g_run[i];
        const bool above = v >= high;
        const bool below = two_sided ? (v <= -high) : (v < 0.f);
        dx_run[i] = (above | below) ? 0.f : g;
        sum_alpha += above ? g : ((below & two_sided) ? -g : 0.f);
      }
      pa[chunk] += sum_alpha;
    }
  });
  return {grad_x, partial_alpha.sum().to(torch::kFloat).reshape({1})};
}


// The 8-bit logarithmic grid (mqbench.grids.nnie_quantize) without log or pow. For a normal float
// |x| = 2^e m, m = 1 + t / 2^23 in [1, 2): round(16 log2|x|) = 16 e + c, where c counts the
// boundaries 2^((j - 1/2) / 16), j = 1..16, at or below m, i.e. the odd powers 2^(2j - 1) at or
// below m^32. So c = (E + 1) / 2 (integer division), E the binary exponent of m^32, and m^32 is
// five squarings in double. Exact: m^32 comes no closer than 3.5e-8 (relative) to any odd power
// of two over all 2^23 mantissas, the squarings err by under 1e-14, and a test checks every
// mantissa. levels[k] is the float32 level of code k (2^((k + z) / 16)); below zero_below[0]
// (x > 0) or zero_below[1] (x <= 0) the result is 0. The caller checks that both thresholds are
// normal floats, so no subnormal input reaches the count.

// One run of the log grid: y = q(x * fc) * rc (fc = rc = 1 for the plain grid: exact no-ops).
inline void log_grid_run(const float* x_run, float* y_run, int64_t n, float fc, float rc, const float* level,
                         float zp, float zn, int32_t zi) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x_run[i] * fc;
    const float magnitude = std::fabs(v);
    uint32_t bits;
    std::memcpy(&bits, &magnitude, sizeof(float));
    double power = 1.0 + static_cast<double>(static_cast<int32_t>(bits & 0x7fffffu)) * 0x1p-23;  // m, exact
    for (int k = 0; k < 5; ++k) power *= power;  // m^32
    uint64_t power_bits;
    std::memcpy(&power_bits, &power, sizeof(double));
    const int32_t octave_exponent = static_cast<int32_t>(power_bits >> 52) - 1023;
    const int32_t n_code = 16 * (static_cast<int32_t>(bits >> 23) - 127) + ((octave_exponent + 1) >> 1);
    const bool positive = v > 0.f;
    const int32_t k = std::min(std::max(n_code - zi, positive ? 0 : 1), 127);
    const float magnitude_out = level[k];
    const bool keep = magnitude >= (positive ? zp : zn);
    y_run[i] = (keep ? (positive ? magnitude_out : -magnitude_out) : 0.f) * rc;
  }
}

// With factor (one per slice of x along axis 0), the weight of a layer whose BatchNorm is folded
// while training: out = q(x * factor[c]) * (1 / factor[c]).
torch::Tensor log_grid_forward(torch::Tensor x, int64_t z, torch::Tensor levels, double zero_positive,
                               double zero_negative, c10::optional<torch::Tensor> factor) {
  x = x.contiguous();
  levels = levels.to(torch::kFloat).contiguous();
  TORCH_CHECK(levels.numel() == 128, "128 levels expected");
  auto out = torch::empty_like(x);
  const float* xs = x.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const float* table = levels.data_ptr<float>();
  const float zp = static_cast<float>(zero_positive), zn = static_cast<float>(zero_negative);
  const int32_t zi = static_cast<int32_t>(z);
  if (!factor.has_value()) {
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      log_grid_run(xs + begin, ys + begin, end - begin, 1.f, 1.f, table, zp, zn, zi);
    });
    return out;
  }
  const auto f = factor->to(torch::kFloat).contiguous();
  const int64_t channels = f.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == channels, "one factor per slice along axis 0 expected");
  const int64_t inner = channels ? x.numel() / channels : 0;
  const float* fs = f.data_ptr<float>();
  for_each_slice(channels, inner, [&](int64_t c) {
    log_grid_run(xs + c * inner, ys + c * inner, inner, fs[c], 1.0f / fs[c], table, zp, zn, zi);
  });
  return out;
}

// The factor's gradient of out = q(w * f[c]) / f[c] for a quantizer q with the identity as its
// gradient: sum over channel c of grad * (w - out), divided by f[c] (from w * f and from 1 / f).
// Each term is grad times the quantization error, small; float within blocks, double across.
torch::Tensor folded_identity_factor_grad(torch::Tensor grad, torch::Tensor w, torch::Tensor out,
                                          torch::Tensor factor) {
  grad = grad.contiguous();
  w = w.contiguous();
  out = out.contiguous();
  const auto f = factor.to(torch::kFloat).contiguous();
  const int64_t channels = f.numel();
  TORCH_CHECK(w.dim() >= 1 && w.size(0) == channels && grad.sizes() == w.sizes() && out.sizes() == w.sizes(),
              "grad, w and out of one shape, one factor per slice along axis 0 expected");
  const int64_t inner = channels ? w.numel() / channels : 0;
  auto result = torch::empty({channels}, w.options().dtype(torch::kDouble));
  const float* gs = grad.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  const float* os = out.data_ptr<float>();
  const float* fs = f.data_ptr<float>();
  double* rs = result.data_ptr<double>();
  for_each_slice(channels, inner, [&](int64_t c) {
    const float* g_run = gs + c * inner;
    const float* w_run = ws + c * inner;
    const float* o_run = os + c * inner;
    double total = 0.0;
    for (int64_t start = 0; start < inner; start += kSumBlock) {
      const int64_t stop = std::min(inner, start + kSumBlock);
      float block = 0.f;
#pragma omp simd reduction(+ : block)
      for (int64_t i = start; i < stop; ++i) block += g_run[i] * (w_run[i] - o_run[i]);
      total += static_cast<double>(block);
    }
    rs[c] = total / static_cast<double>(fs[c]);
  });
  return result.to(torch::kFloat);
}


// The operands of the folded learned-scale kernels: a weight with its output channels on axis 0
// (each channel's elements contiguous), one factor per channel, and a scale and zero point per
// channel or per tensor.
struct Folded {
  torch::Tensor w, f, scale, zero;
  int64_t channels, inner;
  bool per_channel;
  float lo, hi;

  Folded(torch::Tensor weight, const torch::Tensor& factor, const torch::Tensor& scale_in,
         const torch::Tensor& zero_point, int64_t quant_min, int64_t quant_max)
      : w(weight.contiguous()),
        f(factor.to(torch::kFloat).contiguous()),
        scale(scale_in.to(torch::kFloat).contiguous()),
        zero(zero_point.to(torch::kFloat).contiguous()),
        channels(f.numel()),
        inner(0),
        per_channel(scale.numel() > 1),
        lo(static_cast<float>(quant_min)),
        hi(static_cast<float>(quant_max)) {
    TORCH_CHECK(w.dim() >= 1 && w.size(0) == channels, "one factor per output channel (axis 0) expected");
    TORCH_CHECK(scale.numel() == 1 || scale.numel() == channels, "scale: one per tensor or per channel");
    inner = channels ? w.numel() / channels : 0;
  }

  // Calls body(c, f[c], 1 / f[c], scale, zero point) for every channel, channels split across threads.
  template <typename Body>
  void for_each_channel(const Body& body) const {
    const float* fs = f.data_ptr<float>();
    const float* ss = scale.data_ptr<float>();
    const float* zs = zero.data_ptr<float>();
    for_each_slice(channels, inner, [&](int64_t c) {
      const int64_t k = per_channel ? c : 0;
      body(c, fs[c], 1.0f / fs[c], ss[k], zs[k]);
    });
  }
};

// One output channel of folded_learnable_forward. The operands arrive as values: read through the
// lambda's captured references they would be reloaded every iteration and the loop not vectorised.
inline void folded_forward_run(const float* w, float* y, int64_t n, float fc, float rc, float s, float z, float low,
                               float high) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((w[i] * fc) / s) + z;
    y[i] = ((std::min(std::max(q, low), high) - z) * s) * rc;
  }
}

// Learned-scale fake quantization of a weight scaled per output channel (BatchNorm folding in
// training): out = fq(w * f[c]) * (1 / f[c]) with fq the LSQ forward above. Computes what the
// three separate ops compute.
torch::Tensor folded_learnable_forward(torch::Tensor w, torch::Tensor factor, torch::Tensor scale,
                                       torch::Tensor zero_point, int64_t quant_min, int64_t quant_max) {
  const Folded op(w, factor, scale, zero_point, quant_min, quant_max);
  auto out = torch::empty_like(op.w);
  const float* ws = op.w.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const int64_t inner = op.inner;
  const float low = op.lo, high = op.hi;
  op.for_each_channel([&](int64_t c, float fc, float rc, float s, float z) {
    folded_forward_run(ws + c * inner, ys + c * inner, inner, fc, rc, s, z, low, high);
  });
  return out;
}

// One output channel of folded_learnable_backward (operands as values, as in folded_forward_run).
// Writes grad_w and returns the channel's sums for scale, zero point and factor.
inline void folded_backward_run(const float* g_run, const float* w_run, float* d_run, int64_t n, float fc, float rc,
                                float s, float z, float low, float high, double& sum_scale, double& sum_zero,
                                double& sum_factor) {
  // Split sums as in learnable_backward_run. f's gradient, sum(g w inside) / f - sum(g y) / f^2, is
  // two nearly equal sums (y / f is w quantized); it is summed as one term per element,
  // (g / f) (w inside - y / f): the quantization error or the clipped value, small.
  double inside_sum = 0.0, below_sum = 0.0, above_sum = 0.0, factor_sum = 0.0;
  for (int64_t start = 0; start < n; start += kSumBlock) {
    const int64_t stop = std::min(n, start + kSumBlock);
    float block_inside = 0.f, block_below = 0.f, block_above = 0.f, block_factor = 0.f;
#pragma omp simd reduction(+ : block_inside, block_below, block_above, block_factor)
    for (int64_t i = start; i < stop; ++i) {
      const float w = w_run[i];
      const float v = (w * fc) / s;
      const float r = std::nearbyint(v);
      const float q = r + z;
      const float below = unit_if(q < low), above = unit_if(q > high);
      const float inside = 1.f - (below + above);
      const float y = (std::min(std::max(q, low), high) - z) * s;
      const float gy = g_run[i] * rc;  // gradient reaching fq's output
      const float du = gy * inside;    // reaching w * f (straight through inside the range)
      d_run[i] = du * fc;
      block_inside += du * (r - v);
      block_below += gy * below;
      block_above += gy * above;
      block_factor += gy * (w * inside - y * rc);
    }
    inside_sum += static_cast<double>(block_inside);
    below_sum += static_cast<double>(block_below);
    above_sum += static_cast<double>(block_above);
    factor_sum += static_cast<double>(block_factor);
  }
  sum_scale = inside_sum + static_cast<double>(low - z) * below_sum + static_cast<double>(high - z) * above_sum;
  sum_zero = -static_cast<double>(s) * (below_sum + above_sum);
  sum_factor = factor_sum;
}

// Backward of folded_learnable_forward. Returns grad_w and, per channel, the sums of
// grad * d(out)/d(scale), grad * d(out)/d(zero_point) and grad * d(out)/d(f) (before LSQ's
// gradient scaling), the scale and zero-point sums folded to one value for a per-tensor scale.
std::vector<torch::Tensor> folded_learnable_backward(torch::Tensor grad, torch::Tensor w, torch::Tensor factor,
                                                     torch::Tensor scale, torch::Tensor zero_point,
                                                     int64_t quant_min, int64_t quant_max) {
  const Folded op(w, factor, scale, zero_point, quant_min, quant_max);
  grad = grad.contiguous();
  const int64_t channels = op.channels, inner = op.inner;
  auto grad_w = torch::empty_like(op.w);
  auto sums = torch::zeros({3, channels}, op.w.options().dtype(torch::kDouble));
  const float* gs = grad.data_ptr<float>();
  const float* ws = op.w.data_ptr<float>();
  float* dw = grad_w.data_ptr<float>();
  double* sum_scale = sums.data_ptr<double>();
  double* sum_zero = sum_scale + channels;
  double* sum_factor = sum_zero + channels;
  const float low = op.lo, high = op.hi;
  op.for_each_channel([&](int64_t c, float fc, float rc, float s, float z) {
    const int64_t at = c * inner;
    folded_backward_run(gs + at, ws + at, dw + at, inner, fc, rc, s, z, low, high, sum_scale[c], sum_zero[c],
                        sum_factor[c]);
  });
  auto grad_scale = sums[0], grad_zero = sums[1];
  if (!op.per_channel) {
    grad_scale = grad_scale.sum().reshape({1});
    grad_zero = grad_zero.sum().reshape({1});
  }
  return {grad_w, grad_scale.to(torch::kFloat), grad_zero.to(torch::kFloat), sums[2].to(torch::kFloat)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fake_quant_forward", &fake_quant_forward, "fused fake quantization forward (output, in-range mask)");
  m.def("learnable_forward", &learnable_forward, "learned-scale forward, optionally dropping (output)");
  m.def("learnable_backward", &learnable_backward, "LSQ backward (grad_x, grad_scale sums, grad_zero_point sums)");
  m.def("pact_backward", &pact_backward, "PACT backward (grad_x, grad_alpha sum)");
  m.def("log_grid_forward", &log_grid_forward, "8-bit logarithmic grid fake quantization, optionally folded (output)");
  m.def("folded_identity_factor_grad", &folded_identity_factor_grad, "factor gradient of q(w f) / f, identity q'");
  m.def("folded_learnable_forward", &folded_learnable_forward, "fq(w * f) / f, learned scale (output)");
  m.def("folded_learnable_backward", &folded_learnable_backward, "its backward (grad_w, scale, zero point, factor sums)");
  m.def("dsq_backward", &dsq_backward, "DSQ soft-staircase backward (grad_x, grad_alpha sum)");
}

// Elementwise steps of a decoder layer, fused so each is one pass and one call: residual add +
// RMSNorm, rotary embedding in place, SiLU times up.

#include "cpu_ops.h"
#include "simd.h"

#include <cmath>

namespace pagecli {

// ---- Elementwise steps of a decoder layer, fused so each is one pass and one call -----------------
// Each computes in fp32 and rounds where the PyTorch layers (pagecli/models/layers.py) round, so
// float32 results match them to rounding and bf16 ones round at the same points.

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }

// h += delta (when given, rounded to h's dtype), then returns weight * rms_norm(h).
template <typename scalar_t>
void add_rms_norm_impl(torch::Tensor& h, const torch::Tensor* delta, const torch::Tensor& weight, torch::Tensor& out,
                       double eps) {
  const int64_t rows = h.size(0), dim = h.size(1);
  scalar_t* hp = h.data_ptr<scalar_t>();
  const scalar_t* dp = delta ? delta->data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* hr = hp + r * dim;
      const scalar_t* dr = dp ? dp + r * dim : nullptr;
      int64_t d = 0;
      float sum_sq = 0.f;
#if defined(__AVX512F__)
      __m512 sq = _mm512_setzero_ps();
      for (; d + 16 <= dim; d += 16) {
        __m512 v = load16(hr + d);
        if (dr) {
          v = round16<scalar_t>(_mm512_add_ps(v, load16(dr + d)));
          store16(hr + d, v);
        }
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      sum_sq = _mm512_reduce_add_ps(sq);
#endif
      for (; d < dim; ++d) {
        if (dr) hr[d] = round_to<scalar_t>(to_float(hr[d]) + to_float(dr[d]));
        const float v = to_float(hr[d]);
        sum_sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + static_cast<float>(eps));
      scalar_t* orow = op + r * dim;
      d = 0;
#if defined(__AVX512F__)
      const __m512 inv16 = _mm512_set1_ps(inv);
      for (; d + 16 <= dim; d += 16) {
        const __m512 normed = round16<scalar_t>(_mm512_mul_ps(load16(hr + d), inv16));
        store16(orow + d, _mm512_mul_ps(load16(wp + d), normed));
      }
#endif
      for (; d < dim; ++d) {
        const float normed = to_float(round_to<scalar_t>(to_float(hr[d]) * inv));
        orow[d] = round_to<scalar_t>(to_float(wp[d]) * normed);
      }
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "weight must be [dim] in h's dtype");
  const torch::Tensor* d = nullptr;
  torch::Tensor delta_c;
  if (delta.has_value() && delta->defined()) {
    delta_c = delta->contiguous();
    TORCH_CHECK(delta_c.sizes() == h.sizes() && delta_c.scalar_type() == h.scalar_type(), "delta must match h");
    d = &delta_c;
  }
  auto out = torch::empty_like(h);
  PAGECLI_DISPATCH(h.scalar_type(), "add_rms_norm", [&] { add_rms_norm_impl<scalar_t>(h, d, weight, out, eps); });
  return out;
}

void add_rms_norm_into(torch::Tensor& h, const torch::Tensor* delta, const torch::Tensor& weight, torch::Tensor& out,
                       double eps) {
  PAGECLI_DISPATCH(h.scalar_type(), "add_rms_norm", [&] { add_rms_norm_impl<scalar_t>(h, delta, weight, out, eps); });
}

// Rotary embedding in place on x [tokens, heads, head_dim] (rows may be strided views of the qkv
// output): the rotate-half layout, x * cos + rotate_half(x) * sin with fp32 tables.
template <typename scalar_t>
void rotary_impl(torch::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t table_dim) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * table_dim;
      const float* s = sin + pos[t] * table_dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = xp + t * s0 + h * s1;
        for (int64_t d = 0; d < dim; ++d) tmp[d] = to_float(row[d]);
        for (int64_t d = 0; d < half; ++d) {
          const float a = tmp[d] * c[d], b = -tmp[d + half] * s[d];
          row[d] = round_to<scalar_t>(a + b);
        }
        for (int64_t d = half; d < dim; ++d) {
          const float a = tmp[d] * c[d], b = tmp[d - half] * s[d];
          row[d] = round_to<scalar_t>(a + b);
        }
      }
    }
  });
}

void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == x.size(2),
              "cos and sin must be contiguous float32 [positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  PAGECLI_DISPATCH(x.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(x, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1));
  });
}

// silu(gate) * up for gate_up [rows, 2 * inter] = [gate | up]; returns [rows, inter].
template <typename scalar_t>
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = out.size(0), inter = out.size(1);
  const scalar_t* gp = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gp + r * 2 * inter;
      const scalar_t* u = g + inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= inter; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 one = _mm512_set1_ps(1.f);
        const __m512 silu = round16<scalar_t>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16(op + r * inter + i, _mm512_mul_ps(silu, load16(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float x = to_float(g[i]);
        const float silu = to_float(round_to<scalar_t>(x / (1.f + std::exp(-x))));
        op[r * inter + i] = round_to<scalar_t>(silu * to_float(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [rows, 2 * intermediate] tensor");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  PAGECLI_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] { silu_mul_impl<scalar_t>(gate_up, out); });
  return out;
}

void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out) {
  PAGECLI_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] { silu_mul_impl<scalar_t>(gate_up, out); });
}

}  // namespace pagecli

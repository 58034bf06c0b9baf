// Gradient x input reduction for OAR-G (method.md section 4): I_t = | sum_h g[t, h] * E[t, h] |.
#include "oar/core/grad_input.h"

#include <Eigen/Core>

#include <cmath>
#include <string>

#include "oar/core/common.h"
#include "widen.h"

namespace oar::core {
namespace {

// Products of float32 values accumulated in float32: embedding widths are small (H ~ 1e3), the scores go
// through log1p and min-max normalization (section 5), and the noise-driven gradients dominate any
// rounding. Eigen's packet reduction keeps the sum pairwise-ish (error ~ eps * sqrt(H)).
inline float dot_row(const float* g, const float* x, int64_t H) {
  using CMap = Eigen::Map<const Eigen::ArrayXf>;
  return (CMap(g, H) * CMap(x, H)).sum();
}

inline float dot_row(const double* g, const double* x, int64_t H) {
  using CMap = Eigen::Map<const Eigen::ArrayXd>;
  return static_cast<float>((CMap(g, H) * CMap(x, H)).sum());
}

// Half types: widen a block to float first (vectorized, src/core/widen.h) so the product and sum run on
// float packets.
template <typename T>
inline float dot_row(const T* g, const T* x, int64_t H) {
  constexpr int64_t kBlock = 1024;
  alignas(64) float bg[kBlock];
  alignas(64) float bx[kBlock];
  float acc = 0.0f;
  for (int64_t h0 = 0; h0 < H; h0 += kBlock) {
    const int64_t len = H - h0 < kBlock ? H - h0 : kBlock;
    detail::widen_load(g + h0, bg, len);
    detail::widen_load(x + h0, bx, len);
    acc += dot_row(bg, bx, len);
  }
  return acc;
}

}  // namespace

template <typename T>
void grad_x_input(const T* grad, const T* input, int64_t rows, int64_t H, float* out) {
  if (rows < 0) throw InvalidArgument("grad_x_input: rows must be >= 0, got " + std::to_string(rows));
  if (H < 0) throw InvalidArgument("grad_x_input: H must be >= 0, got " + std::to_string(H));
  if (rows > 0 && H > 0 && (grad == nullptr || input == nullptr))
    throw InvalidArgument("grad_x_input: grad and input must be non-null when rows * H > 0");
  for (int64_t r = 0; r < rows; ++r)
    out[r] = H == 0 ? 0.0f : std::fabs(dot_row(grad + r * H, input + r * H, H));
}

template void grad_x_input<float>(const float*, const float*, int64_t, int64_t, float*);
template void grad_x_input<double>(const double*, const double*, int64_t, int64_t, float*);
template void grad_x_input<Eigen::half>(const Eigen::half*, const Eigen::half*, int64_t, int64_t, float*);
template void grad_x_input<Eigen::bfloat16>(const Eigen::bfloat16*, const Eigen::bfloat16*, int64_t, int64_t,
                                            float*);

}  // namespace oar::core

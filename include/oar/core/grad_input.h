// Gradient x input reduction for OAR-G (method.md section 4). Torch-free.
#pragma once

#include <cstdint>

namespace oar::core {

/// out[r] = | sum_h grad[r, h] * input[r, h] | for `rows` rows of H contiguous values, accumulated in
/// float32. T is float, double, Eigen::half or Eigen::bfloat16.
template <typename T>
void grad_x_input(const T* grad, const T* input, int64_t rows, int64_t H, float* out);

}  // namespace oar::core

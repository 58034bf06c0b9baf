#include "checks.h"

#include <sstream>

namespace oar::torch_ops {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  if (sizes.size() == 1) os << ",";
  os << ")";
  return os.str();
}

void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None (an undefined tensor)");
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim, const char* what) {
  check_defined(t, name);
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D ", what, ", got shape ", shape_str(t.sizes()));
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected, const char* what) {
  check_defined(t, name);
  TORCH_CHECK_VALUE(t.sizes() == expected, name, " must be ", what, " = ", shape_str(expected), ", got ",
                    shape_str(t.sizes()));
}

void check_dtype(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> allowed) {
  check_defined(t, name);
  for (auto a : allowed)
    if (t.scalar_type() == a) return;
  std::ostringstream os;
  bool first = true;
  for (auto a : allowed) {
    os << (first ? "" : ", ") << c10::toString(a);
    first = false;
  }
  TORCH_CHECK_VALUE(false, name, " must have dtype in {", os.str(), "}, got ", c10::toString(t.scalar_type()));
}

void check_same_device(const at::Tensor& ref, const char* ref_name, const at::Tensor& t, const char* name) {
  check_defined(ref, ref_name);
  check_defined(t, name);
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (",
                    ref.device(), "), got ", t.device());
}

void check_float_logits(const at::Tensor& t, const char* name) {
  check_dtype(t, name, {at::kFloat, at::kHalf, at::kBFloat16});
}

void check_finite_result(const at::Tensor& out, const char* op, const char* hint) {
  const at::Tensor bad = at::logical_not(at::isfinite(out));
  if (!bad.any().item<bool>()) return;
  // First offending element, as an index tuple and its value (read on the host).
  const at::Tensor where = bad.nonzero().select(0, 0).cpu();
  std::ostringstream idx;
  for (int64_t d = 0; d < where.numel(); ++d) idx << (d ? ", " : "") << where[d].item<int64_t>();
  at::Tensor v = out;
  for (int64_t d = 0; d < where.numel(); ++d) v = v.select(0, where[d].item<int64_t>());
  TORCH_CHECK_VALUE(false, op, ": the result at [", idx.str(), "] is not finite (got ", v.item<double>(), "); ",
                    hint);
}

at::Tensor as_bool_mask(const at::Tensor& t, const char* name, at::IntArrayRef expected, const char* what) {
  check_shape(t, name, expected, what);
  if (t.scalar_type() == at::kBool) return t;
  TORCH_CHECK_VALUE(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), name,
                    " must be a bool (or 0/1 integer) mask, got dtype ", c10::toString(t.scalar_type()));
  return t.ne(0);
}

}  // namespace oar::torch_ops

// C++ API (include/oar/torch/ops.h): typed dispatcher calls, so C++ callers go through the same
// registrations (CPU/CUDA) as Python callers.
#include "oar/torch/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "checks.h"
#include "oar/core/group_advantages.h"

namespace oar {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

at::Tensor group_advantages(const at::Tensor& rewards, const at::Tensor& offsets, const std::string& estimator,
                            const std::string& preset, bool skip_nan) {
  const auto opts = torch_ops::rethrow_as_value_error([&] {
    return core::preset_options(preset, core::parse_estimator(estimator));
  });
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, c10::string_view, double,
                                c10::string_view, bool)>("oar::group_advantages");
  return h.call(rewards, offsets, estimator, core::to_string(opts.std_kind), opts.eps,
                core::to_string(opts.singleton), skip_nan);
}

at::Tensor normalize_importance(const at::Tensor& scores, const at::Tensor& mask) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&)>("oar::normalize_importance");
  return h.call(scores, mask);
}

std::tuple<at::Tensor, at::Tensor> reshape_advantages(const at::Tensor& advantages, const at::Tensor& scores,
                                                      const at::Tensor& reasoning_mask, const at::Tensor& response_mask,
                                                      double q, double beta, double floor, const std::string& tiers,
                                                      bool scores_are_normalized) {
  static auto h = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, double, double, double, c10::string_view,
                                                        bool)>("oar::reshape_advantages");
  return h.call(advantages, scores, reasoning_mask, response_mask, q, beta, floor, tiers, scores_are_normalized);
}

at::Tensor probe_divergence(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                            const std::optional<at::Tensor>& answer_ids, const std::optional<at::Tensor>& lengths,
                            const std::string& probe) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, c10::string_view)>("oar::probe_divergence");
  return h.call(clean_logits, perturbed_logits, answer_ids, lengths, probe);
}

at::Tensor grad_x_input(const at::Tensor& grad, const at::Tensor& input) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&)>("oar::grad_x_input");
  return h.call(grad, input);
}

at::Tensor build_masked_batch(const at::Tensor& input_ids, const at::Tensor& row_index, const at::Tensor& positions,
                              int64_t pad_id) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(
      "oar::build_masked_batch");
  return h.call(input_ids, row_index, positions, pad_id);
}

}  // namespace oar

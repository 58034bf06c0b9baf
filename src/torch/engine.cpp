// The C++ OAR-P engine (include/oar/torch/engine.h): the batched masking engine of
// python/oar/attribution/oar_p.py (`_oar_p_batched`) for C++ callers, over oar::ProbeModel.
#include "oar/torch/engine.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "oar/core/log.h"
#include "oar/core/masked_batch.h"
#include "oar/torch/ops.h"

namespace oar {
namespace {

void check_vector(const at::Tensor& t, const char* name, int64_t B) {
  TORCH_CHECK_VALUE(t.defined(), "batch.", name, " must be defined");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == B && t.scalar_type() == at::kLong, "batch.", name,
                    " must be (B,) int64 with B = ", B, ", got ", t.sizes(), " ", t.scalar_type());
}

void check_matrix(const at::Tensor& t, const char* name, int64_t B, int64_t T) {
  TORCH_CHECK_VALUE(t.defined(), "batch.", name, " must be defined");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && (T < 0 || t.size(1) == T) && t.scalar_type() == at::kLong,
                    "batch.", name, " must be (B, ", T < 0 ? std::string("K") : std::to_string(T),
                    ") int64 with B = ", B, ", got ", t.sizes(), " ", t.scalar_type());
}

// Validates the batch; returns the CPU copies of the per-row vectors the planner reads.
struct RowInfo {
  std::vector<int64_t> start, len, context;
};

RowInfo check_batch(const ProbeBatch& b, const OarPOptions& o) {
  TORCH_CHECK_VALUE(b.input_ids.defined() && b.input_ids.dim() == 2 && b.input_ids.scalar_type() == at::kLong,
                    "batch.input_ids must be (B, T) int64, got ",
                    b.input_ids.defined() ? b.input_ids.sizes() : at::IntArrayRef{}, " ",
                    b.input_ids.defined() ? b.input_ids.scalar_type() : at::kLong);
  const int64_t B = b.input_ids.size(0), T = b.input_ids.size(1);
  check_matrix(b.attention_mask, "attention_mask", B, T);
  check_matrix(b.position_ids, "position_ids", B, T);
  check_matrix(b.answer_ids, "answer_ids", B, -1);
  check_vector(b.reasoning_start, "reasoning_start", B);
  check_vector(b.reasoning_len, "reasoning_len", B);
  check_vector(b.answer_len, "answer_len", B);
  check_vector(b.probe_start, "probe_start", B);
  const int64_t K = b.answer_ids.size(1);
  TORCH_CHECK_VALUE(b.keep >= 1 && b.keep <= T, "batch.keep must be in [1, T = ", T, "], got ", b.keep);
  TORCH_CHECK_VALUE(o.probe == "last" || o.probe == "answer_mean" || o.probe == "answer_joint",
                    "options.probe must be one of {last, answer_mean, answer_joint}, got '", o.probe, "'");
  TORCH_CHECK_VALUE(o.memory_budget_mb >= 1, "options.memory_budget_mb must be >= 1, got ", o.memory_budget_mb);
  TORCH_CHECK_VALUE(o.max_variants_per_chunk >= 0, "options.max_variants_per_chunk must be >= 0, got ",
                    o.max_variants_per_chunk);
  RowInfo info;
  const auto cpu = [](const at::Tensor& t) { return t.to(at::kCPU).contiguous(); };
  const at::Tensor start = cpu(b.reasoning_start), len = cpu(b.reasoning_len), alen = cpu(b.answer_len),
                   pstart = cpu(b.probe_start);
  const at::Tensor context = cpu(b.attention_mask.sum(1));
  for (int64_t r = 0; r < B; ++r) {
    const int64_t s = start.const_data_ptr<int64_t>()[r], L = len.const_data_ptr<int64_t>()[r];
    const int64_t a = alen.const_data_ptr<int64_t>()[r], p = pstart.const_data_ptr<int64_t>()[r];
    TORCH_CHECK_VALUE(L >= 0 && s >= 0 && s + L <= T, "batch.reasoning_start/reasoning_len of row ", r,
                      " must describe columns within [0, T = ", T, "), got start ", s, ", len ", L);
    TORCH_CHECK_VALUE(a >= 1 && a <= K, "batch.answer_len[", r, "] must be in [1, K = ", K, "], got ", a);
    TORCH_CHECK_VALUE(p >= 0 && p + a <= b.keep, "batch.probe_start[", r, "] + answer_len must be <= keep = ",
                      b.keep, ", got ", p, " + ", a);
    info.start.push_back(s);
    info.len.push_back(L);
    info.context.push_back(context.const_data_ptr<int64_t>()[r]);
  }
  return info;
}

// (n, K, V) probe logits from tail windows (n, keep, V): row i takes positions probe_start[i] + k (clamped
// to the window; positions past a row's answer length are ignored by probe_divergence through `lengths`).
at::Tensor gather_probe(const at::Tensor& window, const at::Tensor& probe_start, int64_t K) {
  const int64_t keep = window.size(1);
  at::Tensor idx = probe_start.to(window.device()).view({-1, 1}) +
                   at::arange(K, probe_start.options().device(window.device())).view({1, -1});
  idx = idx.clamp_max(keep - 1);
  return window.gather(1, idx.unsqueeze(-1).expand({-1, -1, window.size(2)}));
}

at::Tensor checked_logits(ProbeModel& model, const at::Tensor& ids, const at::Tensor& attn, const at::Tensor& pos,
                          int64_t keep, int64_t V) {
  at::Tensor w = model.tail_logits(ids, attn, pos, keep);
  TORCH_CHECK_VALUE(w.defined() && w.dim() == 3 && w.size(0) == ids.size(0) && w.size(1) == keep &&
                        w.size(2) == V && at::isFloatingType(w.scalar_type()),
                    "ProbeModel::tail_logits must return (B, keep, V) = (", ids.size(0), ", ", keep, ", ", V,
                    ") floating logits, got ", w.defined() ? w.sizes() : at::IntArrayRef{});
  return w;
}

}  // namespace

at::Tensor oar_p_scores(ProbeModel& model, const ProbeBatch& batch, const OarPOptions& options) {
  const RowInfo info = check_batch(batch, options);
  const int64_t B = batch.input_ids.size(0), T = batch.input_ids.size(1), K = batch.answer_ids.size(1);
  const int64_t V = model.vocab_size();
  TORCH_CHECK_VALUE(V >= 1, "ProbeModel::vocab_size() must be >= 1, got ", V);
  int64_t Lmax = 0;
  std::vector<int64_t> rows, widths, counts;
  for (int64_t r = 0; r < B; ++r) {
    Lmax = std::max(Lmax, info.len[r]);
    if (info.len[r] == 0) continue;
    rows.push_back(r);
    widths.push_back(info.context[r]);
    counts.push_back(info.len[r]);
  }
  at::Tensor scores = at::zeros({B, Lmax}, at::kFloat);
  if (rows.empty()) return scores;

  c10::InferenceMode no_grad_guard;  // no autograd graph for the probe forwards
  const at::Tensor rows_t = at::tensor(rows, at::kLong);
  const auto dev = batch.input_ids.device();
  // Clean probe logits of every scored row: one forward.
  const at::Tensor rows_dev = rows_t.to(dev);
  const at::Tensor clean_window =
      checked_logits(model, batch.input_ids.index_select(0, rows_dev), batch.attention_mask.index_select(0, rows_dev),
                     batch.position_ids.index_select(0, rows_dev), batch.keep, V);
  const at::Tensor clean = gather_probe(clean_window, batch.probe_start.index_select(0, rows_dev), K);

  // Flattened variants, rollout-major: (row, masked column, reasoning index j, index into `clean`).
  std::vector<int64_t> var_row, var_col, var_j, var_clean;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    for (int64_t j = 0; j < info.len[r]; ++j) {
      var_row.push_back(r);
      var_col.push_back(info.start[r] + j);
      var_j.push_back(j);
      var_clean.push_back(static_cast<int64_t>(i));
    }
  }
  core::MaskedPlanRequest req;
  req.context_len = widths;
  req.num_variants = counts;
  req.bytes_per_token = model.activation_bytes_per_token(*std::max_element(widths.begin(), widths.end()));
  TORCH_CHECK_VALUE(req.bytes_per_token >= 0, "ProbeModel::activation_bytes_per_token() must be >= 0, got ",
                    req.bytes_per_token);
  req.bytes_per_variant = 8 * batch.keep * V;
  req.memory_budget_bytes = options.memory_budget_mb * (int64_t{1} << 20);
  req.max_variants_per_chunk = options.max_variants_per_chunk;
  const auto plan = torch_ops::rethrow_as_value_error([&] { return core::plan_masked_chunks(req); });

  const at::Tensor row_t = at::tensor(var_row, at::kLong), col_t = at::tensor(var_col, at::kLong);
  const at::Tensor j_t = at::tensor(var_j, at::kLong), clean_t = at::tensor(var_clean, at::kLong);
  const bool joint = options.probe == "answer_joint";
  for (const auto& ch : plan) {
    const int64_t width = ch.max_context_len, off = T - width;  // left padding: contexts end at column T
    const at::Tensor ri = row_t.slice(0, ch.begin, ch.end), ri_dev = ri.to(dev);
    const at::Tensor masked = build_masked_batch(batch.input_ids.slice(1, off), ri_dev,
                                                 (col_t.slice(0, ch.begin, ch.end) - off).to(dev), batch.pad_id);
    const at::Tensor window =
        checked_logits(model, masked, batch.attention_mask.index_select(0, ri_dev).slice(1, off),
                       batch.position_ids.index_select(0, ri_dev).slice(1, off), batch.keep, V);
    const at::Tensor pert = gather_probe(window, batch.probe_start.index_select(0, ri_dev), K);
    const at::Tensor c = clean.index_select(0, clean_t.slice(0, ch.begin, ch.end).to(clean.device()));
    const at::Tensor lengths = batch.answer_len.index_select(0, ri_dev);
    std::optional<at::Tensor> answer_ids;
    if (joint) answer_ids = batch.answer_ids.index_select(0, ri_dev);
    at::Tensor d = probe_divergence(c.to(pert.scalar_type()), pert, answer_ids, lengths, options.probe).to(at::kCPU);
    const at::Tensor bad = d.isfinite().logical_not();
    if (bad.any().item<bool>()) {
      const int64_t k = bad.nonzero().select(0, 0).item<int64_t>();
      TORCH_CHECK_VALUE(false, "oar_p_scores: masking reasoning token ", j_t[ch.begin + k].item<int64_t>(),
                        " of row ", ri[k].item<int64_t>(), " gives a non-finite divergence (",
                        d[k].item<double>(), "): check the model's logits for NaN/Inf or -inf where the clean "
                        "distribution has mass");
    }
    if (joint) d = d.clamp_min(0.0);  // method.md section 2: I = max(0, phi_clean - phi_masked)
    scores.index_put_({ri, j_t.slice(0, ch.begin, ch.end)}, d.to(at::kFloat));
  }
  if (core::log::enabled(core::log::Level::kInfo))
    core::log::info("oar_p_scores (C++ engine, batched masking): " + std::to_string(rows.size()) + " rows, " +
                    std::to_string(var_row.size()) + " variants in " + std::to_string(plan.size()) + " chunks, " +
                    std::to_string(plan.size() + 1) + " forwards, probe " + options.probe);
  return scores;
}

}  // namespace oar

// OAR-P masked batches (method.md section 3): one PAD substitution per variant, and the chunk planner
// that keeps each batch of variants under a memory budget.
#include "oar/core/masked_batch.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "oar/core/common.h"
#include "oar/core/log.h"

namespace oar::core {

void build_masked_batch(const int64_t* input_ids, int64_t B, int64_t T_len, const int64_t* row_index,
                        const int64_t* positions, int64_t M, int64_t pad_id, int64_t* out) {
  if (B < 0 || T_len < 0 || M < 0)
    throw InvalidArgument("build_masked_batch: sizes must be >= 0, got B=" + std::to_string(B) +
                          ", T=" + std::to_string(T_len) + ", M=" + std::to_string(M));
  // Validate everything before writing so a bad entry leaves `out` untouched.
  for (int64_t m = 0; m < M; ++m) {
    if (row_index[m] < 0 || row_index[m] >= B)
      throw InvalidArgument("row_index[" + std::to_string(m) + "] must be in [0, B=" + std::to_string(B) +
                            "), got " + std::to_string(row_index[m]));
    if (positions[m] < 0 || positions[m] >= T_len)
      throw InvalidArgument("positions[" + std::to_string(m) + "] must be in [0, T=" + std::to_string(T_len) +
                            "), got " + std::to_string(positions[m]));
  }
  if (T_len == 0) return;
  for (int64_t m = 0; m < M; ++m) {
    int64_t* dst = out + m * T_len;
    std::memcpy(dst, input_ids + row_index[m] * T_len, static_cast<size_t>(T_len) * sizeof(int64_t));
    dst[positions[m]] = pad_id;
  }
}

namespace {

void require_non_negative(int64_t v, const std::string& name) {
  if (v < 0) throw InvalidArgument(name + " must be >= 0, got " + std::to_string(v));
}

std::string str(int64_t v) { return std::to_string(v); }

// Debug line of a masked plan: what a user tuning memory_budget_mb / max_variants_per_chunk needs to see.
void log_masked_plan(const MaskedPlanRequest& req, const std::vector<MaskedChunk>& plan) {
  int64_t variants = 0, most = 0, narrow = 0, wide = 0;
  for (const auto& c : plan) {
    variants += c.end - c.begin;
    most = std::max(most, c.end - c.begin);
    narrow = narrow == 0 ? c.max_context_len : std::min(narrow, c.max_context_len);
    wide = std::max(wide, c.max_context_len);
  }
  log::debug("plan_masked_chunks: " + str(variants) + " variants of " + str(int64_t(req.context_len.size())) +
             " rollouts -> " + str(int64_t(plan.size())) + " chunks, at most " + str(most) +
             " variants per chunk, padded widths " + str(narrow) + ".." + str(wide) + " tokens; budget " +
             str(req.memory_budget_bytes) + " B, " + str(req.bytes_per_token) + " B/token, " +
             str(req.bytes_per_variant) + " B/variant, variant cap " + str(req.max_variants_per_chunk) +
             " (0 = none)");
}

// Debug line of a prefix plan: chunk count and sizes, and the prefixes the chunks reuse.
void log_prefix_plan(const PrefixPlanRequest& req, const std::vector<PrefixChunk>& plan) {
  int64_t most = 0, shortest = plan.empty() ? 0 : plan.front().prefix_len, longest = 0;
  for (const auto& c : plan) {
    most = std::max(most, c.end - c.begin);
    shortest = std::min(shortest, c.prefix_len);
    longest = std::max(longest, c.prefix_len);
  }
  log::debug("plan_prefix_chunks: " + str(int64_t(req.columns.size())) + " variants, width " + str(req.width) +
             " -> " + str(int64_t(plan.size())) + " chunks, at most " + str(most) +
             " variants per chunk, prefix lengths " + str(shortest) + ".." + str(longest) + " tokens; budget " +
             str(req.memory_budget_bytes) + " B, " + str(req.bytes_per_token) + " B/token, " +
             str(req.kv_bytes_per_token) + " B/cached token, " + str(req.bytes_per_variant) + " B/variant, variant cap " +
             str(req.max_variants_per_chunk) + " (0 = none), max_prefix_waste " + std::to_string(req.max_prefix_waste));
}

}  // namespace

std::vector<MaskedChunk> plan_masked_chunks(const MaskedPlanRequest& req) {
  if (req.context_len.size() != req.num_variants.size())
    throw InvalidArgument("num_variants must have one entry per rollout like context_len (" +
                          std::to_string(req.context_len.size()) + "), got " +
                          std::to_string(req.num_variants.size()));
  require_non_negative(req.bytes_per_token, "bytes_per_token");
  require_non_negative(req.bytes_per_variant, "bytes_per_variant");
  require_non_negative(req.max_variants_per_chunk, "max_variants_per_chunk");
  if (req.memory_budget_bytes <= 0)
    throw InvalidArgument("memory_budget_bytes must be > 0, got " + std::to_string(req.memory_budget_bytes));
  for (size_t r = 0; r < req.context_len.size(); ++r) {
    require_non_negative(req.context_len[r], "context_len[" + std::to_string(r) + "]");
    require_non_negative(req.num_variants[r], "num_variants[" + std::to_string(r) + "]");
  }

  // Cost of a chunk of `count` variants padded to `width` tokens. Computed in long double: the product
  // variants x width x bytes can exceed int64 for absurd inputs, and the comparison must stay monotone.
  auto cost = [&](int64_t count, int64_t width) {
    return static_cast<long double>(count) *
           (static_cast<long double>(width) * static_cast<long double>(req.bytes_per_token) +
            static_cast<long double>(req.bytes_per_variant));
  };
  const long double budget = static_cast<long double>(req.memory_budget_bytes);

  std::vector<MaskedChunk> plan;
  MaskedChunk cur;
  int64_t flat = 0;  // index of the next variant in the flattened list
  bool open = false;
  for (size_t r = 0; r < req.context_len.size(); ++r) {
    const int64_t len = req.context_len[r];
    for (int64_t k = 0; k < req.num_variants[r]; ++k, ++flat) {
      if (open) {
        const int64_t count = cur.end - cur.begin + 1;
        const int64_t width = std::max(cur.max_context_len, len);
        const bool over_count = req.max_variants_per_chunk > 0 && count > req.max_variants_per_chunk;
        if (!over_count && cost(count, width) <= budget) {
          cur.end = flat + 1;
          cur.max_context_len = width;
          continue;
        }
        plan.push_back(cur);
      }
      // A new chunk always takes its first variant, even when that variant alone exceeds the budget:
      // the caller then runs it alone (and may OOM), which beats refusing to plan.
      cur = MaskedChunk{flat, flat + 1, len};
      open = true;
    }
  }
  if (open) plan.push_back(cur);
  if (log::enabled(log::Level::kDebug)) log_masked_plan(req, plan);
  return plan;
}

std::vector<PrefixChunk> plan_prefix_chunks(const PrefixPlanRequest& req) {
  require_non_negative(req.width, "width");
  require_non_negative(req.bytes_per_token, "bytes_per_token");
  require_non_negative(req.kv_bytes_per_token, "kv_bytes_per_token");
  require_non_negative(req.bytes_per_variant, "bytes_per_variant");
  require_non_negative(req.max_variants_per_chunk, "max_variants_per_chunk");
  if (req.memory_budget_bytes <= 0)
    throw InvalidArgument("memory_budget_bytes must be > 0, got " + std::to_string(req.memory_budget_bytes));
  if (!(req.max_prefix_waste > 0.0 && req.max_prefix_waste <= 1.0))
    throw InvalidArgument("max_prefix_waste must be in (0, 1], got " + std::to_string(req.max_prefix_waste));
  const auto& col = req.columns;
  for (size_t i = 0; i < col.size(); ++i) {
    if (col[i] < 0 || col[i] >= req.width)
      throw InvalidArgument("columns[" + std::to_string(i) + "] must be in [0, width = " + std::to_string(req.width) +
                            "), got " + std::to_string(col[i]));
    if (i > 0 && col[i] < col[i - 1])
      throw InvalidArgument("columns must be sorted (non-decreasing), but columns[" + std::to_string(i) + "] = " +
                            std::to_string(col[i]) + " < columns[" + std::to_string(i - 1) + "] = " +
                            std::to_string(col[i - 1]));
  }
  const long double budget = static_cast<long double>(req.memory_budget_bytes);
  // Per-variant cost of a chunk whose prefix is p (long double: products may exceed int64).
  auto per_variant = [&](int64_t p) {
    return static_cast<long double>(req.width - p) * static_cast<long double>(req.bytes_per_token) +
           static_cast<long double>(p) * static_cast<long double>(req.kv_bytes_per_token) +
           static_cast<long double>(req.bytes_per_variant);
  };
  std::vector<PrefixChunk> plan;
  const int64_t n = static_cast<int64_t>(col.size());
  int64_t i = 0;
  while (i < n) {
    PrefixChunk c{i, i + 1, col[static_cast<size_t>(i)]};
    const long double each = per_variant(c.prefix_len);
    const long double waste_limit = req.max_prefix_waste * static_cast<long double>(req.width - c.prefix_len);
    while (c.end < n) {
      const int64_t count = c.end - c.begin + 1;
      if (req.max_variants_per_chunk > 0 && count > req.max_variants_per_chunk) break;
      if (static_cast<long double>(count) * each > budget) break;
      if (static_cast<long double>(col[static_cast<size_t>(c.end)] - c.prefix_len) > waste_limit) break;
      ++c.end;
    }
    plan.push_back(c);
    i = c.end;
  }
  if (log::enabled(log::Level::kDebug)) log_prefix_plan(req, plan);
  return plan;
}

}  // namespace oar::core

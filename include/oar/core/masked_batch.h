// OAR-P: building and planning the batch of single-token PAD substitutions (method.md section 3).
#pragma once

#include <cstdint>
#include <vector>

namespace oar::core {

/// out[m, :] = input_ids[row_index[m], :] with out[m, positions[m]] = pad_id, for m < M.
/// input_ids is (B, T) row-major; out is (M, T). Throws InvalidArgument on an out-of-range row or position.
void build_masked_batch(const int64_t* input_ids, int64_t B, int64_t T_len, const int64_t* row_index,
                        const int64_t* positions, int64_t M, int64_t pad_id, int64_t* out);

/// One chunk of the OAR-P variant list: variants [begin, end) of the flattened list in which rollout r
/// contributes num_variants[r] consecutive entries (rollout 0 first).
struct MaskedChunk {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t max_context_len = 0;  ///< longest probe context in the chunk (the padded width)
};

/// Inputs of the planner. Memory is estimated as (variants x padded width x bytes_per_token)
/// + variants x bytes_per_variant, and kept under memory_budget_bytes.
struct MaskedPlanRequest {
  std::vector<int64_t> context_len;   ///< probe-context length of each rollout (tokens)
  std::vector<int64_t> num_variants;  ///< masked positions of each rollout (|R|)
  int64_t bytes_per_token = 0;        ///< activation bytes one context token costs in a forward pass
  int64_t bytes_per_variant = 0;      ///< per-variant bytes independent of length (e.g. probe logits S x V x 4)
  int64_t memory_budget_bytes = 0;    ///< > 0
  int64_t max_variants_per_chunk = 0; ///< 0 = unlimited
};

/// Greedy plan over the flattened variants: each chunk is as large as the budget allows (at least one
/// variant, even when one variant alone exceeds the budget). Throws InvalidArgument naming the field on
/// negative sizes, mismatched vector lengths or a non-positive budget.
std::vector<MaskedChunk> plan_masked_chunks(const MaskedPlanRequest& req);

/// One chunk of the prefix-cached OAR-P plan: variants [begin, end) of the column-sorted variant list run
/// as one forward over columns [prefix_len, width) on top of the clean key/value cache of columns
/// [0, prefix_len). prefix_len is the smallest masked column in the chunk.
struct PrefixChunk {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t prefix_len = 0;
};

/// Inputs of the prefix planner (issue 3: masked variant t shares the clean prefix before t).
/// Memory of a chunk of m variants with prefix p is estimated as
///   m x ((width - p) x bytes_per_token + p x kv_bytes_per_token + bytes_per_variant).
struct PrefixPlanRequest {
  std::vector<int64_t> columns;       ///< masked column of each variant, non-decreasing, each in [0, width)
  int64_t width = 0;                  ///< padded context width T
  int64_t bytes_per_token = 0;        ///< activation bytes per processed (suffix) token
  int64_t kv_bytes_per_token = 0;     ///< key+value cache bytes per prefix token and variant
  int64_t bytes_per_variant = 0;      ///< probe logits etc.
  int64_t memory_budget_bytes = 0;    ///< > 0
  int64_t max_variants_per_chunk = 0; ///< 0 = unlimited
  /// A chunk is closed when the next variant's column exceeds prefix_len by more than this fraction of the
  /// chunk's suffix (width - prefix_len): bounds the tokens recomputed in vain. In (0, 1].
  double max_prefix_waste = 0.1;
};

/// Greedy plan over the column-sorted variants. Each chunk takes at least one variant. Throws
/// InvalidArgument naming the field on unsorted or out-of-range columns, negative sizes, a non-positive
/// budget or max_prefix_waste outside (0, 1].
std::vector<PrefixChunk> plan_prefix_chunks(const PrefixPlanRequest& req);

}  // namespace oar::core

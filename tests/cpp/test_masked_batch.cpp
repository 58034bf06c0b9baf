// OAR-P masked batches and the chunk planner (method.md section 3).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "oar/core/common.h"
#include "oar/core/masked_batch.h"
#include "test_util.h"

using oar::testing::expect_invalid;

namespace {

using oar::core::InvalidArgument;
using oar::core::MaskedChunk;
using oar::core::MaskedPlanRequest;


TEST(MaskedBatch, OneSubstitutionPerVariant) {
  const int64_t B = 3, T = 5;
  std::vector<int64_t> ids(B * T);
  std::iota(ids.begin(), ids.end(), 100);  // row b = 100 + 5b ... 104 + 5b
  const std::vector<int64_t> rows = {2, 0, 0, 1};
  const std::vector<int64_t> pos = {4, 0, 3, 2};
  const int64_t pad = -7, M = 4;
  std::vector<int64_t> out(M * T, 0);
  oar::core::build_masked_batch(ids.data(), B, T, rows.data(), pos.data(), M, pad, out.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t want = t == pos[m] ? pad : 100 + 5 * rows[m] + t;
      EXPECT_EQ(out[m * T + t], want) << "m=" << m << " t=" << t;
    }
}

TEST(MaskedBatch, EmptyAndErrors) {
  const std::vector<int64_t> ids = {1, 2, 3, 4};
  EXPECT_NO_THROW(oar::core::build_masked_batch(ids.data(), 2, 2, nullptr, nullptr, 0, 0, nullptr));
  std::vector<int64_t> out(4, 55);
  const std::vector<int64_t> ok_rows = {0, 1}, bad_rows = {0, 2}, ok_pos = {1, 0}, bad_pos = {-1, 0};
  auto run = [&](int64_t B, const std::vector<int64_t>& rows, const std::vector<int64_t>& pos) {
    oar::core::build_masked_batch(ids.data(), B, 2, rows.data(), pos.data(), 2, 0, out.data());
  };
  expect_invalid([&] { run(2, bad_rows, ok_pos); }, "row_index[1] must be in [0, B=2), got 2");
  expect_invalid([&] { run(2, ok_rows, bad_pos); }, "positions[0] must be in [0, T=2), got -1");
  // Validation happens before any write.
  for (int64_t v : out) EXPECT_EQ(v, 55);
  expect_invalid([&] { run(-1, ok_rows, ok_pos); }, "sizes must be >= 0");
}

// Checks the planner's contract on `req`: chunks tile [0, total) in order, each within the budget and the
// count cap unless it holds a single variant, max_context_len is the longest context in the chunk, and
// greedy maximality (the next variant would not have fit).
void check_plan(const MaskedPlanRequest& req, const std::vector<MaskedChunk>& plan) {
  std::vector<int64_t> owner;  // flattened variant -> rollout
  for (size_t r = 0; r < req.num_variants.size(); ++r)
    for (int64_t k = 0; k < req.num_variants[r]; ++k) owner.push_back(static_cast<int64_t>(r));
  const int64_t total = static_cast<int64_t>(owner.size());
  auto width_of = [&](int64_t b, int64_t e) {
    int64_t w = 0;
    for (int64_t i = b; i < e; ++i) w = std::max(w, req.context_len[owner[i]]);
    return w;
  };
  auto cost = [&](int64_t b, int64_t e) {
    return static_cast<double>(e - b) *
           (static_cast<double>(width_of(b, e)) * req.bytes_per_token + req.bytes_per_variant);
  };
  int64_t next = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto& c = plan[i];
    ASSERT_EQ(c.begin, next) << "chunk " << i;
    ASSERT_GT(c.end, c.begin) << "chunk " << i;
    EXPECT_EQ(c.max_context_len, width_of(c.begin, c.end)) << "chunk " << i;
    if (c.end - c.begin > 1) {
      EXPECT_LE(cost(c.begin, c.end), static_cast<double>(req.memory_budget_bytes)) << "chunk " << i;
      if (req.max_variants_per_chunk > 0) EXPECT_LE(c.end - c.begin, req.max_variants_per_chunk);
    }
    if (c.end < total) {
      const bool fits = cost(c.begin, c.end + 1) <= static_cast<double>(req.memory_budget_bytes) &&
                        (req.max_variants_per_chunk == 0 || c.end + 1 - c.begin <= req.max_variants_per_chunk);
      EXPECT_FALSE(fits) << "chunk " << i << " stopped although the next variant fits";
    }
    next = c.end;
  }
  EXPECT_EQ(next, total);
}

TEST(MaskedPlan, HandExample) {
  // Costs: bytes_per_token 1, bytes_per_variant 0, budget 30.
  // Rollout 0: 3 variants of length 10 -> chunk [0, 3) costs 30 (fits exactly).
  // Rollout 1: 2 variants of length 12 -> [3, 5) costs 24; adding rollout 2's length-4 variant: 3 x 12 = 36.
  MaskedPlanRequest req;
  req.context_len = {10, 12, 4};
  req.num_variants = {3, 2, 5};
  req.bytes_per_token = 1;
  req.memory_budget_bytes = 30;
  const auto plan = oar::core::plan_masked_chunks(req);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].begin, 0);
  EXPECT_EQ(plan[0].end, 3);
  EXPECT_EQ(plan[0].max_context_len, 10);
  EXPECT_EQ(plan[1].begin, 3);
  EXPECT_EQ(plan[1].end, 5);
  EXPECT_EQ(plan[1].max_context_len, 12);
  EXPECT_EQ(plan[2].begin, 5);
  EXPECT_EQ(plan[2].end, 10);  // 5 x 4 = 20 <= 30
  EXPECT_EQ(plan[2].max_context_len, 4);
  check_plan(req, plan);
}

TEST(MaskedPlan, OverBudgetVariantIsPlannedAlone) {
  MaskedPlanRequest req;
  req.context_len = {5, 1000, 5};
  req.num_variants = {2, 2, 1};
  req.bytes_per_token = 4;
  req.bytes_per_variant = 10;
  req.memory_budget_bytes = 100;  // one length-1000 variant costs 4010
  const auto plan = oar::core::plan_masked_chunks(req);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].end, 2);
  EXPECT_EQ(plan[1].begin, 2);
  EXPECT_EQ(plan[1].end, 3);
  EXPECT_EQ(plan[2].begin, 3);
  EXPECT_EQ(plan[2].end, 4);
  EXPECT_EQ(plan[3].begin, 4);
  EXPECT_EQ(plan[3].end, 5);
  check_plan(req, plan);
}

TEST(MaskedPlan, CountCapAndEmptyRollouts) {
  MaskedPlanRequest req;
  req.context_len = {8, 8, 8};
  req.num_variants = {4, 0, 3};  // rollout 1 contributes nothing
  req.bytes_per_token = 1;
  req.memory_budget_bytes = 1 << 20;
  req.max_variants_per_chunk = 3;
  const auto plan = oar::core::plan_masked_chunks(req);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].end, 3);
  EXPECT_EQ(plan[1].end, 6);
  EXPECT_EQ(plan[2].end, 7);
  check_plan(req, plan);
  MaskedPlanRequest none;
  none.memory_budget_bytes = 1;
  EXPECT_TRUE(oar::core::plan_masked_chunks(none).empty());
}

TEST(MaskedPlan, RandomRequestsSatisfyTheContract) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    MaskedPlanRequest req;
    const int R = std::uniform_int_distribution<int>(0, 12)(rng);
    for (int r = 0; r < R; ++r) {
      req.context_len.push_back(std::uniform_int_distribution<int64_t>(0, 300)(rng));
      req.num_variants.push_back(std::uniform_int_distribution<int64_t>(0, 40)(rng));
    }
    req.bytes_per_token = std::uniform_int_distribution<int64_t>(0, 64)(rng);
    req.bytes_per_variant = std::uniform_int_distribution<int64_t>(0, 5000)(rng);
    req.memory_budget_bytes = std::uniform_int_distribution<int64_t>(1, 200000)(rng);
    req.max_variants_per_chunk = std::uniform_int_distribution<int64_t>(0, 16)(rng);
    check_plan(req, oar::core::plan_masked_chunks(req));
  }
}

TEST(MaskedPlan, BadFieldsThrowNamingTheField) {
  MaskedPlanRequest base;
  base.context_len = {4, 5};
  base.num_variants = {1, 2};
  base.bytes_per_token = 1;
  base.memory_budget_bytes = 100;
  auto with = [&](auto edit) {
    MaskedPlanRequest r = base;
    edit(r);
    return r;
  };
  auto plan_with = [&](auto edit) { oar::core::plan_masked_chunks(with(edit)); };
  expect_invalid([&] { plan_with([](auto& r) { r.num_variants = {1}; }); }, "num_variants");
  expect_invalid([&] { plan_with([](auto& r) { r.memory_budget_bytes = 0; }); },
                 "memory_budget_bytes must be > 0, got 0");
  expect_invalid([&] { plan_with([](auto& r) { r.bytes_per_token = -1; }); }, "bytes_per_token");
  expect_invalid([&] { plan_with([](auto& r) { r.bytes_per_variant = -2; }); }, "bytes_per_variant");
  expect_invalid([&] { plan_with([](auto& r) { r.max_variants_per_chunk = -1; }); }, "max_variants_per_chunk");
  expect_invalid([&] { plan_with([](auto& r) { r.context_len[1] = -5; }); }, "context_len[1]");
  expect_invalid([&] { plan_with([](auto& r) { r.num_variants[0] = -1; }); }, "num_variants[0]");
}

}  // namespace

// ---- prefix planner (issue 3) ----------------------------------------------------------------------------

namespace {

oar::core::PrefixPlanRequest prefix_req(std::vector<int64_t> cols, int64_t width, int64_t budget) {
  oar::core::PrefixPlanRequest r;
  r.columns = std::move(cols);
  r.width = width;
  r.bytes_per_token = 10;
  r.kv_bytes_per_token = 1;
  r.bytes_per_variant = 0;
  r.memory_budget_bytes = budget;
  return r;
}

}  // namespace

TEST(PrefixPlan, CoversEveryVariantOnceInOrderWithMinColumnPrefix) {
  auto req = prefix_req({3, 3, 4, 5, 5, 9, 12, 12, 13}, 20, 1000000);
  req.max_prefix_waste = 0.25;
  const auto plan = oar::core::plan_prefix_chunks(req);
  int64_t next = 0;
  for (const auto& c : plan) {
    EXPECT_EQ(c.begin, next);
    EXPECT_GT(c.end, c.begin);
    EXPECT_EQ(c.prefix_len, req.columns[static_cast<size_t>(c.begin)]);
    for (int64_t i = c.begin; i < c.end; ++i) {
      EXPECT_GE(req.columns[static_cast<size_t>(i)], c.prefix_len);
      // waste bound: column - prefix <= 0.25 * (width - prefix)
      EXPECT_LE(4 * (req.columns[static_cast<size_t>(i)] - c.prefix_len), req.width - c.prefix_len);
    }
    next = c.end;
  }
  EXPECT_EQ(next, 9);
  // width 20, prefix 3: suffix 17, waste limit 4.25 -> columns 3..5 join, 9 starts a new chunk
  EXPECT_EQ(plan[0].end, 5);
}

TEST(PrefixPlan, BudgetAndCapAreRespected) {
  // per-variant cost at prefix 2: (10 - 2) * 10 + 2 * 1 = 82 -> 2 variants fit in 200
  auto req = prefix_req({2, 2, 2, 2, 2}, 10, 200);
  auto plan = oar::core::plan_prefix_chunks(req);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].end - plan[0].begin, 2);
  req.memory_budget_bytes = 1;  // even one variant is over budget: still planned, alone
  plan = oar::core::plan_prefix_chunks(req);
  EXPECT_EQ(plan.size(), 5u);
  req.memory_budget_bytes = 1 << 30;
  req.max_variants_per_chunk = 4;
  plan = oar::core::plan_prefix_chunks(req);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].end, 4);
  EXPECT_TRUE(oar::core::plan_prefix_chunks(prefix_req({}, 10, 100)).empty());
}

TEST(PrefixPlan, ErrorsNameTheField) {
  expect_invalid([] { oar::core::plan_prefix_chunks(prefix_req({3, 2}, 10, 100)); }, "columns must be sorted");
  expect_invalid([] { oar::core::plan_prefix_chunks(prefix_req({10}, 10, 100)); }, "columns[0] must be in [0, width = 10)");
  expect_invalid([] { oar::core::plan_prefix_chunks(prefix_req({1}, 10, 0)); }, "memory_budget_bytes must be > 0");
  auto r = prefix_req({1}, 10, 100);
  r.max_prefix_waste = 0.0;
  expect_invalid([&] { oar::core::plan_prefix_chunks(r); }, "max_prefix_waste");
  r = prefix_req({1}, 10, 100);
  r.kv_bytes_per_token = -1;
  expect_invalid([&] { oar::core::plan_prefix_chunks(r); }, "kv_bytes_per_token");
}

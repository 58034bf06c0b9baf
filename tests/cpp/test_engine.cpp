// The C++ OAR-P engine (include/oar/torch/engine.h) against the definition: mask each reasoning token in
// its own forward and take the probe divergence in double precision.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "oar/torch/engine.h"

namespace {

// A causal toy LM: h_t = tanh(mean_{s <= t, attended} (E[id_s] + P[pos_s])), logits = h W. Masking a token
// (replacing its id by pad) changes every later position, like a transformer.
class ToyModel : public oar::ProbeModel {
 public:
  ToyModel(int64_t V, int64_t H, int64_t max_pos) : V_(V), H_(H) {
    at::manual_seed(0);
    emb_ = at::randn({V, H}, at::kDouble);
    pos_ = at::randn({max_pos, H}, at::kDouble) * 0.1;
    w_ = at::randn({H, V}, at::kDouble) * 2.0;
  }
  int64_t vocab_size() const override { return V_; }
  // embedding, position embedding and running mean: three (H,) double vectors per token
  int64_t activation_bytes_per_token(int64_t /*width*/) const override { return 3 * H_ * 8; }
  at::Tensor tail_logits(const at::Tensor& ids, const at::Tensor& attn, const at::Tensor& pos,
                         int64_t keep) override {
    ++calls;
    const at::Tensor m = attn.to(at::kDouble).unsqueeze(-1);
    const at::Tensor e = (emb_.index_select(0, ids.flatten()).view({ids.size(0), ids.size(1), -1}) +
                          pos_.index_select(0, pos.flatten()).view({ids.size(0), ids.size(1), -1})) * m;
    const at::Tensor h = at::tanh(e.cumsum(1) / m.cumsum(1).clamp_min(1.0));
    return at::matmul(h.slice(1, ids.size(1) - keep), w_).to(at::kFloat);
  }
  int calls = 0;

 private:
  int64_t V_, H_;
  at::Tensor emb_, pos_, w_;
};

// Three left-padded rows: context lengths 12, 9, 10; answers of 2, 1, 2 tokens at the end of each context.
oar::ProbeBatch make_batch(int64_t V) {
  const int64_t B = 3, T = 12, K = 2, keep = K + 1;
  const std::vector<int64_t> ctx{12, 9, 10}, rstart_rel{2, 1, 3}, rlen{6, 5, 0}, alen{2, 1, 2};
  oar::ProbeBatch b;
  at::manual_seed(1);
  b.input_ids = at::zeros({B, T}, at::kLong);
  b.attention_mask = at::zeros({B, T}, at::kLong);
  b.position_ids = at::zeros({B, T}, at::kLong);
  b.answer_ids = at::zeros({B, K}, at::kLong);
  b.reasoning_start = at::zeros({B}, at::kLong);
  b.reasoning_len = at::tensor(rlen, at::kLong);
  b.answer_len = at::tensor(alen, at::kLong);
  b.probe_start = at::zeros({B}, at::kLong);
  b.keep = keep;
  b.pad_id = 0;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t off = T - ctx[r];
    b.input_ids[r].slice(0, off) = at::randint(1, V, {ctx[r]}, at::kLong);
    b.attention_mask[r].slice(0, off) = 1;
    b.position_ids[r].slice(0, off) = at::arange(ctx[r], at::kLong);
    b.reasoning_start[r] = off + rstart_rel[r];
    b.answer_ids[r].slice(0, 0, alen[r]) = b.input_ids[r].slice(0, T - alen[r]);
    b.probe_start[r] = keep - alen[r] - 1;  // the window position predicting answer token 0
  }
  return b;
}

// The definition, one masked context per forward, in double.
double reference_score(ToyModel& model, const oar::ProbeBatch& b, int64_t r, int64_t j, const std::string& probe) {
  const at::Tensor ids = b.input_ids.slice(0, r, r + 1).clone();
  const auto window = [&](const at::Tensor& x) {
    return model.tail_logits(x, b.attention_mask.slice(0, r, r + 1), b.position_ids.slice(0, r, r + 1), b.keep)
        .to(at::kDouble)[0];
  };
  const at::Tensor clean = window(ids);
  ids[0][b.reasoning_start[r].item<int64_t>() + j] = b.pad_id;
  const at::Tensor masked = window(ids);
  const int64_t p0 = b.probe_start[r].item<int64_t>(), a = b.answer_len[r].item<int64_t>();
  const at::Tensor zc = clean.slice(0, p0, p0 + a), zm = masked.slice(0, p0, p0 + a);
  if (probe == "answer_joint") {
    const at::Tensor ans = b.answer_ids[r].slice(0, 0, a).unsqueeze(-1);
    const double phi_c = at::log_softmax(zc, -1).gather(1, ans).mean().item<double>();
    const double phi_m = at::log_softmax(zm, -1).gather(1, ans).mean().item<double>();
    return std::max(0.0, phi_c - phi_m);
  }
  const at::Tensor lc = at::log_softmax(probe == "last" ? zc[0] : zc.mean(0), -1);
  const at::Tensor lm = at::log_softmax(probe == "last" ? zm[0] : zm.mean(0), -1);
  return (lc.exp() * (lc - lm)).sum().item<double>();
}

class EngineTest : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {};

TEST_P(EngineTest, MatchesOneForwardPerMaskedToken) {
  const auto [probe, budget_mb] = GetParam();
  ToyModel model(/*V=*/97, /*H=*/16, /*max_pos=*/32);
  const oar::ProbeBatch b = make_batch(97);
  oar::OarPOptions o;
  o.probe = probe;
  o.memory_budget_mb = budget_mb;
  o.max_variants_per_chunk = budget_mb == 1 ? 3 : 0;  // several chunks with the small setting
  const at::Tensor s = oar::oar_p_scores(model, b, o);
  ASSERT_EQ(s.sizes(), (at::IntArrayRef{3, 6}));
  ASSERT_EQ(s.scalar_type(), at::kFloat);
  const int chunked_calls = model.calls;
  EXPECT_EQ(chunked_calls, budget_mb == 1 ? 1 + 4 : 2);  // clean pass + ceil(11 variants / 3) or one chunk
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t L = b.reasoning_len[r].item<int64_t>();
    for (int64_t j = 0; j < 6; ++j) {
      if (j >= L) {
        EXPECT_EQ(s[r][j].item<float>(), 0.0f) << "row " << r << " j " << j;
        continue;
      }
      const double ref = reference_score(model, b, r, j, probe);
      EXPECT_NEAR(s[r][j].item<float>(), ref, 1e-5 + 1e-4 * std::abs(ref)) << probe << " row " << r << " j " << j;
    }
  }
  // Not all zero: the scores carry information.
  EXPECT_GT(s.abs().sum().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Probes, EngineTest,
                         ::testing::Combine(::testing::Values("last", "answer_mean", "answer_joint"),
                                            ::testing::Values(int64_t{1}, int64_t{1024})));

TEST(EngineErrors, NameTheArgument) {
  ToyModel model(97, 16, 32);
  oar::ProbeBatch b = make_batch(97);
  const auto message = [&](const oar::ProbeBatch& batch, const oar::OarPOptions& o) -> std::string {
    try {
      oar::oar_p_scores(model, batch, o);
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  oar::OarPOptions bad_probe;
  bad_probe.probe = "mean";
  EXPECT_NE(message(b, bad_probe).find("options.probe"), std::string::npos);
  oar::OarPOptions bad_budget;
  bad_budget.memory_budget_mb = 0;
  EXPECT_NE(message(b, bad_budget).find("memory_budget_mb"), std::string::npos);
  oar::ProbeBatch short_len = b;
  short_len.reasoning_len = at::tensor({6, 50, 0}, at::kLong);
  EXPECT_NE(message(short_len, {}).find("reasoning_len of row 1"), std::string::npos);
  oar::ProbeBatch bad_dtype = b;
  bad_dtype.attention_mask = b.attention_mask.to(at::kFloat);
  EXPECT_NE(message(bad_dtype, {}).find("batch.attention_mask"), std::string::npos);
}

}  // namespace

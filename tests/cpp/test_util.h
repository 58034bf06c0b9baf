// Helpers shared by the GoogleTest files.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "oar/core/common.h"

namespace oar::testing {

/// Runs `fn` and returns the oar::core::InvalidArgument message it threw ("" when nothing was thrown).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const oar::core::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

/// Expects `fn` to throw oar::core::InvalidArgument whose message contains `needle`.
template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  const std::string msg = error_of(fn);
  if (msg.empty()) {
    ADD_FAILURE() << "expected InvalidArgument mentioning '" << needle << "'";
    return;
  }
  EXPECT_NE(msg.find(needle), std::string::npos) << "message was: " << msg;
}

}  // namespace oar::testing

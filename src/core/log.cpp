#include "oar/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_set>

namespace oar::core::log {
namespace {

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> lg = [] {
    auto l = spdlog::get("oar");
    if (!l) l = spdlog::stderr_color_mt("oar");
    l->set_pattern("[oar %L] %v");
    spdlog::level::level_enum lvl = spdlog::level::warn;
    if (const char* env = std::getenv("OAR_LOG_LEVEL")) lvl = spdlog::level::from_str(env);
    l->set_level(lvl);
    return l;
  }();
  return lg;
}

}  // namespace

void set_level(Level level) { logger()->set_level(static_cast<spdlog::level::level_enum>(level)); }
Level level() { return static_cast<Level>(logger()->level()); }
void debug(const std::string& msg) { logger()->debug(msg); }
void info(const std::string& msg) { logger()->info(msg); }
void warn(const std::string& msg) { logger()->warn(msg); }

void warn_once(const std::string& key, const std::string& msg) {
  static std::mutex mu;
  static std::unordered_set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(key).second) return;
  }
  logger()->warn(msg);
}

}  // namespace oar::core::log

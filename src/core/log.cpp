#include "oar/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>

namespace oar::core::log {
namespace {

constexpr std::pair<const char*, Level> kLevels[] = {{"trace", Level::kTrace}, {"debug", Level::kDebug},
                                                     {"info", Level::kInfo},   {"warn", Level::kWarn},
                                                     {"error", Level::kError}, {"off", Level::kOff}};

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> lg = [] {
    auto l = spdlog::get("oar");
    if (!l) l = spdlog::stderr_color_mt("oar");
    l->set_pattern("[oar %L] %v");
    l->set_level(spdlog::level::warn);
    if (const char* env = std::getenv("OAR_LOG_LEVEL")) {
      if (const auto lvl = parse_level(env)) {
        l->set_level(static_cast<spdlog::level::level_enum>(*lvl));
      } else {
        l->warn("OAR_LOG_LEVEL must be one of {}, got \"{}\"; logging at warn", level_names(), env);
      }
    }
    return l;
  }();
  return lg;
}

}  // namespace

const char* to_string(Level level) {
  for (const auto& [name, lvl] : kLevels)
    if (lvl == level) return name;
  return "?";
}

std::optional<Level> parse_level(const std::string& name) {
  for (const auto& [n, lvl] : kLevels)
    if (name == n) return lvl;
  return std::nullopt;
}

const char* level_names() { return "trace, debug, info, warn, error, off"; }

void set_level(Level level) { logger()->set_level(static_cast<spdlog::level::level_enum>(level)); }
Level level() { return static_cast<Level>(logger()->level()); }
bool enabled(Level level) { return logger()->should_log(static_cast<spdlog::level::level_enum>(level)); }
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

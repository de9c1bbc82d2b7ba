#include "serve/flow_control.h"

#include <openssl/sha.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace shardserve {
namespace {

constexpr size_t kMaxConfigBytes = 1 << 20;
constexpr size_t kMaxTenants = 4096;
constexpr int64_t kMaxPriority = 1 << 20;
constexpr auto kCheckEvery = std::chrono::seconds(1);
constexpr size_t kMaxTracked = 1 << 16;  // tenants whose use is kept

std::string Hex(const unsigned char* d, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[d[i] >> 4];
    out += digits[d[i] & 15];
  }
  return out;
}

std::string DigestOf(std::string_view key) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), d);
  return Hex(d, sizeof(d));
}

// A class's fields from a YAML map over `base`; `where` names it in errors.
absl::StatusOr<TenantClass> ClassOf(const YAML::Node& node, TenantClass base,
                                    const std::string& where) {
  if (!node.IsMap()) return absl::InvalidArgumentError(absl::StrCat(where, " must be a map"));
  for (const auto& kv : node) {
    const std::string field = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".", field, " ", what));
    };
    if (field == "name" || field == "key" || field == "keySha256") {
      if (!v.IsScalar()) return bad("must be a string");
      if (field == "name") base.name = v.as<std::string>();
      continue;
    }
    if (!v.IsScalar()) return bad("must be a number");
    double x;
    try {
      x = v.as<double>();
    } catch (const YAML::Exception&) {
      return bad(absl::StrCat("must be a number, not '", v.as<std::string>(), "'"));
    }
    if (!std::isfinite(x)) return bad("must be a finite number");
    if (field == "priority") {
      if (x != std::floor(x) || std::fabs(x) > kMaxPriority) {
        return bad(absl::StrCat("must be an integer in [-", kMaxPriority, ", ", kMaxPriority, "]"));
      }
      base.priority = static_cast<int64_t>(x);
    } else if (field == "weight") {
      if (x <= 0 || x > 1e6) return bad("must be in (0, 1000000]");
      base.weight = x;
    } else if (field == "requestsPerSecond") {
      if (x < 0 || x > 1e9) return bad("must be in [0, 1e9] (0: no limit)");
      base.requests_per_second = x;
    } else if (field == "tokensPerMinute") {
      if (x < 0 || x > 1e15 || x != std::floor(x)) {
        return bad("must be an integer in [0, 1e15] (0: no limit)");
      }
      base.tokens_per_minute = static_cast<int64_t>(x);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unknown field '", field,
          "' (name, key, keySha256, priority, weight, requestsPerSecond, tokensPerMinute)"));
    }
  }
  return base;
}

absl::StatusOr<FlowConfig> Parse(const std::string& text) {
  YAML::Node root = YAML::Load(text);
  FlowConfig out;
  out.fallback.name = "default";
  if (root.IsNull()) return out;
  if (!root.IsMap()) return absl::InvalidArgumentError("the flow-control config must be a map");
  for (const auto& kv : root) {
    const std::string k = kv.first.as<std::string>();
    if (k != "tenants" && k != "default") {
      return absl::InvalidArgumentError(absl::StrCat("unknown field '", k, "' (tenants, default)"));
    }
  }
  if (root["default"]) {
    ASSIGN_OR_RETURN(out.fallback, ClassOf(root["default"], out.fallback, "default"));
  }
  const YAML::Node tenants = root["tenants"];
  if (!tenants) return out;
  if (!tenants.IsSequence()) return absl::InvalidArgumentError("tenants must be a list");
  if (tenants.size() > kMaxTenants) {
    return absl::InvalidArgumentError(absl::StrCat("tenants: at most ", kMaxTenants));
  }
  for (size_t i = 0; i < tenants.size(); ++i) {
    const std::string where = absl::StrCat("tenants[", i, "]");
    const YAML::Node t = tenants[i];
    TenantClass base = out.fallback;
    base.name.clear();
    ASSIGN_OR_RETURN(TenantClass c, ClassOf(t, base, where));
    std::string digest;
    if (t["keySha256"]) {
      digest = absl::AsciiStrToLower(t["keySha256"].as<std::string>());
      if (digest.size() != 64 || !std::all_of(digest.begin(), digest.end(),
                                              [](char ch) { return absl::ascii_isxdigit(ch); })) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".keySha256 must be 64 hexadecimal digits"));
      }
    } else if (t["key"]) {
      digest = DigestOf(t["key"].as<std::string>());
    } else {
      return absl::InvalidArgumentError(absl::StrCat(where, " needs key or keySha256"));
    }
    if (c.name.empty()) c.name = absl::StrCat("key-", digest.substr(0, 12));
    if (!out.by_digest.emplace(digest, c).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the same key twice"));
    }
  }
  return out;
}

absl::StatusOr<std::string> ReadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  std::string text(kMaxConfigBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": over ", kMaxConfigBytes, " bytes"));
  }
  return text;
}

}  // namespace

absl::StatusOr<FlowConfig> ParseFlowConfig(const std::string& yaml) {
  try {
    return Parse(yaml);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid YAML: ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<FlowControl>> FlowControl::Open(const std::string& file, int share) {
  std::unique_ptr<FlowControl> fc(new FlowControl(file, std::max(1, share)));
  absl::MutexLock lock(&fc->mu_);
  fc->config_.fallback.name = "default";
  if (file.empty()) return fc;
  ASSIGN_OR_RETURN(fc->text_, ReadConfigFile(file));
  auto config = ParseFlowConfig(fc->text_);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", config.status().message()));
  }
  fc->config_ = *std::move(config);
  fc->checked_ = Clock::now();
  return fc;
}

void FlowControl::RefreshLocked() {
  if (file_.empty() || Clock::now() - checked_ < kCheckEvery) return;
  checked_ = Clock::now();
  absl::StatusOr<std::string> text = ReadConfigFile(file_);
  if (text.ok() && *text == text_) return;
  absl::StatusOr<FlowConfig> config =
      text.ok() ? ParseFlowConfig(*text) : absl::StatusOr<FlowConfig>(text.status());
  if (!config.ok()) {
    const std::string why(config.status().message());
    if (why != last_error_) {
      LogWarning("flow control: ", file_, ": ", why, "; the last good config stays in force");
      last_error_ = why;
    }
    return;
  }
  LogInfo("flow control: ", file_, " read again (", config->by_digest.size(), " tenants)");
  config_ = *std::move(config);
  text_ = *std::move(text);
  last_error_.clear();
}

TenantClass FlowControl::Tenant(std::string_view authorization) {
  absl::MutexLock lock(&mu_);
  RefreshLocked();
  std::string_view key = authorization;
  if (absl::StartsWithIgnoreCase(absl::string_view(key.data(), key.size()), "bearer "))
    key.remove_prefix(7);
  while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
  if (key.empty()) {
    TenantClass c = config_.fallback;
    c.name = "anonymous";
    return c;
  }
  const std::string digest = DigestOf(key);
  if (auto it = config_.by_digest.find(digest); it != config_.by_digest.end()) return it->second;
  TenantClass c = config_.fallback;
  c.name = absl::StrCat("key-", digest.substr(0, 12));
  return c;
}

absl::Status FlowControl::Admit(const TenantClass& tenant, int64_t* retry_after,
                                Clock::time_point now) {
  *retry_after = 0;
  if (tenant.requests_per_second <= 0 && tenant.tokens_per_minute <= 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (usage_.size() > kMaxTracked) {  // many keys: those idle for a minute are forgotten
    std::erase_if(usage_,
                  [&](const auto& e) { return now - e.second.filled > std::chrono::minutes(1); });
  }
  Usage& u = usage_[tenant.name];
  const double rate = tenant.requests_per_second / share_;
  if (rate > 0) {
    const double burst = std::max(1.0, rate);
    if (u.bucket < 0) {
      u.bucket = burst;
    } else {
      u.bucket =
          std::min(burst, u.bucket + rate * std::chrono::duration<double>(now - u.filled).count());
    }
    u.filled = now;
    if (u.bucket < 1.0) {
      *retry_after = static_cast<int64_t>(std::ceil((1.0 - u.bucket) / rate));
      return absl::ResourceExhaustedError(absl::StrCat(
          "the key's tenant '", tenant.name, "' is past its requestsPerSecond ",
          tenant.requests_per_second,
          share_ > 1 ? absl::StrCat(" (", share_, " routers: each takes 1/", share_, ")") : ""));
    }
  }
  const int64_t limit = tenant.tokens_per_minute / share_;
  if (tenant.tokens_per_minute > 0) {
    const int64_t s =
        std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
    int64_t used = 0;
    for (int i = 0; i < 60; ++i) {
      if (u.second_of[i] > s - 60) used += u.seconds[i];
    }
    if (used >= std::max<int64_t>(1, limit)) {
      // Until enough of the oldest seconds leave the minute.
      int64_t drop = 0, until = s + 1;
      for (int64_t t = s - 59; t <= s; ++t) {
        const int i = static_cast<int>(((t % 60) + 60) % 60);
        if (u.second_of[i] == t) drop += u.seconds[i];
        if (used - drop < limit) {
          until = t + 60;
          break;
        }
      }
      *retry_after = std::max<int64_t>(1, until - s);
      return absl::ResourceExhaustedError(absl::StrCat(
          "the key's tenant '", tenant.name, "' is past its tokensPerMinute ",
          tenant.tokens_per_minute,
          share_ > 1 ? absl::StrCat(" (", share_, " routers: each takes 1/", share_, ")") : ""));
    }
  }
  if (rate > 0) u.bucket -= 1.0;
  return absl::OkStatus();
}

void FlowControl::Record(const TenantClass& tenant, int64_t tokens, Clock::time_point now) {
  if (tenant.tokens_per_minute <= 0 || tokens <= 0) return;
  absl::MutexLock lock(&mu_);
  Usage& u = usage_[tenant.name];
  if (u.bucket < 0) u.filled = now;
  const int64_t s =
      std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
  const int i = static_cast<int>(((s % 60) + 60) % 60);
  if (u.second_of[i] != s) {
    u.second_of[i] = s;
    u.seconds[i] = 0;
  }
  u.seconds[i] += tokens;
}

}  // namespace shardserve

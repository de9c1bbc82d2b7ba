#pragma once
// The machinery of a binary's contract as one table (worker_env.cc, router_env.cc): each
// setting's variable, its field, its default (the struct's) and its bounds, so that writing
// (ToEnv) and reading (FromEnv) cannot drift apart. Internal to src/api.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/worker_env.h"
#include "common/status.h"

namespace shardserve::env_internal {

// `identity` variables are written even at their default.
template <typename T>
struct StringVar {
  const char* name;
  std::string T::*field;
  bool identity = false;
};
template <typename T>
struct IntVar {
  const char* name;
  int T::*field;
  int64_t min, max;
  bool identity = false;
};
template <typename T>
struct Int64Var {
  const char* name;
  int64_t T::*field;
  int64_t min, max;
};
template <typename T>
struct BoolVar {
  const char* name;
  bool T::*field;
  const char* yes;  // the words for true and false
  const char* no;
};

template <typename T>
struct Table {
  std::span<const StringVar<T>> strings;
  std::span<const IntVar<T>> ints;
  std::span<const Int64Var<T>> int64s;
  std::span<const BoolVar<T>> bools;
};

// The variable of a field, for errors that name it.
template <typename Vars, typename Field>
const char* NameOf(const Vars& vars, Field field) {
  for (const auto& v : vars) {
    if (v.field == field) return v.name;
  }
  return "?";
}

// An integer variable: `def` when unset or empty; otherwise it must lie in [min, max], or the
// error names the variable and its value.
inline absl::StatusOr<int64_t> EnvInt(const EnvLookup& env, const char* name, int64_t def,
                                      int64_t min, int64_t max) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') return def;
  int64_t out;
  if (!absl::SimpleAtoi(v, &out) || out < min || out > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", name, "='", v, "' must be an integer in [", min, ", ", max, "]"));
  }
  return out;
}

// The variables to set: identity ones always, the rest where they differ from `defaults`.
template <typename T>
std::vector<std::pair<std::string, std::string>> ToEnv(const Table<T>& t, const T& value,
                                                       const T& defaults) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& v : t.strings) {
    if (value.*v.field != defaults.*v.field || v.identity) out.emplace_back(v.name, value.*v.field);
  }
  for (const auto& v : t.ints) {
    if (value.*v.field != defaults.*v.field || v.identity) {
      out.emplace_back(v.name, std::to_string(value.*v.field));
    }
  }
  for (const auto& v : t.int64s) {
    if (value.*v.field != defaults.*v.field) {
      out.emplace_back(v.name, std::to_string(value.*v.field));
    }
  }
  for (const auto& v : t.bools) {
    if (value.*v.field != defaults.*v.field) {
      out.emplace_back(v.name, value.*v.field ? v.yes : v.no);
    }
  }
  return out;
}

// Every variable of the table, in its order.
template <typename T>
std::vector<std::string> Names(const Table<T>& t) {
  std::vector<std::string> names;
  for (const auto& v : t.strings) names.push_back(v.name);
  for (const auto& v : t.ints) names.push_back(v.name);
  for (const auto& v : t.int64s) names.push_back(v.name);
  for (const auto& v : t.bools) names.push_back(v.name);
  return names;
}

// Reads every variable of the table into `out` (which holds the defaults): an unset variable
// keeps its default, a bad one is an error naming it.
template <typename T>
absl::Status FromEnv(const Table<T>& t, const EnvLookup& env, T& out) {
  for (const auto& v : t.strings) {
    if (const char* s = env(v.name); s != nullptr && *s) out.*v.field = s;
  }
  for (const auto& v : t.ints) {
    ASSIGN_OR_RETURN(int64_t x, EnvInt(env, v.name, out.*v.field, v.min, v.max));
    out.*v.field = static_cast<int>(x);
  }
  for (const auto& v : t.int64s) {
    ASSIGN_OR_RETURN(out.*v.field, EnvInt(env, v.name, out.*v.field, v.min, v.max));
  }
  for (const auto& v : t.bools) {
    const char* s = env(v.name);
    if (s == nullptr || *s == '\0') continue;
    if (std::string_view(s) != v.yes && std::string_view(s) != v.no) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", v.name, "='", s,
                                                     "' must be ", v.yes, " or ", v.no));
    }
    out.*v.field = std::string_view(s) == v.yes;
  }
  return absl::OkStatus();
}

}  // namespace shardserve::env_internal

#include "common/args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardserve {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::set<std::string>& value_flags,
                                 const std::set<std::string>& bool_flags) {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (bool_flags.count(name)) {
      if (inline_value)
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      args.values_[name] = "true";
    } else if (value_flags.count(name)) {
      if (!inline_value) {
        if (i + 1 >= argv.size()) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        }
        value = argv[++i];
      }
      args.values_[name] = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  return args;
}

std::optional<std::string> Args::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Args::GetOr(const std::string& name, const std::string& def) const {
  return Get(name).value_or(def);
}

absl::StatusOr<int64_t> Args::GetInt(const std::string& name, int64_t def) const {
  auto v = Get(name);
  if (!v) return def;
  int64_t out;
  if (!absl::SimpleAtoi(*v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", *v, "' is not an integer"));
  }
  return out;
}

absl::StatusOr<double> Args::GetDouble(const std::string& name, double def) const {
  auto v = Get(name);
  if (!v) return def;
  double out;
  if (!absl::SimpleAtod(*v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", *v, "' is not a number"));
  }
  return out;
}

absl::StatusOr<std::string> Args::Require(const std::string& name) const {
  auto v = Get(name);
  if (!v) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  return *v;
}

}  // namespace shardserve

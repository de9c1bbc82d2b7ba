#include "common/args.h"

#include <CLI/CLI.hpp>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardserve {

namespace {

// The payload that marks a help request among statuses.
constexpr char kHelpUrl[] = "shardserve.io/help";

}  // namespace

bool IsHelp(const absl::Status& status) { return status.GetPayload(kHelpUrl).has_value(); }

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::set<std::string>& value_flags,
                                 const std::set<std::string>& bool_flags,
                                 const std::string& command, const std::string& usage) {
  CLI::App app(usage, command);
  app.set_help_flag("-h,--help", "print this help");
  app.allow_extras(false);
  app.positionals_at_end(false);
  Args args;
  std::map<std::string, std::string> values;
  for (const std::string& name : value_flags) {
    const std::string spelling = name == "file" ? "-f,--file" : "--" + name;
    // Given twice, the last one counts (scripts append their overrides).
    app.add_option(spelling, values[name])
        ->type_name("VALUE")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  std::map<std::string, bool> flags;
  for (const std::string& name : bool_flags) {
    if (value_flags.count(name)) {
      return absl::InternalError(absl::StrCat("--", name, " is declared twice"));
    }
    app.add_flag("--" + name, flags[name]);
  }
  // CLI11 takes the arguments last first.
  std::vector<std::string> reversed(argv.rbegin(), argv.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    absl::Status help = absl::CancelledError(app.help());
    help.SetPayload(kHelpUrl, absl::Cord("1"));
    return help;
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  for (const std::string& name : value_flags) {
    if (app.count(name == "file" ? "--file" : "--" + name) > 0) args.values_[name] = values[name];
  }
  for (const auto& [name, set] : flags) {
    if (set) args.values_[name] = "true";
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

#pragma once
// Command-line flags for subcommands, parsed by CLI11: "--name value", "--name=value", boolean
// "--name", and "-f" for --file where a command has it. Every flag must be declared; unknown
// flags and missing values are errors naming the flag. -h/--help answers with the command's own
// usage: Parse returns a status for which IsHelp holds, its message the text to print.
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// A status from Args::Parse that asks for the help its message holds (print it, succeed).
bool IsHelp(const absl::Status& status);

class Args {
 public:
  // value_flags take a value; bool_flags do not. Positional arguments are refused. `command`
  // ("shardserve local") and `usage` (its flags and what it does) make the --help text.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::set<std::string>& value_flags,
                                    const std::set<std::string>& bool_flags,
                                    const std::string& command = "", const std::string& usage = "");

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const;
  std::string GetOr(const std::string& name, const std::string& def) const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t def) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double def) const;
  absl::StatusOr<std::string> Require(const std::string& name) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace shardserve

#pragma once
// Command-line flags for subcommands: "--name value", "--name=value" and boolean "--name".
// Every flag must be declared; unknown flags and missing values are errors naming the flag.
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

class Args {
 public:
  // value_flags take a value; bool_flags do not. Positional arguments are refused.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::set<std::string>& value_flags,
                                    const std::set<std::string>& bool_flags);

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

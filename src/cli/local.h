#pragma once
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

// `shardserve local -f MANIFEST [--port N --metrics-port-base N --threads N]`: runs the
// manifest's replicas on this machine until Ctrl-C / SIGTERM or a rank fails.
absl::Status RunLocal(std::vector<std::string> argv);

}  // namespace shardserve

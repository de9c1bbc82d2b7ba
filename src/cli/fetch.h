#pragma once
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

// `shardserve fetch --uri URI ...`: a remote model into a model cache, as a worker pod's fetch
// step (an init container) runs it on a node: the listing pinned to the revision the operator
// resolved, room made in the node's cache (least recently used models nobody runs evicted), the
// files fetched and checked once per node (the pods of a node that start together wait for one
// download), its progress on GET /startupz of --progress-port (the operator's status reads it),
// and what it did written to --report (the leader rank's metrics read it).
absl::Status RunFetch(const std::vector<std::string>& argv);
inline constexpr char kFetchUsage[] =
    "--uri URI [--files PATTERN,... --revision REV --cache DIR --cache-limit BYTES\n"
    "--credentials DIR --progress-port PORT --report FILE --used-grace-seconds S --small\n"
    "--link PATH]\n"
    "(a model from hf://, s3:// or oci:// into the model cache (default as shardserve local's);\n"
    "--revision: the commit, digest or listing an earlier resolution gave (the model must still\n"
    "be it); --cache-limit: evict least recently used models no process holds, nor used within\n"
    "--used-grace-seconds (default 600), to stay under it;\n"
    "--credentials: a directory of files named as the variables they stand for (HF_TOKEN,\n"
    "AWS_ACCESS_KEY_ID, ...; .dockerconfigjson for a registry), as a Secret mounts them;\n"
    "--small: the files that are not weights only (a router's); --link: a symlink to the\n"
    "model's directory)";

}  // namespace shardserve

#pragma once
// Child processes: spawn with extra environment, and supervise a group of them. When one child
// fails (non-zero exit or a signal) the others get a grace period to notice and report it
// themselves, then SIGTERM, then after another grace period SIGKILL; the error names the child
// that failed first. SIGINT/SIGTERM to the supervisor are passed on to the children at once (and
// the children that do not exit within the grace period are killed); children that exit 0 after
// it stopped cleanly.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

struct Child {
  pid_t pid = -1;
  std::string name;  // for messages, e.g. "rank 3 (stage 1, tp 1)"
};

// Runs `exe args...` with the current environment plus `env`, with SIGTERM as its parent-death
// signal: a child never outlives its supervisor, even one killed with SIGKILL. With `own_group`
// it leads a process group of its own, which its children join (SuperviseAll's SIGKILL takes the
// whole group). An exe that cannot be run is an error here, not a child that fails later.
absl::StatusOr<pid_t> Spawn(const std::string& exe, const std::vector<std::string>& args,
                            const std::vector<std::pair<std::string, std::string>>& env,
                            bool own_group = true);

// Waits for every child. OK when all exit 0; otherwise terminates the rest and returns
// Aborted naming the first failure ("rank 3 (stage 1, tp 1) exited with code 1").
absl::Status SuperviseAll(std::vector<Child>& children, std::chrono::milliseconds grace);

// Children started and restarted together: a model replica's stage launchers, a router.
struct ChildGroup {
  std::string name;  // for messages, e.g. "replica 1"
  // Starts the group's children (again, after a failure); an error ends the supervision.
  std::function<absl::StatusOr<std::vector<Child>>()> start;
  // Whether a failure is restarted (null: always); when not, it ends the supervision with the
  // failure, as SuperviseAll does.
  std::function<bool()> restartable;
};

// Starts every group and keeps them running, as the operator keeps a model's replicas: when a
// child of a group fails (or exits while nothing asked it to), the rest of its group gets
// SIGTERM (then SIGKILL after `grace`), and once all of it has exited the group is started
// again after a backoff (1 s, doubling up to 30 s; back to 1 s after a minute of running); the
// other groups keep serving. `on_restart(group, why)` is told each time. On SIGINT/SIGTERM every
// child is stopped (SIGTERM, then SIGKILL after `grace`) and the result is OK; an error starting
// a group ends everything with it.
absl::Status SuperviseGroups(
    std::vector<ChildGroup>& groups, std::chrono::milliseconds grace,
    const std::function<void(const std::string&, const std::string&)>& on_restart = nullptr);

// The pod's first fatal error becomes its container's termination message: the operator sets
// SHARDSERVE_TERMINATION_LOG to the file the kubelet reads into the terminated state, and the
// first rank to fail writes it (later ones, and the launcher reporting that a rank exited, find
// it written), so the replica's status names the cause rather than its consequences. "" or a
// file that cannot be opened: nothing is written.
void ReportTermination(const std::string& path, const std::string& message);

// The path of the running executable's directory (to find sibling binaries).
std::string SelfDirectory();

// This process's resident memory (VmRSS), in bytes.
size_t ResidentBytes();

}  // namespace shardserve

#pragma once
// Runs a function in N forked member processes and collects their exit codes. A member reports
// failure by returning a non-empty message (printed to stderr) — gtest assertions do not cross
// fork().
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace shardserve::testing {

inline std::vector<int> RunMembers(
    int n, const std::function<std::string(int)>& member,
    const std::function<void(const std::vector<pid_t>&)>& while_running = nullptr) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string err = member(r);
      if (!err.empty()) std::fprintf(stderr, "member %d: %s\n", r, err.c_str());
      std::fflush(stderr);
      _exit(err.empty() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  if (while_running) while_running(pids);
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

}  // namespace shardserve::testing

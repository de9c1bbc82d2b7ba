#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace shardserve {
namespace {

// The last signal asking this supervisor to stop (a signal handler can only touch such state).
std::atomic<int> g_stop_signal{0};

void OnStopSignal(int sig) { g_stop_signal.store(sig); }

std::string Describe(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("was killed by signal ", WTERMSIG(status));
  return "stopped";
}

}  // namespace

absl::StatusOr<pid_t> Spawn(const std::string& exe, const std::vector<std::string>& args,
                            const std::vector<std::pair<std::string, std::string>>& env,
                            bool own_group) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    bool overridden = false;
    for (const auto& [k, v] : env) overridden |= entry.rfind(k + "=", 0) == 0;
    if (!overridden) env_strings.push_back(entry);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe_copy = exe;
  argv.push_back(exe_copy.data());
  std::vector<std::string> args_copy = args;
  for (auto& a : args_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  int ready[2];  // closed on exec; a failed exec writes its errno first
  if (pipe2(ready, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", exe, ": ", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close(ready[0]);
    close(ready[1]);
    return absl::InternalError(absl::StrCat("cannot start ", exe, ": ", std::strerror(e)));
  }
  if (pid == 0) {  // only async-signal-safe calls until exec
    close(ready[0]);
    if (own_group) setpgid(0, 0);         // the supervisor can kill its whole tree at once
    prctl(PR_SET_PDEATHSIG, SIGTERM);     // the supervisor died: stop
    if (getppid() != parent) _exit(127);  // it died before the line above
    execve(exe.c_str(), argv.data(), envp.data());
    const int e = errno;
    (void)!write(ready[1], &e, sizeof(e));
    _exit(127);
  }
  close(ready[1]);
  int child_errno = 0;
  ssize_t n;
  while ((n = read(ready[0], &child_errno, sizeof(child_errno))) < 0 && errno == EINTR) {
  }
  close(ready[0]);
  if (n == static_cast<ssize_t>(sizeof(child_errno))) {
    waitpid(pid, nullptr, 0);
    return absl::InternalError(
        absl::StrCat("cannot start ", exe, ": ", std::strerror(child_errno)));
  }
  return pid;
}

absl::Status SuperviseAll(std::vector<Child>& children, std::chrono::milliseconds grace) {
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::vector<bool> running(children.size(), true);
  size_t left = children.size();
  absl::Status first = absl::OkStatus();
  // SIGTERM to each child (it stops its own children cleanly); SIGKILL to each child and, when it
  // leads one, its process group, so nothing it started outlives it.
  auto terminate_rest = [&](int sig) {
    for (size_t i = 0; i < children.size(); ++i) {
      if (!running[i]) continue;
      kill(children[i].pid, sig);
      if (sig == SIGKILL) kill(-children[i].pid, SIGKILL);
    }
  };
  auto deadline = std::chrono::steady_clock::time_point::max();
  bool sent_term = false;
  while (left > 0) {
    int status;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t i = 0; i < children.size(); ++i) {
        if (children[i].pid != pid || !running[i]) continue;
        running[i] = false;
        --left;
        if ((!WIFEXITED(status) || WEXITSTATUS(status) != 0) && first.ok()) {
          first = absl::AbortedError(absl::StrCat(children[i].name, " ", Describe(status)));
          deadline = std::chrono::steady_clock::now() + grace;  // they report it, or SIGTERM
        }
      }
      continue;
    }
    if (g_stop_signal.exchange(0) != 0) {
      // Passed on; children that then exit 0 stopped cleanly.
      terminate_rest(SIGTERM);
      sent_term = true;
      deadline = std::chrono::steady_clock::now() + grace;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      terminate_rest(sent_term ? SIGKILL : SIGTERM);
      deadline = sent_term ? std::chrono::steady_clock::time_point::max()
                           : std::chrono::steady_clock::now() + grace;
      sent_term = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return first;
}

absl::Status SuperviseGroups(
    std::vector<ChildGroup>& groups, std::chrono::milliseconds grace,
    const std::function<void(const std::string&, const std::string&)>& on_restart) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kFirstBackoff = std::chrono::seconds(1), kMaxBackoff = std::chrono::seconds(30),
                 kHealthyRun = std::chrono::seconds(60);
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  struct State {
    std::vector<Child> children;
    std::vector<bool> running;
    bool failed = false;  // being stopped, to be started again
    Clock::time_point started, restart_at, kill_at;
    std::chrono::milliseconds backoff = kFirstBackoff;
  };
  std::vector<State> state(groups.size());
  bool stopping = false;
  auto stop_all = [&](int sig) {
    for (State& g : state) {
      for (size_t i = 0; i < g.children.size(); ++i) {
        if (!g.running[i]) continue;
        kill(g.children[i].pid, sig);
        if (sig == SIGKILL) kill(-g.children[i].pid, SIGKILL);
      }
    }
  };
  auto start = [&](size_t k) -> absl::Status {
    absl::StatusOr<std::vector<Child>> children = groups[k].start();
    if (!children.ok()) return children.status();
    State& g = state[k];
    g.children = *std::move(children);
    g.running.assign(g.children.size(), true);
    g.failed = false;
    g.started = Clock::now();
    return absl::OkStatus();
  };
  absl::Status result;
  for (size_t k = 0; k < groups.size() && result.ok(); ++k) result = start(k);
  if (!result.ok()) {
    stopping = true;
    stop_all(SIGKILL);
  }
  auto kill_at = Clock::time_point::max();  // while stopping: SIGKILL then
  for (;;) {
    size_t alive = 0;
    for (const State& g : state) alive += std::count(g.running.begin(), g.running.end(), true);
    if (stopping && alive == 0) return result;
    int status;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t k = 0; k < state.size(); ++k) {
        State& g = state[k];
        for (size_t i = 0; i < g.children.size(); ++i) {
          if (g.children[i].pid != pid || !g.running[i]) continue;
          g.running[i] = false;
          if (stopping || g.failed) continue;
          // A child of a running group ended: the group is restarted, if it may be.
          const std::string why = absl::StrCat(g.children[i].name, " ", Describe(status));
          if (groups[k].restartable && !groups[k].restartable()) {
            result = absl::AbortedError(why);
            stopping = true;
            stop_all(SIGTERM);
            kill_at = Clock::now() + grace;
            continue;
          }
          g.failed = true;
          if (Clock::now() - g.started > kHealthyRun) g.backoff = kFirstBackoff;
          g.restart_at = Clock::now() + g.backoff;
          g.kill_at = Clock::now() + grace;
          if (on_restart) {
            on_restart(groups[k].name,
                       absl::StrCat(why, "; restarting it in ", g.backoff.count() / 1000.0, " s"));
          }
          g.backoff = std::min<std::chrono::milliseconds>(g.backoff * 2, kMaxBackoff);
          for (size_t j = 0; j < g.children.size(); ++j) {
            if (g.running[j]) kill(g.children[j].pid, SIGTERM);
          }
        }
      }
      continue;
    }
    if (g_stop_signal.exchange(0) != 0 && !stopping) {
      stopping = true;
      stop_all(SIGTERM);
      kill_at = Clock::now() + grace;
    }
    const auto now = Clock::now();
    if (stopping && now > kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    for (size_t k = 0; k < state.size() && !stopping; ++k) {
      State& g = state[k];
      if (!g.failed) continue;
      const bool any = std::count(g.running.begin(), g.running.end(), true) > 0;
      if (any && now > g.kill_at) {  // what SIGTERM did not stop
        for (size_t j = 0; j < g.children.size(); ++j) {
          if (!g.running[j]) continue;
          kill(g.children[j].pid, SIGKILL);
          kill(-g.children[j].pid, SIGKILL);
        }
        g.kill_at = Clock::time_point::max();
      }
      if (!any && now >= g.restart_at) {
        if (absl::Status s = start(k); !s.ok()) {
          result = absl::AbortedError(
              absl::StrCat("cannot restart ", groups[k].name, ": ", s.message()));
          stopping = true;
          stop_all(SIGTERM);
          kill_at = now + grace;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

size_t ResidentBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

std::string SelfDirectory() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

void ReportTermination(const std::string& path, const std::string& message) {
  if (path.empty()) return;
  const int fd = open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st;
  if (flock(fd, LOCK_EX) == 0 && fstat(fd, &st) == 0 && st.st_size == 0) {
    const std::string line = message + "\n";
    if (write(fd, line.data(), line.size()) < 0) {
      // nothing more to do: the log has it too
    }
  }
  close(fd);
}

}  // namespace shardserve

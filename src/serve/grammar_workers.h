#pragma once
// Threads for structured output's work (serve/grammar.h): compiling a request's grammar and
// computing its sequences' token masks, off the HTTP threads and the engine's loop. llguidance's
// compiler recurses once per nested rule or `$ref`; each thread here has a stack of its own size
// (stack_bytes, reserved but only touched as deep as the work goes), and Grammar's input checks
// keep every accepted grammar within it (kGrammarStackBytes). Jobs run in the order posted; the
// queue is bounded (a full one refuses the job, the caller answers 429). The threads run at a
// lower priority (kGrammarNice) than the process's others.
//
// Thread-safe. The destructor runs the jobs already queued, then joins the threads.
#include <pthread.h>

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardserve {

// The stack each grammar thread gets: deep enough for the deepest grammar Grammar's checks let
// through (see grammar.h: kMaxGrammarRefs, kMaxLarkRules), with a margin.
inline constexpr size_t kGrammarStackBytes = size_t{512} << 20;
// The threads' nice value: grammar work yields the CPU to the model's steps and the API.
inline constexpr int kGrammarNice = 10;

class GrammarWorkers {
 public:
  GrammarWorkers(int threads, size_t stack_bytes, size_t max_queued);
  ~GrammarWorkers();
  GrammarWorkers(const GrammarWorkers&) = delete;
  GrammarWorkers& operator=(const GrammarWorkers&) = delete;

  // Queues `job`; false (nothing queued) when max_queued jobs already wait, or when no thread
  // could be started (error() says why).
  bool Post(std::function<void()> job);
  const std::string& error() const { return error_; }

 private:
  struct Thread {
    pthread_t id;
    void* stack;  // its mapping, guard page included
    size_t stack_bytes;
  };
  static void* Main(void* self);
  void Loop();

  std::vector<Thread> threads_;
  std::string error_;  // why fewer threads than asked for started
  const size_t max_queued_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardserve

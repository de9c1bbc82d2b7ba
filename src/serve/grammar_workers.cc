#include "serve/grammar_workers.h"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace shardserve {

GrammarWorkers::GrammarWorkers(int threads, size_t stack_bytes, size_t max_queued)
    : max_queued_(max_queued) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes = (stack_bytes + page - 1) / page * page;
  for (int i = 0; i < threads; ++i) {
    // The stack: address space only (MAP_NORESERVE: no memory is committed for the pages a
    // grammar never reaches), with a guard page below it.
    void* base = mmap(nullptr, stack_bytes + page, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (base == MAP_FAILED) {
      error_ = std::string("no address space for a grammar thread's stack: ") + strerror(errno);
      break;
    }
    mprotect(base, page, PROT_NONE);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstack(&attr, static_cast<char*>(base) + page, stack_bytes);
    pthread_t t;
    const int rc = pthread_create(&t, &attr, &GrammarWorkers::Main, this);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      munmap(base, stack_bytes + page);
      error_ = std::string("cannot start a grammar thread: ") + strerror(rc);
      break;
    }
    threads_.push_back({t, base, stack_bytes + page});
  }
}

GrammarWorkers::~GrammarWorkers() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  for (const Thread& t : threads_) {
    pthread_join(t.id, nullptr);
    munmap(t.stack, t.stack_bytes);
  }
}

bool GrammarWorkers::Post(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  if (stop_ || threads_.empty() || jobs_.size() >= max_queued_) return false;
  jobs_.push_back(std::move(job));
  cv_.Signal();
  return true;
}

void* GrammarWorkers::Main(void* self) {
  // Below the forward pass and the HTTP threads: a costly grammar takes the CPU they leave.
  setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), kGrammarNice);
  static_cast<GrammarWorkers*>(self)->Loop();
  return nullptr;
}

void GrammarWorkers::Loop() {
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && jobs_.empty()) cv_.Wait(&mu_);
      if (jobs_.empty()) return;  // stopping, and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace shardserve

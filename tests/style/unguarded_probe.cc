// Never built: scripts/thread_safety.py analyzes this file first and requires the analysis to
// report its unguarded access, so that a pass that silently checks nothing fails the test.
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardserve {

class Counter {
 public:
  void Add() { ++count_; }  // the access the analysis must report: mu_ is not held

 private:
  absl::Mutex mu_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve

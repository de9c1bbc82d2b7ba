#pragma once
// The CPU backend: host memory, the kernels of backend/cpu/kernels.h over a thread pool. Upload
// copies each weight matrix into the backend's own memory (huge pages from 2 MiB on), in the
// layout its kernels read.
#include <memory>

#include "backend/backend.h"

namespace shardserve::cpu {

// A backend whose ops split their work over `threads` threads (the caller among them).
std::unique_ptr<Backend> NewBackend(int threads);

}  // namespace shardserve::cpu

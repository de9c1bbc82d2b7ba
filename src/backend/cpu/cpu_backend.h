#pragma once
// The CPU backend: host memory, the kernels of backend/cpu/kernels.h over a thread pool. Weights
// stay where the caller keeps them (views into mapped files): Upload copies nothing.
#include <memory>

#include "backend/backend.h"

namespace shardserve::cpu {

// A backend whose ops split their work over `threads` threads (the caller among them).
std::unique_ptr<Backend> NewBackend(int threads);

}  // namespace shardserve::cpu

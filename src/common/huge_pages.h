#pragma once
// Memory for large arrays read over and over from memory (the CPU backend's weights): from 2 MiB
// on, a private anonymous mapping that starts on a 2 MiB boundary and asks Linux for transparent
// huge pages (madvise MADV_HUGEPAGE, which THP's default setting, "madvise", honours). With 4 KiB
// pages one thread's decode of TinyLlama Q8_0 and Q4_K_M ran about 10 % slower (Zen 4: each page
// a TLB miss, and the hardware prefetchers stop at its edge). The mapping is the array's size
// rounded up to 4 KiB only (its last part short of 2 MiB keeps small pages); a smaller array, which
// no huge page would hold, comes from the heap, and takes no mapping of its own.
#include <cstddef>
#include <cstdint>
#include <memory>

namespace shardserve {

struct HugePagesDeleter {
  size_t mapped = 0;  // the mapping's length; 0: from the heap (new[])
  void operator()(uint8_t* p) const;
};
using HugePagesArray = std::unique_ptr<uint8_t[], HugePagesDeleter>;

// `bytes` bytes (at least 1; not initialized), or nullptr when they cannot be had. Huge pages are
// a request: where THP is off, or none is free, the memory is as any other.
HugePagesArray AllocateHugePages(size_t bytes);

}  // namespace shardserve

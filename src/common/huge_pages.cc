#include "common/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <new>

namespace shardserve {
namespace {

constexpr size_t kHugePage = size_t{2} << 20, kPage = 4096;

}  // namespace

void HugePagesDeleter::operator()(uint8_t* p) const {
  if (p == nullptr) return;
  if (mapped == 0) {
    delete[] p;
  } else {
    ::munmap(p, mapped);
  }
}

HugePagesArray AllocateHugePages(size_t bytes) {
  if (bytes < kHugePage) return HugePagesArray(new (std::nothrow) uint8_t[bytes > 0 ? bytes : 1]);
  if (bytes > SIZE_MAX - 2 * kHugePage) return nullptr;
  const size_t length = (bytes + kPage - 1) / kPage * kPage;
  // Mapped 2 MiB longer; then the part before the first 2 MiB boundary and the part after the
  // array unmapped again.
  void* map = ::mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(map);
  const uintptr_t start = (base + kHugePage - 1) / kHugePage * kHugePage;
  if (start > base) ::munmap(map, start - base);
  if (const size_t after = base + kHugePage - start; after > 0) {
    ::munmap(reinterpret_cast<void*>(start + length), after);
  }
  auto* p = reinterpret_cast<uint8_t*>(start);
  // Before the first touch, so that the page faults take huge pages. A kernel without THP refuses
  // (EINVAL), and the mapping stays as it is.
  ::madvise(p, length, MADV_HUGEPAGE);
  return HugePagesArray(p, HugePagesDeleter{length});
}

}  // namespace shardserve

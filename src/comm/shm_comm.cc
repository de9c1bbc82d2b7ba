#include "comm/shm_comm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cpu_relax.h"

namespace shardserve {

namespace {

constexpr uint64_t kMagic = 0x5353484d434f4d31ull;  // "SSHMCOM1"
constexpr int kMaxMembers = 64;

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct alignas(64) MemberState {
  std::atomic<uint64_t> arrive{0};     // barriers entered
  std::atomic<uint64_t> heartbeat{0};  // steady-clock ns, stamped by the heartbeat thread
  std::atomic<uint32_t> attached{0};
  std::atomic<uint32_t> left{0};     // set by a member that closes cleanly
  std::atomic<uint32_t> aborted{0};  // set, after abort_reason, by a member that saw a failure
  char abort_reason[256];
  // Mailbox protocol: the sender writes its mailbox, then bumps sent[dst]; the receiver copies
  // and bumps acked[src] on its own state.
  std::atomic<uint64_t> sent[kMaxMembers];
  std::atomic<uint64_t> acked[kMaxMembers];
};

}  // namespace

struct ShmCommunicator::Header {
  std::atomic<uint64_t> magic;
  uint32_t size;
  uint64_t capacity;
  MemberState members[kMaxMembers];
};

ShmCommunicator::ShmCommunicator(const ShmOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<ShmCommunicator>> ShmCommunicator::Create(
    const ShmOptions& options) {
  if (options.size < 1 || options.size > kMaxMembers || options.rank < 0 ||
      options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory group of ", options.size,
                                                   " members has no member ", options.rank));
  }
  if (options.name.empty() || options.name[0] != '/' ||
      options.name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory name '", options.name, "' must be '/' and one word"));
  }
  std::unique_ptr<ShmCommunicator> c(new ShmCommunicator(options));
  if (absl::Status s = c->Attach(); !s.ok()) return s;
  return c;
}

absl::Status ShmCommunicator::Attach() {
  static_assert(sizeof(Header) <= kShmHeaderBytes, "the header outgrew its room");
  const size_t cap = (options_.capacity_bytes + 63) / 64 * 64;
  options_.capacity_bytes = cap;
  const size_t header = kShmHeaderBytes;
  map_bytes_ = ShmSegmentBytes(options_.size, cap);  // header, 2 slots + mailbox per member
  const auto deadline = std::chrono::steady_clock::now() + options_.attach_timeout;
  int fd = -1;
  if (options_.rank == 0) {
    shm_unlink(options_.name.c_str());  // a stale segment of a crashed run
    fd = shm_open(options_.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0) {
      const int err = errno;
      if (fd >= 0) close(fd);
      return absl::InternalError(
          absl::StrCat("shared memory ", options_.name, ": ", std::strerror(err)));
    }
  } else {
    for (;;) {  // member 0 may not have created it yet
      fd = shm_open(options_.name.c_str(), O_RDWR, 0600);
      struct stat st;
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == map_bytes_) break;
      if (fd >= 0) close(fd);
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("shared memory ", options_.name, ": ",
                                                        Name(0), " did not create it within ",
                                                        options_.attach_timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    return absl::InternalError(absl::StrCat("mmap of ", options_.name, ": ", std::strerror(errno)));
  }
  header_ = static_cast<Header*>(map_);
  data_ = static_cast<uint8_t*>(map_) + header;
  if (options_.rank == 0) {
    header_->size = static_cast<uint32_t>(options_.size);
    header_->capacity = cap;
    header_->magic.store(kMagic, std::memory_order_release);
  } else {
    while (header_->magic.load(std::memory_order_acquire) != kMagic) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("shared memory ", options_.name, " was never initialized"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (header_->size != static_cast<uint32_t>(options_.size) || header_->capacity != cap) {
      return absl::FailedPreconditionError(
          absl::StrCat("shared memory ", options_.name, " is for ", header_->size, " members of ",
                       header_->capacity, " bytes, not ", options_.size, " of ", cap));
    }
  }
  MemberState& me = header_->members[options_.rank];
  me.heartbeat.store(NowNs(), std::memory_order_release);
  me.attached.store(1, std::memory_order_release);
  heartbeat_ = std::thread([this] {
    while (!stop_.load()) {
      header_->members[options_.rank].heartbeat.store(NowNs(), std::memory_order_release);
      std::this_thread::sleep_for(options_.peer_timeout / 10);
    }
  });
  // Everyone attached: the name is no longer needed.
  for (int m = 0; m < options_.size; ++m) {
    while (header_->members[m].attached.load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("shared memory ", options_.name, ": ",
                                                        Name(m), " did not attach within ",
                                                        options_.attach_timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (absl::Status s = Barrier(); !s.ok()) return s;
  if (options_.rank == 0) shm_unlink(options_.name.c_str());
  return absl::OkStatus();
}

ShmCommunicator::~ShmCommunicator() {
  stop_.store(true);
  if (heartbeat_.joinable()) heartbeat_.join();
  if (header_ != nullptr) header_->members[options_.rank].left.store(1, std::memory_order_release);
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

std::string ShmCommunicator::Name(int member) const {
  if (member >= 0 && member < static_cast<int>(options_.member_names.size())) {
    return options_.member_names[member];
  }
  return absl::StrCat("member ", member);
}

float* ShmCommunicator::Slot(int set, int member) const {
  return reinterpret_cast<float*>(data_ + (static_cast<size_t>(set) * options_.size + member) *
                                              options_.capacity_bytes);
}

uint8_t* ShmCommunicator::Mailbox(int member) const {
  return data_ + (2 * static_cast<size_t>(options_.size) + member) * options_.capacity_bytes;
}

absl::Status ShmCommunicator::CheckPeer(int peer) const {
  const MemberState& m = header_->members[peer];
  if (m.aborted.load(std::memory_order_acquire)) {
    return absl::UnavailableError(
        absl::StrCat(std::string(m.abort_reason), " (reported by ", Name(peer), ")"));
  }
  if (m.left.load(std::memory_order_acquire)) {
    return absl::UnavailableError(absl::StrCat(Name(peer), " left the group"));
  }
  const uint64_t beat = m.heartbeat.load(std::memory_order_acquire);
  const uint64_t now = NowNs();
  const uint64_t limit =
      std::chrono::duration_cast<std::chrono::nanoseconds>(options_.peer_timeout).count();
  if (now > beat && now - beat > limit) {
    return absl::UnavailableError(absl::StrCat(Name(peer), " stopped answering (no heartbeat for ",
                                               (now - beat) / 1000000, " ms)"));
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Abort(const absl::Status& s) {
  MemberState& me = header_->members[options_.rank];
  if (s.ok() || me.aborted.load()) return s;
  const std::string reason(s.message());
  std::snprintf(me.abort_reason, sizeof(me.abort_reason), "%s", reason.c_str());
  me.aborted.store(1, std::memory_order_release);
  return s;
}

template <typename Pred>
absl::Status ShmCommunicator::WaitUntil(Pred done, int peer) {
  for (uint64_t spins = 0; !done(); ++spins) {
    if (spins < 2000) {
      CpuRelax();
      continue;
    }
    if (spins % 64 == 0) {
      // Any member's abort (it saw a failure first) ends the wait with its reason; heartbeats
      // are checked for the awaited peer (every member when peer < 0).
      for (int m = 0; m < options_.size; ++m) {
        if (m == options_.rank) continue;
        const bool aborted = header_->members[m].aborted.load(std::memory_order_acquire);
        if (aborted || peer < 0 || m == peer) {
          if (absl::Status s = CheckPeer(m); !s.ok()) return Abort(s);
        }
      }
    }
    if (spins < 20000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::WaitAll(uint64_t target) {
  for (int m = 0; m < options_.size; ++m) {
    const MemberState& st = header_->members[m];
    absl::Status s =
        WaitUntil([&] { return st.arrive.load(std::memory_order_acquire) >= target; }, m);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Barrier() {
  const uint64_t target = ++barriers_;
  header_->members[options_.rank].arrive.store(target, std::memory_order_release);
  return WaitAll(target);
}

absl::Status ShmCommunicator::AllReduceSum(float* data, size_t count) {
  const size_t chunk = options_.capacity_bytes / sizeof(float);
  const int n = options_.size, me = options_.rank;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t len = std::min(chunk, count - off);
    const int set = NextSet();
    std::memcpy(Slot(set, me), data + off, len * sizeof(float));
    if (absl::Status s = Barrier(); !s.ok()) return s;
    // Reduce-scatter: this member sums its partition of every slot, in member order, into its
    // own slot (no one else reads this partition of it).
    const size_t lo = len * me / n, hi = len * (me + 1) / n;
    for (size_t i = lo; i < hi; ++i) {
      float sum = Slot(set, 0)[i];
      for (int m = 1; m < n; ++m) sum += Slot(set, m)[i];
      Slot(set, me)[i] = sum;
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    // All-gather of the reduced partitions.
    for (int m = 0; m < n; ++m) {
      const size_t mlo = len * m / n, mhi = len * (m + 1) / n;
      std::memcpy(data + off + mlo, Slot(set, m) + mlo, (mhi - mlo) * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::AllGather(const float* send, size_t count, float* recv) {
  const size_t chunk = options_.capacity_bytes / sizeof(float);
  const int n = options_.size;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t len = std::min(chunk, count - off);
    const int set = NextSet();
    std::memcpy(Slot(set, options_.rank), send + off, len * sizeof(float));
    if (absl::Status s = Barrier(); !s.ok()) return s;
    for (int m = 0; m < n; ++m) {
      std::memcpy(recv + m * count + off, Slot(set, m), len * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::ReduceScatterSum(const float* send, size_t count, float* recv) {
  const int n = options_.size, me = options_.rank;
  const size_t chunk = options_.capacity_bytes / sizeof(float) / n;
  if (chunk == 0) return absl::InvalidArgumentError("shared-memory slot too small");
  for (size_t off = 0; off < count; off += chunk) {
    const size_t len = std::min(chunk, count - off);
    const int set = NextSet();
    float* mine = Slot(set, me);
    for (int m = 0; m < n; ++m) {
      std::memcpy(mine + m * len, send + m * count + off, len * sizeof(float));
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    for (size_t i = 0; i < len; ++i) {
      float sum = 0;
      for (int m = 0; m < n; ++m) sum += Slot(set, m)[me * len + i];
      recv[off + i] = sum;
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= options_.size) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " is not a member"));
  }
  const size_t chunk = options_.capacity_bytes;
  auto* p = static_cast<uint8_t*>(data);
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t len = std::min(chunk, bytes - off);
    const int set = NextSet();
    if (options_.rank == root) std::memcpy(Slot(set, root), p + off, len);
    if (absl::Status s = Barrier(); !s.ok()) return s;
    if (options_.rank != root) std::memcpy(p + off, Slot(set, root), len);
  }
  return absl::OkStatus();
}

bool ShmCommunicator::MailboxFree() const {
  // One mailbox per sender: free once every receiver acknowledged all it was sent.
  const MemberState& me = header_->members[options_.rank];
  for (int m = 0; m < options_.size; ++m) {
    if (header_->members[m].acked[options_.rank].load(std::memory_order_acquire) <
        me.sent[m].load(std::memory_order_relaxed)) {
      return false;
    }
  }
  return true;
}

absl::Status ShmCommunicator::Send(const void* data, size_t bytes, int peer) {
  if (peer < 0 || peer >= options_.size || peer == options_.rank) {
    return absl::InvalidArgumentError(absl::StrCat("cannot send to member ", peer));
  }
  MemberState& me = header_->members[options_.rank];
  const auto* p = static_cast<const uint8_t*>(data);
  size_t off = 0;
  do {  // a zero-byte message still makes one round
    const size_t len = std::min(options_.capacity_bytes, bytes - off);
    if (absl::Status s = WaitUntil([&] { return MailboxFree(); }, peer); !s.ok()) return s;
    std::memcpy(Mailbox(options_.rank), p + off, len);
    me.sent[peer].fetch_add(1, std::memory_order_release);
    off += len;
  } while (off < bytes);
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Recv(void* data, size_t bytes, int peer) {
  if (peer < 0 || peer >= options_.size || peer == options_.rank) {
    return absl::InvalidArgumentError(absl::StrCat("cannot receive from member ", peer));
  }
  MemberState& me = header_->members[options_.rank];
  const MemberState& them = header_->members[peer];
  auto* p = static_cast<uint8_t*>(data);
  size_t off = 0;
  do {
    const size_t len = std::min(options_.capacity_bytes, bytes - off);
    const uint64_t acked = me.acked[peer].load(std::memory_order_relaxed);
    absl::Status s = WaitUntil(
        [&] { return them.sent[options_.rank].load(std::memory_order_acquire) > acked; }, peer);
    if (!s.ok()) return s;
    std::memcpy(p + off, Mailbox(peer), len);
    me.acked[peer].store(acked + 1, std::memory_order_release);
    off += len;
  } while (off < bytes);
  return absl::OkStatus();
}

}  // namespace shardserve

#include "comm/tcp_comm.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "comm/handshake.h"

namespace shardserve {
namespace {

constexpr uint32_t kMagic = 0x53535443;  // "SSTC"
constexpr uint32_t kData = 1, kHeartbeat = 2, kBye = 3, kAbort = 4;

struct FrameHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t bytes;
};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::vector<size_t> Partition(size_t count, int n) {
  std::vector<size_t> offsets(n + 1);
  for (int b = 0; b <= n; ++b) offsets[b] = count * b / n;
  return offsets;
}

}  // namespace

TcpCommunicator::TcpCommunicator(const TcpOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::Create(const TcpOptions& options,
                                                                         Socket listener) {
  const int n = static_cast<int>(options.members.size());
  if (options.rank < 0 || options.rank >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCP group of ", n, " members has no member ", options.rank));
  }
  std::unique_ptr<TcpCommunicator> c(new TcpCommunicator(options));
  for (int m = 0; m < n; ++m) {
    if (c->options_.members[m].name.empty()) {
      c->options_.members[m].name = absl::StrCat("member ", m);
    }
  }
  if (absl::Status s = c->Connect(std::move(listener)); !s.ok()) return s;
  c->heartbeat_ = std::thread([raw = c.get()] {
    const auto every = raw->options_.peer_timeout / 4;
    while (!raw->stop_.load()) {
      std::this_thread::sleep_for(every);
      for (size_t m = 0; m < raw->peers_.size(); ++m) {
        Peer* p = raw->peers_[m].get();
        if (p == nullptr || NowMs() - p->last_write_ms.load() < every.count()) continue;
        if (!p->write_mu.TryLock()) continue;  // a data frame is being written: the link is busy
        FrameHeader h{kMagic, kHeartbeat, 0};
        if (p->sock.WriteAll(&h, sizeof(h)).ok()) p->last_write_ms.store(NowMs());
        p->write_mu.Unlock();
      }
    }
  });
  return c;
}

absl::Status TcpCommunicator::Connect(Socket listener) {
  const int n = size(), me = rank();
  if (options_.secret.size() < kMinSecretBytes) {
    return absl::FailedPreconditionError("a TCP group needs its secret to prove its members");
  }
  peers_.resize(n);
  const Deadline deadline = std::chrono::steady_clock::now() + options_.connect_timeout;
  const std::string context = absl::StrCat("tcp-group ", options_.group_id);
  for (int m = 0; m < me; ++m) {  // connect to every lower member
    const TcpMember& peer = options_.members[m];
    auto sock = ConnectProven(peer.host, peer.port, options_.secret, context,
                              static_cast<uint32_t>(me), deadline, options_.peer_timeout);
    if (!sock.ok()) {
      return absl::Status(sock.status().code(),
                          absl::StrCat(peer.name, " at ", peer.host, ":", peer.port, ": ",
                                       sock.status().message()));
    }
    peers_[m] = std::make_unique<Peer>();
    peers_[m]->sock = std::move(*sock);
  }
  absl::Mutex mu;  // guards peers_ while higher members are admitted
  const absl::Status accepted = AcceptVerified(
      listener, options_.secret, context, n - 1 - me, deadline, options_.peer_timeout,
      [&](uint32_t member, Socket& sock) {
        absl::MutexLock lock(&mu);
        if (static_cast<int>(member) <= me || static_cast<int>(member) >= n || peers_[member]) {
          return false;  // not a higher member still missing
        }
        peers_[member] = std::make_unique<Peer>();
        peers_[member]->sock = std::move(sock);
        return true;
      });
  if (!accepted.ok()) {
    std::string missing;
    for (int m = me + 1; m < n; ++m) {
      if (!peers_[m])
        absl::StrAppend(&missing, missing.empty() ? "" : ", ", options_.members[m].name);
    }
    return absl::DeadlineExceededError(absl::StrCat("TCP group: ", missing,
                                                    " did not connect within ",
                                                    options_.connect_timeout.count(), " ms"));
  }
  for (auto& p : peers_) {
    if (p) p->sock.SetSendTimeout(options_.send_timeout);
  }
  return absl::OkStatus();
}

TcpCommunicator::~TcpCommunicator() {
  stop_.store(true);
  if (heartbeat_.joinable()) heartbeat_.join();
  for (auto& p : peers_) {
    if (!p) continue;
    absl::MutexLock lock(&p->write_mu);
    FrameHeader h{kMagic, kBye, 0};
    (void)p->sock.WriteAll(&h, sizeof(h));
  }
}

absl::Status TcpCommunicator::Fail(int peer, const absl::Status& s) const {
  const std::string& name = options_.members[peer].name;
  if (s.code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::UnavailableError(absl::StrCat(name, " stopped answering (", s.message(), ")"));
  }
  return absl::UnavailableError(absl::StrCat(name, " died or left: ", s.message()));
}

absl::Status TcpCommunicator::WriteFrame(int peer, uint32_t type, const void* data, size_t bytes) {
  Peer& p = *peers_[peer];
  absl::MutexLock lock(&p.write_mu);
  FrameHeader h{kMagic, type, bytes};
  absl::Status s = p.sock.WriteAll(&h, sizeof(h));
  if (s.ok() && bytes > 0) s = p.sock.WriteAll(data, bytes);
  p.last_write_ms.store(NowMs());
  return s.ok() ? s : Fail(peer, s);
}

absl::Status TcpCommunicator::Abort(const absl::Status& s) {
  if (s.ok() || aborted_) return s;
  aborted_ = true;
  const std::string reason(s.message());
  for (size_t m = 0; m < peers_.size(); ++m) {
    if (peers_[m]) (void)WriteFrame(static_cast<int>(m), kAbort, reason.data(), reason.size());
  }
  return s;
}

absl::Status TcpCommunicator::Send(const void* data, size_t bytes, int peer) {
  if (peer < 0 || peer >= size() || peer == rank()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot send to member ", peer));
  }
  return Abort(WriteFrame(peer, kData, data, bytes));
}

absl::Status TcpCommunicator::Recv(void* data, size_t bytes, int peer) {
  if (peer < 0 || peer >= size() || peer == rank()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot receive from member ", peer));
  }
  return Abort(RecvFrame(data, bytes, peer));
}

absl::Status TcpCommunicator::RecvFrame(void* data, size_t bytes, int peer) {
  Socket& sock = peers_[peer]->sock;
  for (;;) {
    FrameHeader h;
    if (absl::Status s = sock.ReadAll(&h, sizeof(h), options_.peer_timeout); !s.ok()) {
      return Fail(peer, s);
    }
    if (h.magic != kMagic) {
      return absl::DataLossError(absl::StrCat("corrupt frame from ", options_.members[peer].name));
    }
    if (h.type == kHeartbeat) continue;
    if (h.type == kBye) {
      return absl::UnavailableError(absl::StrCat(options_.members[peer].name, " left the group"));
    }
    if (h.type == kAbort) {
      std::string reason(std::min<uint64_t>(h.bytes, 4096), '\0');
      (void)sock.ReadAll(reason.data(), reason.size(), options_.peer_timeout);
      return absl::UnavailableError(
          absl::StrCat(reason, " (reported by ", options_.members[peer].name, ")"));
    }
    if (h.bytes != bytes) {
      return absl::DataLossError(absl::StrCat("expected ", bytes, " bytes from ",
                                              options_.members[peer].name, ", got ", h.bytes));
    }
    if (absl::Status s = sock.ReadAll(data, bytes, options_.peer_timeout); !s.ok()) {
      return Fail(peer, s);
    }
    return absl::OkStatus();
  }
}

absl::Status TcpCommunicator::SendRecv(const void* send, size_t send_bytes, int to, void* recv,
                                       size_t recv_bytes, int from) {
  absl::Status send_status;
  std::thread sender([&] { send_status = WriteFrame(to, kData, send, send_bytes); });
  absl::Status recv_status = RecvFrame(recv, recv_bytes, from);
  sender.join();
  return Abort(!recv_status.ok() ? recv_status : send_status);
}

absl::Status TcpCommunicator::RingReduceScatter(float* data, const std::vector<size_t>& offsets) {
  const int n = size(), me = rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<float> tmp;
  for (int s = 0; s < n - 1; ++s) {
    const int send_b = ((me - s - 1) % n + n) % n, recv_b = ((me - s - 2) % n + n) % n;
    const size_t send_len = offsets[send_b + 1] - offsets[send_b];
    const size_t recv_len = offsets[recv_b + 1] - offsets[recv_b];
    tmp.resize(recv_len);
    absl::Status st = SendRecv(data + offsets[send_b], send_len * sizeof(float), next, tmp.data(),
                               recv_len * sizeof(float), prev);
    if (!st.ok()) return st;
    float* dst = data + offsets[recv_b];
    for (size_t i = 0; i < recv_len; ++i) dst[i] += tmp[i];
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::RingAllGather(float* data, const std::vector<size_t>& offsets) {
  const int n = size(), me = rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  for (int s = 0; s < n - 1; ++s) {
    const int send_b = ((me - s) % n + n) % n, recv_b = ((me - s - 1) % n + n) % n;
    absl::Status st = SendRecv(
        data + offsets[send_b], (offsets[send_b + 1] - offsets[send_b]) * sizeof(float), next,
        data + offsets[recv_b], (offsets[recv_b + 1] - offsets[recv_b]) * sizeof(float), prev);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::AllReduceSum(float* data, size_t count) {
  if (size() == 1) return absl::OkStatus();
  const std::vector<size_t> offsets = Partition(count, size());
  if (absl::Status s = RingReduceScatter(data, offsets); !s.ok()) return s;
  return RingAllGather(data, offsets);
}

absl::Status TcpCommunicator::AllGather(const float* send, size_t count, float* recv) {
  std::memcpy(recv + rank() * count, send, count * sizeof(float));
  return RingAllGather(recv, Partition(count * size(), size()));
}

absl::Status TcpCommunicator::ReduceScatterSum(const float* send, size_t count, float* recv) {
  std::vector<float> work(send, send + count * size());
  if (absl::Status s = RingReduceScatter(work.data(), Partition(count * size(), size())); !s.ok()) {
    return s;
  }
  std::memcpy(recv, work.data() + rank() * count, count * sizeof(float));
  return absl::OkStatus();
}

absl::Status TcpCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " is not a member"));
  }
  if (rank() != root) return Recv(data, bytes, root);
  for (int m = 0; m < size(); ++m) {
    if (m == root) continue;
    if (absl::Status s = Send(data, bytes, m); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::Barrier() {
  float token = 0;
  return AllReduceSum(&token, 1);
}

}  // namespace shardserve

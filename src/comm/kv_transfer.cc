#include "comm/kv_transfer.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"

namespace shardserve {
namespace {

// Active message ids and the wire (little-endian hosts only, as every target of ours).
constexpr unsigned kPullId = 0x5353;   // puller -> exporter: PullHeader, ranges as data
constexpr unsigned kReplyId = 0x5354;  // exporter -> puller: ReplyHeader (+ message), bytes as data
constexpr unsigned kReleaseId = 0x5355;  // puller -> exporter: PullHeader (no ranges)
constexpr uint32_t kMagic = 0x4b565031;  // "KVP1"

struct PullHeader {
  uint32_t magic;
  uint32_t ranges;
  uint64_t request_id;
  KvTicket ticket;
};
struct WireRange {
  uint32_t segment;
  uint32_t pad;
  uint64_t offset;
  uint64_t size;
};
struct ReplyHeader {
  uint32_t magic;
  uint32_t code;  // absl::StatusCode
  uint64_t request_id;
  uint64_t bytes;
};
constexpr size_t kMaxMessage = 512;

std::string UcsError(const char* what, ucs_status_t s) {
  return absl::StrCat("UCX ", what, ": ", ucs_status_string(s));
}

// A UCP context and one worker with active messages and a wakeup fd.
struct Ucx {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;

  absl::Status Init() {
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) return absl::UnavailableError(UcsError("config", s));
    s = ucp_init(&p, cfg, &context);
    ucp_config_release(cfg);
    if (s != UCS_OK) return absl::UnavailableError(UcsError("init", s));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(context, &wp, &worker);
    if (s != UCS_OK) return absl::UnavailableError(UcsError("worker", s));
    s = ucp_worker_get_efd(worker, &efd);
    if (s != UCS_OK) return absl::UnavailableError(UcsError("wakeup fd", s));
    return absl::OkStatus();
  }
  absl::Status SetHandler(unsigned id, ucp_am_recv_callback_t cb, void* arg) {
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG;
    h.id = id;
    h.cb = cb;
    h.arg = arg;
    const ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &h);
    return s == UCS_OK ? absl::OkStatus() : absl::UnavailableError(UcsError("handler", s));
  }
  // One round of progress; how many events it handled.
  unsigned Progress() { return ucp_worker_progress(worker); }
  // Progresses until nothing is left to do, then waits for an event up to `ms` (-1: for ever).
  void ProgressOrWait(int ms) {
    while (ucp_worker_progress(worker) != 0) {
    }
    if (ucp_worker_arm(worker) == UCS_ERR_BUSY) return;
    pollfd p{efd, POLLIN, 0};
    poll(&p, 1, ms);
  }
  // Closes an endpoint (forcibly: a peer may be gone), progressing until it is closed or 2 s.
  void Close(ucp_ep_h ep) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
    const absl::Time end = absl::Now() + absl::Seconds(2);
    while (ucp_request_check_status(r) == UCS_INPROGRESS && absl::Now() < end) {
      ucp_worker_progress(worker);
    }
    ucp_request_free(r);
  }
  ~Ucx() {
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }
};

absl::StatusCode CodeOf(uint32_t code) {
  return code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)
             ? static_cast<absl::StatusCode>(code)
             : absl::StatusCode::kUnknown;
}

}  // namespace

absl::StatusOr<KvTicket> NewKvTicket() {
  KvTicket t;
  if (RAND_bytes(t.data(), static_cast<int>(t.size())) != 1) {
    return absl::InternalError("no random bytes for a KV ticket (OpenSSL RAND_bytes)");
  }
  return t;
}

// ------------------------------------------------------------------------------------------------
// The exporter

struct KvExporter::Impl {
  struct Offer {
    KvTicket ticket;
    std::vector<KvSegment> segments;
    absl::Time deadline;
    int inflight = 0;                // sends of it not completed yet
    std::vector<ucp_ep_h> send_eps;  // their reply endpoints (force-closed once it is withdrawn)
    bool withdrawn = false;
  };
  // A send in flight: its header (kept until completion) and the offer it reads.
  struct Send {
    Impl* impl;
    uint64_t offer_id;
    ucp_ep_h ep;
    ReplyHeader header;
    std::vector<ucp_dt_iov_t> iov;
  };
  // A pull whose ranges arrive by rendezvous: received into `ranges`, answered on completion.
  struct Pending {
    Impl* impl;
    ucp_ep_h ep;
    PullHeader header;
    std::vector<WireRange> ranges;
  };

  KvTransferLimits limits;
  Ucx ucx;  // its worker: the progress thread's alone
  std::string address;
  std::thread thread;
  mutable absl::Mutex mu;
  std::map<uint64_t, Offer> offers ABSL_GUARDED_BY(mu);  // by id
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  bool stop ABSL_GUARDED_BY(mu) = false;
  bool paused ABSL_GUARDED_BY(mu) = false;
  bool close_pending ABSL_GUARDED_BY(mu) = false;
  std::function<void(const KvTicket&)> on_release ABSL_GUARDED_BY(mu);

  // The offer under `ticket` (constant-time compares), or null.
  Offer* Find(const KvTicket& ticket, uint64_t* id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Offer* found = nullptr;
    for (auto& [oid, o] : offers) {
      if (CRYPTO_memcmp(o.ticket.data(), ticket.data(), ticket.size()) == 0 && !o.withdrawn) {
        found = &o;
        *id = oid;
      }
    }
    return found;
  }

  // An error reply: the header with the code, the message as its data (no offer is read).
  struct ErrorReply {
    ReplyHeader header;
    std::string message;
  };
  static void ErrorSent(void* request, ucs_status_t, void* user) {
    delete static_cast<ErrorReply*>(user);
    if (request != nullptr) ucp_request_free(request);
  }
  void Reply(ucp_ep_h ep, uint64_t request_id, const absl::Status& status) {
    auto* e = new ErrorReply{{kMagic, static_cast<uint32_t>(status.code()), request_id, 0},
                             std::string(status.message().substr(0, kMaxMessage))};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = ErrorSent;
    p.user_data = e;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, kReplyId, &e->header, sizeof(e->header),
                                         e->message.data(), e->message.size(), &p);
    if (!UCS_PTR_IS_PTR(r)) ErrorSent(nullptr, UCS_PTR_STATUS(r), e);
  }

  static void SendDone(void* request, ucs_status_t, void* user) {
    auto* s = static_cast<Send*>(user);
    s->impl->Finish(s);
    if (request != nullptr) ucp_request_free(request);
  }

  void Finish(Send* s) {
    {
      absl::MutexLock lock(&mu);
      auto it = offers.find(s->offer_id);
      if (it != offers.end()) {
        Offer& o = it->second;
        --o.inflight;
        auto e = std::find(o.send_eps.begin(), o.send_eps.end(), s->ep);
        if (e != o.send_eps.end()) o.send_eps.erase(e);
      }
    }
    delete s;
  }

  // Answers a pull: checks the ticket, the ranges and the sizes, then sends the bytes.
  void Answer(ucp_ep_h ep, const PullHeader& h, const WireRange* ranges, size_t n) {
    mu.Lock();
    uint64_t id = 0;
    Offer* o = Find(h.ticket, &id);
    if (o == nullptr || absl::Now() > o->deadline) {
      mu.Unlock();
      return Reply(ep, h.request_id,
                   absl::PermissionDeniedError("no KV offer under this ticket (never made, "
                                               "withdrawn or expired)"));
    }
    auto* s = new Send{this, id, ep, {kMagic, 0, h.request_id, 0}, {}};
    s->iov.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const WireRange& r = ranges[i];
      if (r.segment >= o->segments.size() || r.offset > o->segments[r.segment].size ||
          r.size > o->segments[r.segment].size - r.offset ||
          s->header.bytes + r.size > limits.max_pull_bytes) {
        mu.Unlock();
        delete s;
        return Reply(ep, h.request_id,
                     absl::InvalidArgumentError(absl::StrCat(
                         "KV pull range ", i, " (segment ", r.segment, ", offset ", r.offset, ", ",
                         r.size, " bytes) is outside the offer or over the pull limit")));
      }
      s->iov.push_back(
          {const_cast<char*>(static_cast<const char*>(o->segments[r.segment].data)) + r.offset,
           r.size});
      s->header.bytes += r.size;
    }
    ++o->inflight;
    o->send_eps.push_back(ep);
    mu.Unlock();
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    p.cb.send = SendDone;
    p.user_data = s;
    p.datatype = ucp_dt_make_iov();
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, kReplyId, &s->header, sizeof(s->header), s->iov.data(),
                                         s->iov.size(), &p);
    if (!UCS_PTR_IS_PTR(r)) SendDone(nullptr, UCS_PTR_STATUS(r), s);
  }

  static void RangesReceived(void* request, ucs_status_t status, size_t, void* user) {
    auto* pending = static_cast<Pending*>(user);
    if (status == UCS_OK) {
      pending->impl->Answer(pending->ep, pending->header, pending->ranges.data(),
                            pending->ranges.size());
    }
    delete pending;
    if (request != nullptr) ucp_request_free(request);
  }

  // A puller's header, where it can be answered; false: dropped (nowhere to answer).
  static bool ReadHeader(const void* header, size_t header_length, const ucp_am_recv_param_t* param,
                         PullHeader* h) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return false;
    if (header_length != sizeof(*h)) return false;
    std::memcpy(h, header, sizeof(*h));
    return true;
  }

  static ucs_status_t OnPull(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    PullHeader h;
    if (!ReadHeader(header, header_length, param, &h)) return UCS_ERR_INVALID_PARAM;
    if (h.magic != kMagic || h.ranges > self->limits.max_ranges ||
        length != static_cast<size_t>(h.ranges) * sizeof(WireRange)) {
      self->Reply(param->reply_ep, h.request_id,
                  absl::InvalidArgumentError("a malformed KV pull (its header or its ranges)"));
      return UCS_OK;
    }
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      auto* pending = new Pending{self, param->reply_ep, h, std::vector<WireRange>(h.ranges)};
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.recv_am = RangesReceived;
      p.user_data = pending;
      ucs_status_ptr_t r =
          ucp_am_recv_data_nbx(self->ucx.worker, data, pending->ranges.data(), length, &p);
      if (!UCS_PTR_IS_PTR(r)) RangesReceived(nullptr, UCS_PTR_STATUS(r), length, pending);
      return UCS_OK;
    }
    std::vector<WireRange> ranges(h.ranges);
    if (length != 0) std::memcpy(ranges.data(), data, length);
    self->Answer(param->reply_ep, h, ranges.data(), ranges.size());
    return UCS_OK;
  }

  // The puller is done with an offer: its owner hears of it (the offer stays until withdrawn).
  static ucs_status_t OnRelease(void* arg, const void* header, size_t header_length, void*,
                                size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    PullHeader h;
    if (!ReadHeader(header, header_length, param, &h)) return UCS_ERR_INVALID_PARAM;
    if (h.magic != kMagic || h.ranges != 0 || length != 0) {
      self->Reply(param->reply_ep, h.request_id,
                  absl::InvalidArgumentError("a malformed KV release"));
      return UCS_OK;
    }
    std::function<void(const KvTicket&)> told;
    {
      absl::MutexLock lock(&self->mu);
      uint64_t id = 0;
      if (self->Find(h.ticket, &id) != nullptr) told = self->on_release;
    }
    if (!told) {
      self->Reply(param->reply_ep, h.request_id,
                  absl::PermissionDeniedError("no KV offer under this ticket to release"));
      return UCS_OK;
    }
    told(h.ticket);
    self->Reply(param->reply_ep, h.request_id, absl::OkStatus());
    return UCS_OK;
  }

  void Loop() {
    for (;;) {
      std::vector<ucp_ep_h> eps;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](Impl* self)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu) { return self->stop || !self->paused; },
            this));
        if (stop) return;
        if (close_pending) {  // withdrawn offers' sends that would not finish: their peers go
          close_pending = false;
          for (auto& [id, o] : offers) {
            if (o.withdrawn) eps.insert(eps.end(), o.send_eps.begin(), o.send_eps.end());
          }
        }
      }
      for (ucp_ep_h ep : eps) ucx.Close(ep);
      ucx.ProgressOrWait(100);
    }
  }
};

KvExporter::KvExporter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<KvExporter>> KvExporter::Create(KvTransferLimits limits) {
  auto impl = std::make_unique<Impl>();
  impl->limits = limits;
  if (absl::Status s = impl->ucx.Init(); !s.ok()) return s;
  if (absl::Status s = impl->ucx.SetHandler(kPullId, Impl::OnPull, impl.get()); !s.ok()) return s;
  if (absl::Status s = impl->ucx.SetHandler(kReleaseId, Impl::OnRelease, impl.get()); !s.ok()) {
    return s;
  }
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  if (ucs_status_t s = ucp_worker_get_address(impl->ucx.worker, &addr, &len); s != UCS_OK) {
    return absl::UnavailableError(UcsError("worker address", s));
  }
  impl->address.assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(impl->ucx.worker, addr);
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<KvExporter>(new KvExporter(std::move(impl)));
}

KvExporter::~KvExporter() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stop = true;
  }
  ucp_worker_signal(impl_->ucx.worker);
  impl_->thread.join();
}

const std::string& KvExporter::address() const { return impl_->address; }

absl::Status KvExporter::Offer(const KvTicket& ticket, std::vector<KvSegment> segments,
                               absl::Time deadline) {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->offers.size() >= impl_->limits.max_offers) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV offers: ", impl_->offers.size(), " held, the limit"));
  }
  uint64_t unused;
  if (impl_->Find(ticket, &unused) != nullptr) {
    return absl::AlreadyExistsError("a KV offer under this ticket is held already");
  }
  impl_->offers.emplace(impl_->next_id++,
                        Impl::Offer{ticket, std::move(segments), deadline, 0, {}, false});
  return absl::OkStatus();
}

bool KvExporter::Withdraw(const KvTicket& ticket) {
  Impl* impl = impl_.get();
  absl::MutexLock lock(&impl->mu);
  uint64_t id = 0;
  if (impl->Find(ticket, &id) == nullptr) return false;
  impl->offers.at(id).withdrawn = true;
  struct Wait {
    Impl* impl;
    uint64_t id;
  } wait{impl, id};
  const absl::Condition drained(
      +[](Wait* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->impl->mu) {
        return w->impl->offers.at(w->id).inflight == 0 || w->impl->paused;
      },
      &wait);
  // The sends in flight finish, or (a peer that does not take its bytes) their endpoints are
  // closed after a grace, which ends them.
  if (!impl->mu.AwaitWithTimeout(drained, absl::Seconds(5))) {
    impl->close_pending = true;
    ucp_worker_signal(impl->ucx.worker);
    impl->mu.Await(drained);
  }
  impl->offers.erase(id);
  return true;
}

void KvExporter::OnRelease(std::function<void(const KvTicket&)> released) {
  absl::MutexLock lock(&impl_->mu);
  impl_->on_release = std::move(released);
}

size_t KvExporter::offers() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->offers.size();
}

void KvExporter::PauseForTest() {
  absl::MutexLock lock(&impl_->mu);
  impl_->paused = true;
  ucp_worker_signal(impl_->ucx.worker);
}

void KvExporter::ResumeForTest() {
  absl::MutexLock lock(&impl_->mu);
  impl_->paused = false;
}

// ------------------------------------------------------------------------------------------------
// The puller

struct KvPuller::Impl {
  struct Current {
    ucp_ep_h ep = nullptr;  // where the pull went
    void* recv = nullptr;   // the bytes' rendezvous receive while in flight (it writes `iov`)
    uint64_t request_id = 0;
    uint64_t bytes = 0;
    bool done = false;
    absl::Status status;
    std::vector<ucp_dt_iov_t> iov;
  };

  KvTransferLimits limits;
  // One pull at a time: Pull holds mu, and the worker's callbacks run inside its progress calls.
  absl::Mutex mu;
  Ucx ucx ABSL_GUARDED_BY(mu);
  std::map<std::string, ucp_ep_h> eps ABSL_GUARDED_BY(mu);
  std::map<ucp_ep_h, bool> failed ABSL_GUARDED_BY(mu);  // endpoints whose peer went away
  uint64_t next_request ABSL_GUARDED_BY(mu) = 1;
  Current* current ABSL_GUARDED_BY(mu) = nullptr;

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    self->mu.AssertHeld();
    self->failed[ep] = true;
    // Another endpoint's peer (one that went away before) says nothing of this pull.
    if (self->current != nullptr && self->current->ep == ep && !self->current->done) {
      self->current->done = true;
      self->current->status = absl::UnavailableError(
          absl::StrCat("the KV exporter went away (", ucs_status_string(status), ")"));
    }
  }

  static void DataReceived(void* request, ucs_status_t status, size_t, void* user) {
    auto* c = static_cast<Current*>(user);
    c->recv = nullptr;
    c->done = true;
    if (status != UCS_OK) {
      c->status = absl::UnavailableError(UcsError("KV receive", status));
    }
    if (request != nullptr) ucp_request_free(request);
  }

  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    self->mu.AssertHeld();
    ReplyHeader h;
    if (header_length != sizeof(h)) return UCS_OK;
    std::memcpy(&h, header, sizeof(h));
    Current* c = self->current;
    // A late reply to a pull that gave up: dropped (a rendezvous is then not fetched).
    if (c == nullptr || c->done || h.magic != kMagic || h.request_id != c->request_id) {
      return UCS_OK;
    }
    const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    if (h.code != 0) {
      std::string msg;
      if (!rndv) msg.assign(static_cast<const char*>(data), std::min(length, kMaxMessage));
      c->done = true;
      c->status = absl::Status(CodeOf(h.code), msg);
      return UCS_OK;
    }
    if (h.bytes != c->bytes || length != c->bytes) {
      c->done = true;
      c->status = absl::DataLossError(
          absl::StrCat("the KV exporter sent ", length, " bytes where ", c->bytes, " were asked"));
      return UCS_OK;
    }
    if (rndv) {
      ucp_request_param_t p{};
      p.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
      p.cb.recv_am = DataReceived;
      p.user_data = c;
      p.datatype = ucp_dt_make_iov();
      ucs_status_ptr_t r =
          ucp_am_recv_data_nbx(self->ucx.worker, data, c->iov.data(), c->iov.size(), &p);
      if (UCS_PTR_IS_PTR(r)) {
        c->recv = r;
      } else {
        DataReceived(nullptr, UCS_PTR_STATUS(r), length, c);
      }
      return UCS_OK;
    }
    const char* src = static_cast<const char*>(data);
    for (const ucp_dt_iov_t& v : c->iov) {
      std::memcpy(v.buffer, src, v.length);
      src += v.length;
    }
    c->done = true;
    return UCS_OK;
  }

  absl::StatusOr<ucp_ep_h> Endpoint(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = eps.find(address);
    if (it != eps.end()) {
      if (!failed.count(it->second)) return it->second;
      ucx.Close(it->second);
      failed.erase(it->second);
      eps.erase(it);
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(address.data());
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnEpError;
    p.err_handler.arg = this;
    ucp_ep_h ep = nullptr;
    if (ucs_status_t s = ucp_ep_create(ucx.worker, &p, &ep); s != UCS_OK) {
      return absl::UnavailableError(UcsError("connecting to the KV exporter", s));
    }
    eps[address] = ep;
    return ep;
  }

  // Drops an endpoint whose pull gave up (its late bytes must not land in reused memory).
  void Drop(ucp_ep_h ep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = eps.begin(); it != eps.end(); ++it) {
      if (it->second == ep) {
        eps.erase(it);
        break;
      }
    }
    ucx.Close(ep);
    failed.erase(ep);
  }
};

KvPuller::KvPuller(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<KvPuller>> KvPuller::Create(KvTransferLimits limits) {
  auto impl = std::make_unique<Impl>();
  impl->limits = limits;
  {
    absl::MutexLock lock(&impl->mu);
    if (absl::Status s = impl->ucx.Init(); !s.ok()) return s;
    if (absl::Status s = impl->ucx.SetHandler(kReplyId, Impl::OnReply, impl.get()); !s.ok()) {
      return s;
    }
  }
  return std::unique_ptr<KvPuller>(new KvPuller(std::move(impl)));
}

KvPuller::~KvPuller() {
  absl::MutexLock lock(&impl_->mu);
  for (auto& [address, ep] : impl_->eps) impl_->ucx.Close(ep);
  impl_->eps.clear();
}

absl::Status KvPuller::Pull(const std::string& exporter_address, const KvTicket& ticket,
                            const std::vector<KvRange>& ranges, absl::Duration timeout) {
  return Ask(kPullId, exporter_address, ticket, ranges, timeout);
}

absl::Status KvPuller::Release(const std::string& exporter_address, const KvTicket& ticket,
                               absl::Duration timeout) {
  return Ask(kReleaseId, exporter_address, ticket, {}, timeout);
}

namespace {
absl::Status Late(const char* what, uint64_t bytes, absl::Duration timeout) {
  return absl::DeadlineExceededError(absl::StrCat("the KV ", what, " (", bytes,
                                                  " bytes) did not finish within ",
                                                  absl::FormatDuration(timeout)));
}
}  // namespace

absl::Status KvPuller::Ask(unsigned am_id, const std::string& exporter_address,
                           const KvTicket& ticket, const std::vector<KvRange>& ranges,
                           absl::Duration timeout) {
  const char* what = am_id == kPullId ? "pull" : "release";
  absl::MutexLock lock(&impl_->mu);
  if (ranges.size() > impl_->limits.max_ranges) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a KV pull of ", ranges.size(), " ranges (the limit is ", impl_->limits.max_ranges, ")"));
  }
  // On the heap: a receive that outlives a pull given up keeps writing into it (see the end).
  auto owned = std::make_unique<Impl::Current>();
  Impl::Current& c = *owned;
  c.request_id = impl_->next_request++;
  std::vector<WireRange> wire(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    wire[i] = {ranges[i].segment, 0, ranges[i].offset, ranges[i].size};
    c.bytes += ranges[i].size;
    if (ranges[i].size != 0) c.iov.push_back({ranges[i].dest, ranges[i].size});
  }
  if (c.bytes > impl_->limits.max_pull_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a KV pull of ", c.bytes, " bytes (the limit is ", impl_->limits.max_pull_bytes, ")"));
  }
  absl::StatusOr<ucp_ep_h> ep = impl_->Endpoint(exporter_address);
  if (!ep.ok()) return ep.status();
  PullHeader h{kMagic, static_cast<uint32_t>(ranges.size()), c.request_id, ticket};
  c.ep = *ep;
  impl_->current = &c;
  bool sent = false;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
  ucs_status_ptr_t r =
      ucp_am_send_nbx(*ep, am_id, &h, sizeof(h), wire.data(), wire.size() * sizeof(WireRange), &p);
  if (UCS_PTR_IS_ERR(r)) {
    impl_->current = nullptr;
    impl_->Drop(*ep);
    return absl::UnavailableError(
        UcsError(absl::StrCat("sending the KV ", what).c_str(), UCS_PTR_STATUS(r)));
  }
  const absl::Time started = absl::Now(), deadline = started + timeout;
  while (!c.done) {
    if (r != nullptr && !sent && ucp_request_check_status(r) != UCS_INPROGRESS) {
      ucp_request_free(r);
      r = nullptr;
      sent = true;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    // The answer's arrival does not always wake the worker's event fd (a reply on the endpoint
    // the exporter opens back to us): a pull spins on progress, yielding, for its first
    // milliseconds (where a pull of a prompt's KV ends), then polls every millisecond.
    if (impl_->ucx.Progress() == 0) {
      if (now - started < absl::Milliseconds(20)) {
        std::this_thread::yield();
      } else {
        impl_->ucx.ProgressOrWait(1);
      }
    }
  }
  impl_->current = nullptr;
  if (r != nullptr && !sent) {
    ucp_request_cancel(impl_->ucx.worker, r);
    ucp_request_free(r);
  }
  const bool finished = c.done;
  // A receive still in flight (the deadline passed, or the peer failed, while the bytes came by
  // rendezvous) would write into the caller's memory after it is reused: cancelled, and waited
  // for. Should it not end, its Current is left to it and the endpoint closed.
  if (c.recv != nullptr) {
    ucp_request_cancel(impl_->ucx.worker, c.recv);
    const absl::Time end = absl::Now() + absl::Seconds(2);
    while (c.recv != nullptr && absl::Now() < end) impl_->ucx.Progress();
    if (c.recv != nullptr) {
      LogError("a KV receive did not end when cancelled; its endpoint is closed");
      owned.release();
      impl_->Drop(*ep);
      // Past its deadline (a stalled exporter never answers the cancel), the pull still ends as
      // what it is: deadline exceeded.
      if (!finished) return Late(what, c.bytes, timeout);
      return absl::UnavailableError(absl::StrCat("the KV ", what, " was cut short"));
    }
  }
  if (!finished) {
    impl_->Drop(*ep);
    return Late(what, c.bytes, timeout);
  }
  if (!c.status.ok() && absl::IsUnavailable(c.status)) impl_->Drop(*ep);
  return c.status;
}

}  // namespace shardserve

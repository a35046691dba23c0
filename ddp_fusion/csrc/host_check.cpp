// The host side of the per-step plan check in C++ (ddp_fusion/_native.py loads it).
//
// Two parts:
//
// * Channel: host_group.PairChannel's framing on one socket (a group of two ranks' own
//   TCP connection, or the socket pair to this rank's exchange relay): a frame is a
//   uint32 count of int64 values, then the values, little-endian; 0xFFFFFFFF instead of
//   a count starts a relay's error frame (a uint32 length, then the text). It numbers
//   the exchanges posted and the frames read, keeps frames read before their turn, and
//   counts the host group's tickets. It is the only reader and writer of its socket:
//   the Python exchanges (host_group.NativePairChannel) and the kernels below share it,
//   so an exchange is numbered alike on either path. Every wait is a poll, bounded by
//   the caller's timeout, with the GIL released (only then: a send or recv that does
//   not block keeps it, so a steady step's host thread never queues for it again).
//
// * Kernels of ddp_fusion::plan_check_start and ddp_fusion::plan_guard for a steady
//   step: a (group, plan hash) that the Python ops have run and checked once, and then
//   marked steady. The start posts (h, -h) and returns the divisor; the guard takes the
//   peer's frame and, when both maxima give back h, returns the divisor. Everything
//   else goes to the Python ops (plan_check.py): a plan not marked steady, a guard
//   without this path's start, and every failure (a mismatch, a timeout, a closed
//   connection, a relay's error frame), which the Python side turns into its errors.
//   No Python runs on a steady step's check.

#include <torch/extension.h>
#include <torch/library.h>

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint32_t kError = 0xFFFFFFFFu;

// What a channel operation ends with (host_group.NativePairChannel names each).
enum Status : int {
  kOk = 0,
  kTimedOut = 1,    // the peer sent (or read) nothing in time
  kPeerClosed = 2,  // the peer closed the connection
  kOsError = 3,     // a socket call failed (errno given)
  kErrorFrame = 4,  // a relay's error frame, whole (its bytes: Channel::error_bytes)
  kClosedHere = 5,  // this end was closed: the host group ended
  kWouldBlock = 6,  // (internal) nothing to read now
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The GIL released for a wait, where this thread holds it.
struct NoGil {
  PyThreadState* state = nullptr;
  NoGil() {
    if (Py_IsInitialized() && PyGILState_Check()) state = PyEval_SaveThread();
  }
  ~NoGil() {
    if (state) PyEval_RestoreThread(state);
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
};

// ``mu`` locked; where another thread holds it, waited for without the GIL (that thread
// may need the GIL to finish). No Channel code takes the GIL while it holds a lock of its
// own except on leaving a wait, and nothing waits for a lock with the GIL held, so the
// two never deadlock.
std::unique_lock<std::mutex> lock_without_gil(std::mutex& mu) {
  std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    NoGil no_gil;
    lock.lock();
  }
  return lock;
}

class Channel {
 public:
  Channel(int fd, double timeout_s) : fd_(fd), timeout_s_(timeout_s) {}

  double timeout_s() const { return timeout_s_; }
  int fileno() const { return closed_ ? -1 : fd_; }
  int64_t waited_ns() const { return waited_ns_.load(); }
  bool closed() const { return closed_.load(); }
  int64_t ticket() { return ++tickets_; }
  int64_t tickets() const { return tickets_.load(); }

  // Send one frame of ``values``; ``seq`` is its number (taken even if sending fails).
  int post(const int64_t* values, uint32_t n, double timeout_s, int64_t& seq, int& err) {
    std::string frame(4 + 8 * size_t(n), '\0');
    std::memcpy(&frame[0], &n, 4);
    if (n) std::memcpy(&frame[4], values, 8 * size_t(n));
    auto lock = lock_without_gil(send_mu_);
    seq = posted_++;
    if (closed_) return kClosedHere;
    size_t at = 0;
    double deadline = -1;
    while (at < frame.size()) {
      ssize_t k = ::send(fd_, frame.data() + at, frame.size() - at, MSG_NOSIGNAL);
      if (k >= 0) {
        at += size_t(k);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        err = errno;
        return kOsError;
      }
      if (deadline < 0) deadline = now() + timeout_s;  // the peer has not read for a long time
      int st = wait(POLLOUT, deadline, err);
      if (st != kOk) return st;
      if (closed_) return kClosedHere;
    }
    return kOk;
  }

  // The peer's values of exchange ``seq``, waited for up to ``timeout_s``.
  int take(int64_t seq, double timeout_s, std::vector<int64_t>& out, int& err) {
    auto lock = lock_without_gil(recv_mu_);
    const double deadline = now() + timeout_s;
    while (true) {
      auto it = early_.find(seq);
      if (it != early_.end()) {
        out = std::move(it->second);
        early_.erase(it);
        return kOk;
      }
      int st = receive(err);
      if (st == kOk) continue;
      if (st != kWouldBlock) return st;
      st = wait(POLLIN, deadline, err);
      if (st != kOk) return st;
    }
  }

  // Whether exchange ``seq``'s values are here (reads what has arrived, never waits):
  // kOk and ``here``, or why reading failed.
  int arrived(int64_t seq, bool& here, int& err) {
    auto lock = lock_without_gil(recv_mu_);
    int st = receive(err);
    here = early_.count(seq) > 0;
    return (st == kOk || st == kWouldBlock || here) ? kOk : st;
  }

  // A relay's error frame, whole (after kErrorFrame), for the Python side to read.
  std::string error_bytes() {
    auto lock = lock_without_gil(recv_mu_);
    return buf_;
  }

  // End this end: the peer (or relay) sees it close, and a wait on it here wakes.
  void close() {
    if (closed_.exchange(true)) return;
    ::shutdown(fd_, SHUT_RDWR);
    auto s = lock_without_gil(send_mu_);
    auto r = lock_without_gil(recv_mu_);
    ::close(fd_);
  }

  // In a forked child (a DataLoader worker): its copy of the socket closes, nothing else
  // (no other thread of the parent is here; its locks may be held, and the parent's
  // connection must stay up).
  void close_in_child() {
    if (!closed_.exchange(true)) ::close(fd_);
  }

 private:
  // Read what has arrived, without waiting (recv_mu_ held).
  int receive(int& err) {
    if (closed_) return kClosedHere;
    if (error_frame_ && whole_error()) return kErrorFrame;
    char data[1 << 16];
    ssize_t k = ::recv(fd_, data, sizeof data, 0);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return kWouldBlock;
      err = errno;
      return kOsError;
    }
    if (k == 0) return kPeerClosed;
    buf_.append(data, size_t(k));
    if (!error_frame_) parse();
    if (error_frame_) return whole_error() ? kErrorFrame : kOk;
    return kOk;
  }

  void parse() {
    size_t at = 0;
    while (buf_.size() - at >= 4) {
      uint32_t count;
      std::memcpy(&count, buf_.data() + at, 4);
      if (count == kError) {
        error_frame_ = true;
        break;
      }
      const size_t end = at + 4 + 8 * size_t(count);
      if (buf_.size() < end) break;
      std::vector<int64_t> values(count);
      if (count) std::memcpy(values.data(), buf_.data() + at + 4, 8 * size_t(count));
      early_[read_++] = std::move(values);
      at = end;
    }
    buf_.erase(0, at);
  }

  bool whole_error() const {
    if (buf_.size() < 8) return false;
    uint32_t n;
    std::memcpy(&n, buf_.data() + 4, 4);
    return buf_.size() >= 8 + size_t(n);
  }

  int wait(short events, double deadline, int& err) {
    while (true) {
      if (closed_) return kClosedHere;
      const double left = deadline - now();
      if (left <= 0) return kTimedOut;
      pollfd pf{fd_, events, 0};
      const int64_t t0 = now_ns();
      int r;
      {
        NoGil no_gil;  // (only while it waits: a send or recv that does not block keeps it)
        r = ::poll(&pf, 1, int(std::min(left * 1000.0 + 1.0, 2.0e9)));
      }
      waited_ns_ += now_ns() - t0;
      if (r > 0) return kOk;  // (ready, or closed or failed: the next call says which)
      if (r < 0 && errno != EINTR) {
        err = errno;
        return kOsError;
      }
    }
  }

  const int fd_;
  const double timeout_s_;
  std::atomic<bool> closed_{false};
  std::atomic<int64_t> tickets_{0};
  std::atomic<int64_t> waited_ns_{0};  // in poll, all told
  std::mutex send_mu_, recv_mu_;
  int64_t posted_ = 0;  // send_mu_
  int64_t read_ = 0;    // recv_mu_, as the rest below
  std::string buf_;     // received, not yet a whole frame
  std::unordered_map<int64_t, std::vector<int64_t>> early_;
  bool error_frame_ = false;
};

// -- the plan ops' steady path -----------------------------------------------------

// A check started by the C++ start, for its guard: the exchange's channel and number,
// its ticket, and the divisor the start returned.
struct Pending {
  std::shared_ptr<Channel> channel;
  int64_t seq = 0, ticket = 0;
  double divisor = 1;
};

struct Steady {
  std::shared_ptr<Channel> channel;
  double divisor = 1;  // of an "avg" bucket
  std::unordered_set<int64_t> plans;  // hashes of the plans marked steady
  // plan -> this step's check, started in C++: the guard collects it (the Python guard
  // too, should it run instead: take_pending); a start that goes to Python drops it
  std::unordered_map<int64_t, Pending> pending;
};

// Never destroyed (no static destructor runs after Python has finalized).
std::mutex& registry_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::unordered_map<std::string, Steady>& registry() {
  static auto* r = new std::unordered_map<std::string, Steady>();
  return *r;
}
py::object* g_py_start = nullptr;  // plan_check.py's ops, and the failure paths of this one
py::object* g_py_guard = nullptr;
py::object* g_py_start_failed = nullptr;
py::object* g_py_failed = nullptr;
torch::Library* g_lib = nullptr;
std::atomic<int64_t> g_starts{0}, g_guards{0};
// nanoseconds in the steady kernels (bench.plan_check): starts, guards, guards' waits for the peer
std::atomic<int64_t> g_start_ns{0}, g_guard_ns{0}, g_guard_wait_ns{0};

at::Tensor divisor_tensor(double d, c10::string_view reduce_op, c10::Device device) {
  return at::full({}, reduce_op == "avg" ? d : 1.0, at::TensorOptions().dtype(at::kFloat).device(device));
}

at::Tensor plan_check_start(c10::string_view group_name, c10::string_view plan, int64_t h, c10::Device device,
                            c10::string_view reduce_op) {
  const int64_t t0 = now_ns();
  const std::string name(group_name);
  std::shared_ptr<Channel> channel;
  double d = 1;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(name);
    if (it != registry().end()) {
      // (a check left by a step whose backward failed before its guard: never collected)
      it->second.pending.erase(h);
      if (it->second.plans.count(h) && !it->second.channel->closed()) {
        channel = it->second.channel;
        d = it->second.divisor;
      }
    }
  }
  if (!channel) {
    py::gil_scoped_acquire gil;
    return (*g_py_start)(name, std::string(plan), h, device, std::string(reduce_op)).cast<at::Tensor>();
  }
  const int64_t values[2] = {h, -h};
  int64_t seq = 0;
  int err = 0;
  const int64_t ticket = channel->ticket();
  const int st = channel->post(values, 2, channel->timeout_s(), seq, err);
  if (st != kOk) {  // the Python side says why (it posts nothing: this exchange took its number)
    py::gil_scoped_acquire gil;
    (*g_py_start_failed)(name, st, err);
    TORCH_CHECK(false, "ddp_fusion: the plan check's exchange could not be posted (status ", st, ")");
  }
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    registry()[name].pending[h] = Pending{channel, seq, ticket, d};
  }
  at::Tensor out = divisor_tensor(d, reduce_op, device);
  ++g_starts;
  g_start_ns += now_ns() - t0;
  return out;
}

at::Tensor plan_guard(const at::Tensor& token, c10::string_view group_name, int64_t h, c10::string_view reduce_op,
                      c10::Device device) {
  const int64_t t0 = now_ns();
  const std::string name(group_name);
  Pending p;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(name);
    if (it != registry().end()) {
      auto found = it->second.pending.find(h);
      if (found != it->second.pending.end()) {
        p = std::move(found->second);
        it->second.pending.erase(found);
      }
    }
  }
  if (!p.channel) {  // not this path's start (or checked by the group's other guard): the Python op
    py::gil_scoped_acquire gil;
    return (*g_py_guard)(token, name, h, std::string(reduce_op), device).cast<at::Tensor>();
  }
  std::vector<int64_t> theirs;
  int err = 0;
  const int64_t waited = p.channel->waited_ns();
  const int st = p.channel->take(p.seq, p.channel->timeout_s(), theirs, err);
  if (st == kOk && theirs.size() == 2 && std::max(h, theirs[0]) == h && std::max(-h, theirs[1]) == -h) {
    at::Tensor out = divisor_tensor(p.divisor, reduce_op, device);
    ++g_guards;
    g_guard_wait_ns += p.channel->waited_ns() - waited;
    g_guard_ns += now_ns() - t0;
    return out;
  }
  py::gil_scoped_acquire gil;
  return (*g_py_failed)(token, name, h, std::string(reduce_op), device, p.seq, p.ticket, st, theirs, err)
      .cast<at::Tensor>();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Channel, std::shared_ptr<Channel>>(m, "Channel")
      .def(py::init<int, double>(), py::arg("fd"), py::arg("timeout_s"))
      .def("ticket", &Channel::ticket)
      .def("tickets", &Channel::tickets)
      .def("post",
           [](Channel& c, const std::vector<int64_t>& values, double timeout_s) {
             int64_t seq = 0;
             int err = 0;
             const int st = c.post(values.data(), uint32_t(values.size()), timeout_s, seq, err);
             return std::make_tuple(st, seq, err);
           })
      .def("take",
           [](Channel& c, int64_t seq, double timeout_s) {
             std::vector<int64_t> out;
             int err = 0;
             const int st = c.take(seq, timeout_s, out, err);
             return std::make_tuple(st, out, err);
           })
      .def("arrived",
           [](Channel& c, int64_t seq) {
             bool here = false;
             int err = 0;
             const int st = c.arrived(seq, here, err);
             return std::make_tuple(st, here, err);
           })
      .def("error_bytes", [](Channel& c) { return py::bytes(c.error_bytes()); })
      .def("close", &Channel::close)
      .def("close_in_child", &Channel::close_in_child)
      .def("fileno", &Channel::fileno)
      .def_property_readonly("closed", &Channel::closed);

  m.def("register_kernels", [](py::object start, py::object guard, py::object start_failed, py::object failed) {
    if (g_lib != nullptr) return;
    g_py_start = new py::object(std::move(start));  // (never freed: see registry())
    g_py_guard = new py::object(std::move(guard));
    g_py_start_failed = new py::object(std::move(start_failed));
    g_py_failed = new py::object(std::move(failed));
    // (the dispatcher warns that these override the Python kernels: that is the point)
    struct Quiet : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } quiet;
    c10::WarningUtils::WarningHandlerGuard quiet_here(&quiet);
    g_lib = new torch::Library(torch::Library::IMPL, "ddp_fusion", c10::DispatchKey::CompositeExplicitAutograd,
                               __FILE__, __LINE__);
    g_lib->impl("plan_check_start", TORCH_FN(plan_check_start));
    g_lib->impl("plan_guard", TORCH_FN(plan_guard));
  });
  m.def("unregister_kernels", []() {
    delete g_lib;  // (the Python kernels are the ops' again)
    g_lib = nullptr;
  });
  m.def("kernels_registered", []() { return g_lib != nullptr; });
  m.def("mark_steady", [](const std::string& group_name, std::shared_ptr<Channel> channel, int64_t h,
                          double divisor) {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto& s = registry()[group_name];
    if (s.channel != channel) {  // (a new host group of the name: the old one's plans go)
      s.plans.clear();
      s.channel = std::move(channel);
    }
    s.divisor = divisor;
    s.plans.insert(h);
  });
  // No plan of the group (of any group) is steady any more; a check in flight is still
  // collected by its guard (on a closed channel: an error, never a skipped check).
  m.def("forget", [](const std::string& group_name) {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(group_name);
    if (it != registry().end()) it->second.plans.clear();
  });
  m.def("forget_all", []() {
    std::lock_guard<std::mutex> lock(registry_mu());
    for (auto& kv : registry()) kv.second.plans.clear();
  });
  // The check of plan ``h`` the C++ start began and no guard has collected, taken:
  // (channel, exchange number, ticket), or None.
  m.def("take_pending", [](const std::string& group_name, int64_t h) -> py::object {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(group_name);
    if (it == registry().end()) return py::none();
    auto found = it->second.pending.find(h);
    if (found == it->second.pending.end()) return py::none();
    Pending p = std::move(found->second);
    it->second.pending.erase(found);
    return py::make_tuple(p.channel, p.seq, p.ticket);
  });
  m.def("pending", []() {
    std::lock_guard<std::mutex> lock(registry_mu());
    size_t n = 0;
    for (auto& kv : registry()) n += kv.second.pending.size();
    return n;
  });
  m.def("counts", []() { return std::make_tuple(g_starts.load(), g_guards.load()); });
  m.def("times_ns", []() { return std::make_tuple(g_start_ns.load(), g_guard_ns.load(), g_guard_wait_ns.load()); });
}

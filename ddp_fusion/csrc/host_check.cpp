// The host side of ddp_fusion's cross-rank checks in C++ (ddp_fusion/_native.py loads it).
//
// Two parts:
//
// * Exchanger: the element-wise max of a few int64 over the ranks of a host group
//   (host_group.HostGroup.max_async), run on one C++ thread of its own over the host
//   group's gloo process group (torch's engine: its sockets, its threads, its
//   GLOO_SOCKET_IFNAME), by recursive doubling on gloo's point-to-point send and recv:
//   ceil(log2 N) rounds, plus two where N is not a power of two. The thread never takes
//   the GIL, so a round never waits for this process's Python (which the main thread
//   holds while it runs backward). Exchanges run in the order they were posted, which
//   is the same on every rank; the Python exchanges (host_group.NativeExchanger) and the
//   kernels below post to the same exchanger, so an exchange is numbered alike on either
//   path. A message is [kind, origin, peer, count, values...]: kind 0, or why the
//   exchange failed at group rank ``origin`` (with ``peer``), tagged with its length;
//   a rank that fails goes on
//   with its remaining rounds carrying that, so every rank hears of it at once rather
//   than after its own timeout. A failed exchange fails every later one of the group
//   (which still run their rounds, carrying it). Every wait of round k ends at the
//   exchange's start + the timeout + k grace periods (round k numbered alike on both
//   ranks of a message). host_group.PythonRounds runs the same rounds and messages in
//   Python, where this part cannot be built: ranks with and without it work together.
//
// * Kernels of ddp_fusion::plan_check_start and ddp_fusion::plan_guard for a steady
//   step: a (group, plan hash) that the Python ops have run and checked once, and then
//   marked steady. The start posts (h, -h) and returns the divisor; the guard takes the
//   max and, when it gives back (h, -h), returns the divisor. Everything else goes to
//   the Python ops (plan_check.py): a plan not marked steady, a guard without this
//   path's start, and every failure (a mismatch, a timeout, a rank gone), which the
//   Python side turns into its errors. No Python runs on a steady step's check.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What an exchange ends with (host_group.NativeExchanger names each).
enum Status : int {
  kOk = 0,
  kTimedOut = 1,    // not done within the time the caller gave
  kFailed = 2,      // it failed (the text says where and why)
  kClosedHere = 3,  // the host group ended
};

// A message's header: why the exchange failed (0: it did not), at which group rank,
// with which peer; then the number of values that follow.
constexpr int64_t kHeader = 4;
enum Kind : int64_t { kFine = 0, kBroken = 1, kSilent = 2 };
// gloo's send/recv tag of an exchange of n values: kTagBase + n. Ranks that ask for
// exchanges of different lengths never match each other's messages (gloo ends the
// process on a message longer than the buffer posted for it): they time out instead.
constexpr int64_t kTagBase = int64_t(1) << 30;  // (host_group.TAG_BASE)
// Exchanges of at most this many values receive into buffers posted ahead (Exchanger).
constexpr int64_t kAheadMax = 16;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
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

// The rounds of a max over ``size`` ranks as seen from ``rank``: (peer, send, receive,
// combine, round), combine 1 = max, 2 = take the peer's message as the result; round:
// the same number on both ranks of a message (fold-in 0, recursive doubling 1..log2 p,
// fold-out log2 p + 1), which sets its deadline.
struct Step {
  int peer;
  bool send, recv;
  int combine;
  int round;
};

std::vector<Step> schedule(int rank, int size) {
  int p = 1, last = 1;
  while (p * 2 <= size) p *= 2, ++last;  // the largest power of two <= size; log2 p + 1
  std::vector<Step> steps;
  if (rank >= p) {  // fold into rank - p, then take its result
    steps.push_back({rank - p, true, false, 0, 0});
    steps.push_back({rank - p, false, true, 2, last});
    return steps;
  }
  if (rank + p < size) steps.push_back({rank + p, false, true, 1, 0});
  int round = 1;
  for (int mask = 1; mask < p; mask <<= 1) steps.push_back({rank ^ mask, true, true, 1, round++});
  if (rank + p < size) steps.push_back({rank + p, true, false, 0, last});
  return steps;
}

// The rounds' last number (see Step::round).
int last_round(int size) {
  int last = 1;
  for (int p = 1; p * 2 <= size; p *= 2) ++last;
  return last;
}

struct Job {
  int64_t seq;
  std::vector<int64_t> values;
  milliseconds timeout;
};

// A timeout as milliseconds, at most about 30 years (steady_clock's nanoseconds hold
// 292 years from now: a larger one, timedelta.max say, would wrap).
milliseconds to_ms(double seconds) {
  return milliseconds(int64_t(std::min(std::max(seconds, 0.0), 1.0e9) * 1000.0));
}

struct Done {
  int status = kOk;
  std::vector<int64_t> values;
  std::string text;
};

// An exchange in its rounds, on the exchanger's thread. (Run by the caller itself in a
// group of two, its one round's gloo calls took up to milliseconds on a busy host, in
// gloo's locks: bench/results/host_group_gloo_cpu_2026-11-29.md.)
struct Run {
  Job job;
  at::Tensor mine;
  std::string earlier, local;  // the group's failure before it; this rank's own, as gloo worded it
  Clock::time_point start;
  std::vector<Step> steps;
  size_t at = 0;  // the round in flight
  std::vector<at::Tensor> in;  // its receive buffer
  c10::intrusive_ptr<c10d::Work> sent, received;
  bool ok = true;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;  // a job posted, a job done, closing, exited
  std::deque<Job> jobs;
  std::unordered_map<int64_t, Done> done;
  int64_t posted = 0;
  bool closing = false, exited = false;
  std::string failed;  // the first failure: every later exchange fails with it,
  int64_t failure[3] = {kFine, -1, -1};  // and carries its header to the peers
  Clock::time_point latest{};  // when the last exchange posted must be done by
  std::unordered_map<int64_t, Clock::time_point> deadlines;  // seq -> that, per exchange
  std::vector<c10::intrusive_ptr<c10d::Work>> in_flight;  // the round's, for close() to abort
  // (after a failure: the works of failed rounds, kept with their tensors, which gloo
  // may still write into)
  std::vector<c10::intrusive_ptr<c10d::Work>> kept;
  // (peer, count) -> a receive posted ahead for the next exchange of that length (this
  // thread's only), with its buffer: the peer's message then goes out as soon as the
  // peer sends it, without first waiting to hear that this rank is ready for it
  std::map<std::pair<int, int64_t>, std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>>> ahead;
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank = 0, size = 1;
  milliseconds grace{2000};
  std::atomic<int64_t> tickets{0};
  std::atomic<int64_t> waited_ns{0};  // in take, all told
};

std::string describe(const int64_t* m, int rank, const std::string& local) {
  const int64_t kind = m[0], origin = m[1], peer = m[2];
  if (origin == rank && !local.empty()) return local;
  const char* what = kind == kSilent ? "it sent or read nothing in time (it died, is stuck before this exchange, "
                                      "or asked for an exchange of another length)"
                                    : "the connection failed (its process ended, or a wait of its timed out: "
                                      "gloo then closes all its connections)";
  return "group rank " + std::to_string(origin) + " could not exchange with group rank " + std::to_string(peer) +
         ": " + what;
}

void track(State& s, const c10::intrusive_ptr<c10d::Work>& work, bool add) {
  if (!work) return;
  auto& v = s.in_flight;
  if (add) {
    v.push_back(work);
  } else {
    v.erase(std::remove(v.begin(), v.end(), work), v.end());
  }
}

void fail(Run& r, State& s, int64_t kind, int peer, const std::string& text) {
  int64_t* m = r.mine.data_ptr<int64_t>();
  if (m[0] != kFine) return;
  m[0] = kind, m[1] = s.rank, m[2] = peer;
  r.local = "group rank " + std::to_string(s.rank) + " could not exchange with group rank " + std::to_string(peer) +
            ": " + text;
}

// Post round ``r.at``'s messages. Never with mu held: gloo's first message to a peer
// connects, which can take the group's connection timeout, and mu must stay free for
// take() and close(). (``ahead`` is this thread's only.)
void post_round(Run& r, State& s) {
  const Step& step = r.steps[r.at];
  const int64_t n = int64_t(r.job.values.size());
  std::vector<at::Tensor> out{r.mine};
  r.in.clear();
  r.sent.reset(), r.received.reset();
  r.ok = true;
  try {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.closing) throw std::runtime_error("its host group ended");
    }
    if (step.recv) {
      auto ahead = s.ahead.find({step.peer, n});
      if (ahead != s.ahead.end()) {
        r.in.push_back(ahead->second.first);
        r.received = ahead->second.second;
        s.ahead.erase(ahead);
      } else {
        r.in.push_back(at::empty({kHeader + n}, at::TensorOptions().dtype(at::kLong)));
        r.received = s.backend->recv(r.in, step.peer, int(kTagBase + n));
      }
    }
    if (step.send) r.sent = s.backend->send(out, step.peer, int(kTagBase + n));
    std::lock_guard<std::mutex> lock(s.mu);
    track(s, r.received, true);
    track(s, r.sent, true);
  } catch (const std::exception& e) {
    r.ok = false;
    fail(r, s, kBroken, step.peer, std::string(e.what()).substr(0, 2000));
  }
}

Run begin(State& s, Job job) {
  Run r;
  r.job = std::move(job);
  const int64_t n = int64_t(r.job.values.size());
  r.mine = at::empty({kHeader + n}, at::TensorOptions().dtype(at::kLong));
  int64_t* m = r.mine.data_ptr<int64_t>();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    r.earlier = s.failed;
    std::copy(s.failure, s.failure + 3, m);
  }
  m[3] = n;
  std::copy(r.job.values.begin(), r.job.values.end(), m + kHeader);
  r.start = Clock::now();
  r.steps = schedule(s.rank, s.size);
  if (!r.steps.empty()) post_round(r, s);
  return r;
}

// Wait for the round in flight, take in what came, and go on to the next, to the end.
// After a failure, every later exchange runs its rounds carrying the failure (so a peer
// that missed it hears of it, rather than waiting for this rank until its timeout) and
// fails with it.
Done finish(State& s, Run& r) {
  const int64_t n = int64_t(r.job.values.size());
  int64_t* m = r.mine.data_ptr<int64_t>();
  for (; r.at < r.steps.size(); ++r.at) {
    const Step& step = r.steps[r.at];
    if (r.at > 0) post_round(r, s);
    const auto deadline = r.start + r.job.timeout + step.round * s.grace;
    if (r.ok) {
      try {
        for (auto* work : {&r.received, &r.sent}) {
          if (!*work) continue;
          auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
          if (!(*work)->wait(std::max(left, milliseconds(1)))) throw std::runtime_error("its host group ended");
        }
      } catch (const std::exception& e) {
        r.ok = false;
        const std::string text = e.what();
        const bool silent = text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos;
        fail(r, s, silent ? kSilent : kBroken, step.peer, text.substr(0, 2000));
      }
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      track(s, r.received, false);
      track(s, r.sent, false);
      if (!r.ok) {
        for (auto* work : {&r.received, &r.sent}) {
          if (*work) {
            (*work)->abort();
            s.kept.push_back(*work);
          }
        }
      }
    }
    if (!r.ok || !step.recv) continue;
    const int64_t* g = r.in[0].data_ptr<int64_t>();
    if (step.combine == 2) {
      if (m[0] == kFine) std::copy(g, g + kHeader + n, m);
    } else {
      if (m[0] == kFine && g[0] != kFine) std::copy(g, g + 3, m);
      for (int64_t i = kHeader; i < kHeader + n; ++i) m[i] = std::max(m[i], g[i]);
    }
  }
  if (!r.earlier.empty()) return {kFailed, {}, r.earlier};
  if (m[0] != kFine) {
    std::string text = "exchange " + std::to_string(r.job.seq) + ": " + describe(m, s.rank, r.local);
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.failed.empty()) {
      s.failed = text;
      std::copy(m, m + 3, s.failure);
    }
    return {kFailed, {}, text};
  }
  if (n <= kAheadMax) {  // the next exchange of this length receives into these
    try {
      for (const Step& step : r.steps) {
        if (!step.recv || s.ahead.count({step.peer, n})) continue;
        std::vector<at::Tensor> in{at::empty({kHeader + n}, at::TensorOptions().dtype(at::kLong))};
        auto work = s.backend->recv(in, step.peer, int(kTagBase + n));  // (mu not held: see post_round)
        s.ahead[{step.peer, n}] = {in[0], work};
        std::lock_guard<std::mutex> lock(s.mu);
        track(s, work, true);
        if (s.closing) {  // close() aborted what was in flight before this was posted
          work->abort();
          break;
        }
      }
    } catch (const std::exception&) {  // (the next exchange posts its own, and says why it fails)
    }
  }
  return {kOk, std::vector<int64_t>(m + kHeader, m + kHeader + n), ""};
}

void serve(std::shared_ptr<State> s) {
  // SCHED_BATCH: woken by a post, this thread does not preempt the thread that posted
  // (the training step's, which goes on launching backward); it still gets its share.
  sched_param param{};
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->closing || !s->jobs.empty(); });
      if (s->closing) break;
      job = std::move(s->jobs.front());
      s->jobs.pop_front();
    }
    Run run = begin(*s, std::move(job));
    Done d = finish(*s, run);
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->done[run.job.seq] = std::move(d);
    }
    s->cv.notify_all();
  }
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<c10::intrusive_ptr<c10d::Work>> kept;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (auto& job : s->jobs) s->done[job.seq] = {kClosedHere, {}, ""};
    s->jobs.clear();
    backend = std::move(s->backend);
    for (auto& posted : s->ahead) s->kept.push_back(posted.second.second);  // (aborted by close)
    s->ahead.clear();
    for (auto& work : s->in_flight) s->kept.push_back(work);
    s->in_flight.clear();
    kept = std::move(s->kept);
  }
  kept.clear();  // (outside the lock: the gloo group may go with them, joining its threads)
  backend.reset();
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->exited = true;
  }
  s->cv.notify_all();
}

class Exchanger {
 public:
  Exchanger(c10::intrusive_ptr<c10d::Backend> backend, int64_t rank, int64_t size, double timeout_s,
            double grace_s)
      : s_(std::make_shared<State>()), timeout_s_(timeout_s) {
    s_->backend = std::move(backend);
    s_->rank = int(rank), s_->size = int(size);
    s_->grace = to_ms(grace_s);
    rounds_ = last_round(int(size));
    std::thread(serve, s_).detach();  // (it ends when closed; close() waits for it, bounded)
  }
  ~Exchanger() { close(0); }
  Exchanger(const Exchanger&) = delete;
  Exchanger& operator=(const Exchanger&) = delete;

  double timeout_s() const { return timeout_s_; }
  // The most an exchange of ``timeout_s`` can take on this rank once it starts: the
  // timeout, plus a grace period a round, and one more.
  double budget_s(double timeout_s) const {
    return std::min(timeout_s, 1.0e9) + double(rounds_ + 1) * std::chrono::duration<double>(s_->grace).count();
  }
  int64_t ticket() { return ++s_->tickets; }
  int64_t tickets() const { return s_->tickets.load(); }
  int64_t waited_ns() const { return s_->waited_ns.load(); }
  bool closed() {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->closing;
  }

  // Post an exchange of ``values``; ``seq`` is its number (taken even when closed). It
  // must be done by the time the exchanges before it may take, plus its own budget.
  int post(const int64_t* values, size_t n, double timeout_s, int64_t& seq) {
    TORCH_CHECK(n < size_t(kTagBase), "ddp_fusion: a host group exchange of ", n, " values (at most ", kTagBase - 1, ")");
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      seq = s_->posted++;
      if (s_->closing) return kClosedHere;
      s_->jobs.push_back(Job{seq, std::vector<int64_t>(values, values + n), to_ms(timeout_s)});
      s_->latest = std::max(s_->latest, Clock::now()) + to_ms(budget_s(timeout_s));
      s_->deadlines[seq] = s_->latest;
    }
    s_->cv.notify_all();
    return kOk;
  }

  // The max of exchange ``seq``, waited for up to ``timeout_s`` (negative: as long as it
  // can take, queued behind the exchanges before it), the GIL released while it waits.
  int take(int64_t seq, double timeout_s, std::vector<int64_t>& out, std::string& text) {
    std::unique_lock<std::mutex> lock(s_->mu);
    auto it = s_->done.find(seq);
    auto due = s_->deadlines.find(seq);
    if (it == s_->done.end()) {
      const auto deadline = timeout_s >= 0 || due == s_->deadlines.end()
                                ? Clock::now() + to_ms(std::max(timeout_s, 0.0))
                                : due->second + s_->grace;
      const int64_t t0 = now_ns();
      lock.unlock();
      {
        NoGil no_gil;  // (never with mu held: the lock is taken again below without the GIL)
        std::unique_lock<std::mutex> wait(s_->mu);
        s_->cv.wait_until(wait, deadline, [&] { return s_->done.count(seq) > 0 || s_->exited; });
      }
      lock.lock();
      s_->waited_ns += now_ns() - t0;
      it = s_->done.find(seq);
      if (it == s_->done.end()) return s_->exited ? kClosedHere : kTimedOut;
    }
    Done d = std::move(it->second);
    s_->done.erase(it);
    s_->deadlines.erase(seq);
    out = std::move(d.values);
    text = std::move(d.text);
    return d.status;
  }

  // Whether exchange ``seq`` is done: taking it would not wait.
  bool arrived(int64_t seq) {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->done.count(seq) > 0;
  }

  // End: exchanges not run fail with kClosedHere, the one in a round is aborted, and
  // the thread ends (waited for up to ``wait_s``), releasing the gloo group.
  void close(double wait_s) {
    std::unique_lock<std::mutex> lock(s_->mu);
    if (!s_->closing) {
      s_->closing = true;
      for (auto& work : s_->in_flight) work->abort();
    }
    lock.unlock();
    s_->cv.notify_all();
    if (wait_s > 0) {
      NoGil no_gil;
      std::unique_lock<std::mutex> wait(s_->mu);
      s_->cv.wait_for(wait, std::chrono::duration<double>(wait_s), [&] { return s_->exited; });
    }
  }

 private:
  std::shared_ptr<State> s_;
  const double timeout_s_;
  int64_t rounds_ = 0;
};

// -- the plan ops' steady path -----------------------------------------------------

// A check started by the C++ start, for its guard: the exchanger and the exchange's
// number, its ticket, and the divisor the start returned.
struct Pending {
  std::shared_ptr<Exchanger> exchanger;
  int64_t seq = 0, ticket = 0;
  double divisor = 1;
};

struct Steady {
  std::shared_ptr<Exchanger> exchanger;
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
  std::shared_ptr<Exchanger> exchanger;
  double d = 1;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(name);
    if (it != registry().end()) {
      // (a check left by a step whose backward failed before its guard: never collected)
      it->second.pending.erase(h);
      if (it->second.plans.count(h) && !it->second.exchanger->closed()) {
        exchanger = it->second.exchanger;
        d = it->second.divisor;
      }
    }
  }
  if (!exchanger) {
    py::gil_scoped_acquire gil;
    return (*g_py_start)(name, std::string(plan), h, device, std::string(reduce_op)).cast<at::Tensor>();
  }
  const int64_t values[2] = {h, -h};
  int64_t seq = 0;
  const int64_t ticket = exchanger->ticket();
  const int st = exchanger->post(values, 2, exchanger->timeout_s(), seq);
  if (st != kOk) {  // the Python side says why (it posts nothing: this exchange took its number)
    py::gil_scoped_acquire gil;
    (*g_py_start_failed)(name, st);
    TORCH_CHECK(false, "ddp_fusion: the plan check's exchange could not be posted (status ", st, ")");
  }
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    registry()[name].pending[h] = Pending{exchanger, seq, ticket, d};
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
  if (!p.exchanger) {  // not this path's start (or checked by the group's other guard): the Python op
    py::gil_scoped_acquire gil;
    return (*g_py_guard)(token, name, h, std::string(reduce_op), device).cast<at::Tensor>();
  }
  std::vector<int64_t> top;
  std::string text;
  const int64_t waited = p.exchanger->waited_ns();
  const int st = p.exchanger->take(p.seq, -1, top, text);
  if (st == kOk && top.size() == 2 && top[0] == h && top[1] == -h) {
    at::Tensor out = divisor_tensor(p.divisor, reduce_op, device);
    ++g_guards;
    g_guard_wait_ns += p.exchanger->waited_ns() - waited;
    g_guard_ns += now_ns() - t0;
    return out;
  }
  py::gil_scoped_acquire gil;
  return (*g_py_failed)(token, name, h, std::string(reduce_op), device, p.seq, p.ticket, st, top, text)
      .cast<at::Tensor>();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Exchanger, std::shared_ptr<Exchanger>>(m, "Exchanger")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, int64_t, int64_t, double, double>(), py::arg("backend"),
           py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("grace_s"))
      .def("ticket", &Exchanger::ticket)
      .def("tickets", &Exchanger::tickets)
      .def("budget_s", &Exchanger::budget_s, py::arg("timeout_s"))
      .def("post",
           [](Exchanger& x, const std::vector<int64_t>& values, double timeout_s) {
             int64_t seq = 0;
             const int st = x.post(values.data(), values.size(), timeout_s, seq);
             return std::make_tuple(st, seq);
           })
      .def("take",
           [](Exchanger& x, int64_t seq, double timeout_s) {
             std::vector<int64_t> out;
             std::string text;
             const int st = x.take(seq, timeout_s, out, text);
             return std::make_tuple(st, out, text);
           })
      .def("arrived", &Exchanger::arrived)
      .def("close", &Exchanger::close, py::arg("wait_s") = 0.0)
      .def_property_readonly("closed", &Exchanger::closed);

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
  m.def("mark_steady", [](const std::string& group_name, std::shared_ptr<Exchanger> exchanger, int64_t h,
                          double divisor) {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto& s = registry()[group_name];
    if (s.exchanger != exchanger) {  // (a new host group of the name: the old one's plans go)
      s.plans.clear();
      s.exchanger = std::move(exchanger);
    }
    s.divisor = divisor;
    s.plans.insert(h);
  });
  // No plan of the group (of any group) is steady any more; a check in flight is still
  // collected by its guard (on a closed exchanger: an error, never a skipped check).
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
  // (exchanger, exchange number, ticket), or None.
  m.def("take_pending", [](const std::string& group_name, int64_t h) -> py::object {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(group_name);
    if (it == registry().end()) return py::none();
    auto found = it->second.pending.find(h);
    if (found == it->second.pending.end()) return py::none();
    Pending p = std::move(found->second);
    it->second.pending.erase(found);
    return py::make_tuple(p.exchanger, p.seq, p.ticket);
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

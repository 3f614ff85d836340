// Runs MLX's CPU tasks on the calling thread during a synchronous
// evaluation (docs/latency.md, "MLX's stream thread").
//
// An `mx::eval` on the CPU hands each task (ten kernels at most) to the
// stream's thread, `scheduler::StreamThread` (a queue and a condition
// variable), and waits on an event the thread signals last: two thread
// wake-ups per evaluation, and one more hand-off per task. libmlx calls the
// scheduler's `enqueue` and `signal_event` through its PLT, so the worker
// defines them here (exported from the executable by port/build.rs, so that
// libmlx binds to these) and forwards to libmlx's own (`dlsym(RTLD_NEXT)`),
// except for a task that may run inline: one enqueued on a CPU stream while
// this thread is inside `moat_eval` (`SyncEval`), not from inside an inline
// task, with nothing forwarded to that stream's thread still queued or
// running, and the stream's error known clear (see below). Such a task runs at once, as
// it would have run next on the stream's idle thread, so the order of tasks
// on the stream is kept.
//
// Errors keep MLX's path. A forwarded task is wrapped: it counts as
// outstanding until it has returned (a signal: until it starts), or, where
// it threw, until MLX's wrapper around it (which stores what it throws in
// the stream's error) has let go of it. An inline task that throws does not
// let the exception out of `enqueue` (the caller, a CPU command encoder,
// would skip the task that ends its count in `n_active_tasks`): a task that
// rethrows it is forwarded instead, so MLX stores it in the stream's error
// as if the stream's thread had run the kernel, and everything after it in
// this evaluation (the final `signal_event`, which poisons the evaluation's
// event from that error) is forwarded behind it. The stream's error is known
// clear only after a synchronous evaluation that signalled on that stream
// succeeded with nothing forwarded to it since: MLX poisons an evaluation's
// event from the stream's error, so a success means there was none. Until
// then every task of the stream is forwarded, which is MLX's own behaviour
// exactly. (Reading the error with `check_error` would consume it, and
// putting it back made MLX's main-thread `enqueue` throw after its encoder
// had counted a task group: `n_active_tasks` leaked until `wait_for_one`
// blocked for good.)
//
// MOAT_INLINE_EVAL=0 turns all of this off (every task forwarded, as MLX
// does) for A/B measurements.
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "mlx/event.h"
#include "mlx/scheduler.h"
#include "shim_core.hpp"

namespace mx = mlx::core;
namespace sch = mlx::core::scheduler;

namespace {

constexpr const char kEnqueue[] = "_ZN3mlx4core9scheduler9Scheduler7enqueueENS0_6StreamESt8functionIFvvEE";
constexpr const char kSignal[] =
    "_ZN3mlx4core9scheduler9Scheduler12signal_eventENS0_6StreamENS0_5EventESt8functionIFvRS4_EE";
constexpr const char kWait[] =
    "_ZN3mlx4core9scheduler9Scheduler10wait_eventENS0_6StreamENS0_5EventESt8functionIFvRS4_EE";

// libmlx's members, called as functions of `this` and the same parameters
// (the Itanium ABI passes `this` first; the std::function and Event by
// invisible reference either way).
using EnqueueFn = void (*)(sch::Scheduler*, mx::Stream, std::function<void()>);
using EventFn = void (*)(sch::Scheduler*, mx::Stream, mx::Event, std::function<void(mx::Event&)>);

template <typename F>
F original(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (p == nullptr) {
    // Without libmlx's own there is no scheduler at all.
    std::fprintf(stderr, "moat: %s not found in libmlx (%s)\n", name, dlerror());
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

EnqueueFn orig_enqueue() {
  static EnqueueFn f = original<EnqueueFn>(kEnqueue);
  return f;
}

EventFn orig_signal() {
  static EventFn f = original<EventFn>(kSignal);
  return f;
}

EventFn orig_wait() {
  static EventFn f = original<EventFn>(kWait);
  return f;
}

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOAT_INLINE_EVAL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

// Per CPU stream index (MLX numbers streams from 0; the worker has a handful).
constexpr int kStreams = 64;

struct StreamState {
  // Forwarded tasks not yet let go of by the stream's thread.
  std::atomic<long> outstanding{0};
  // The stream's error is known clear: nothing forwarded since it was
  // found clear, and every inline task since succeeded.
  std::atomic<bool> clean{false};
};

StreamState states[kStreams];

StreamState* state_of(const mx::Stream& s) {
  if (s.device != mx::Device::cpu || s.index < 0 || s.index >= kStreams) return nullptr;
  return &states[s.index];
}

thread_local int sync_depth = 0;
// The CPU streams the current synchronous evaluation signalled on.
thread_local uint64_t signalled = 0;
thread_local bool running_inline = false;
// Tasks (and signals) this thread ran inline, and handed to a CPU stream's
// thread: `moat_inline_eval_stats`.
thread_local uint64_t ran_inline = 0;
thread_local uint64_t handed_over = 0;

// Counts one outstanding task until it has run without throwing (`done`) or,
// where it threw, until every copy of it is gone: MLX's wrapper stores the
// error before it lets go of the task. Released as soon as the task returns,
// not when the stream's thread gets round to destroying it: the evaluation
// the task ends may already be back on the calling thread by then, and would
// find the stream busy and forward its tasks too (and the next one, and so
// on).
struct Outstanding {
  struct Token {
    StreamState* st;
    std::atomic<bool> held{true};
    explicit Token(StreamState* s) : st(s) { st->outstanding.fetch_add(1, std::memory_order_acq_rel); }
    Token(const Token&) = delete;
    Token& operator=(const Token&) = delete;
    void done() {
      if (held.exchange(false, std::memory_order_acq_rel)) st->outstanding.fetch_sub(1, std::memory_order_acq_rel);
    }
    ~Token() { done(); }
  };
  std::shared_ptr<Token> token;
  explicit Outstanding(StreamState* s) : token(std::make_shared<Token>(s)) {}
  void done() const { token->done(); }
};

void forward(sch::Scheduler* self, const mx::Stream& s, std::function<void()> task) {
  StreamState* st = state_of(s);
  if (st == nullptr) {
    orig_enqueue()(self, s, std::move(task));
    return;
  }
  st->clean.store(false, std::memory_order_release);
  ++handed_over;
  orig_enqueue()(self, s, [held = Outstanding(st), task = std::move(task)]() mutable {
    task();
    held.done();
  });
}

// Hands `error` to the stream's thread, where MLX's wrapper stores it in the
// stream's error (the earliest one is kept).
void forward_error(sch::Scheduler* self, const mx::Stream& s, std::exception_ptr error) {
  forward(self, s, [error] { std::rethrow_exception(error); });
}

// Whether a task of `s` may run on this thread now (see the top).
bool may_run_inline(const mx::Stream& s, StreamState*& st) {
  if (sync_depth == 0 || running_inline || !enabled()) return false;
  st = state_of(s);
  if (st == nullptr || st->outstanding.load(std::memory_order_acquire) != 0) return false;
  return st->clean.load(std::memory_order_acquire);
}

}  // namespace

namespace mlx::core::scheduler {

void Scheduler::enqueue(Stream s, std::function<void()> task) {
  StreamState* st = nullptr;
  if (!may_run_inline(s, st)) {
    forward(this, s, std::move(task));
    return;
  }
  running_inline = true;
  ++ran_inline;
  try {
    task();
  } catch (...) {
    running_inline = false;
    forward_error(this, s, std::current_exception());
    return;
  }
  running_inline = false;
}

void Scheduler::signal_event(Stream s, Event event, std::function<void(Event&)> task) {
  StreamState* st = state_of(s);
  if (st == nullptr) {
    orig_signal()(this, s, std::move(event), std::move(task));
    return;
  }
  if (sync_depth > 0) signalled |= uint64_t{1} << s.index;
  if (may_run_inline(s, st)) {
    // MLX's wrapper would first poison the event from the stream's error,
    // which is clear.
    ++ran_inline;
    task(event);
    return;
  }
  ++handed_over;
  // Released before the signal: the waiting thread resumes at once, and a
  // signal does not throw.
  orig_signal()(this, s, std::move(event), [held = Outstanding(st), task = std::move(task)](Event& e) mutable {
    held.done();
    task(e);
  });
}

void Scheduler::wait_event(Stream s, Event event, std::function<void(Event&)> task) {
  // Always on the stream's thread: MLX's wrapper poisons the stream from the
  // waited event's error, which only libmlx can read.
  StreamState* st = state_of(s);
  if (st == nullptr) {
    orig_wait()(this, s, std::move(event), std::move(task));
    return;
  }
  st->clean.store(false, std::memory_order_release);
  ++handed_over;
  orig_wait()(this, s, std::move(event), [held = Outstanding(st), task = std::move(task)](Event& e) mutable {
    task(e);
    held.done();
  });
}

}  // namespace mlx::core::scheduler

namespace moat {

SyncEval::SyncEval() {
  if (sync_depth++ == 0) signalled = 0;
}
SyncEval::~SyncEval() { --sync_depth; }

void SyncEval::succeeded() {
  // Only the outermost evaluation's success says the streams are clear.
  if (sync_depth != 1) return;
  for (int i = 0; i < kStreams; ++i) {
    if (signalled & (uint64_t{1} << i)) states[i].clean.store(true, std::memory_order_release);
  }
}

}  // namespace moat

extern "C" int moat_inline_eval(void) { return enabled() ? 1 : 0; }

extern "C" void moat_inline_eval_stats(uint64_t* inlined, uint64_t* forwarded, int64_t* active) {
  *inlined = ran_inline;
  *forwarded = handed_over;
  *active = sch::n_active_tasks();
}

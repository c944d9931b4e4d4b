// The host bridge as XLA FFI handlers: from inside a jitted step to a compiled host function
// (host/entry.py's Numba cfunc, whose address sits in each layer's record) without Python.
//
// A layer's record is an int64 array owned by bloomery_jax.host.ffi (its words are the Field
// enum, generated from ffi_layout.py). The step names a record by a small slot number (an
// attribute of the custom call), never by address: a compiled step may come back from JAX's
// persistent cache in another process, where bloomery_ffi_set_record has filled the table anew.
//
// CPU: the handler calls the host function on XLA's buffers directly.
// A call's inputs come packed in one byte buffer (``Packed``: x, experts, weights, on_host), so
// that the CUDA path copies them to the host in one transfer, not four.
//
// CUDA: the handler enqueues, on the step's stream, the copy of the packed inputs into the
// record's pinned staging buffer, the host function, and the copy of its output back. It never
// synchronises, so XLA may record it into the step's CUDA graph (the handler is declared
// command-buffer compatible). The CUDA driver is opened with dlopen, so building this file needs
// no CUDA toolkit. The host function runs one of two ways (the record's kSignal):
// - hostfunc: cuLaunchHostFunc; the driver's callback thread runs it when the stream gets there.
// - doorbell: the stream writes the call's id into a pinned word (cuStreamWriteValue32), a worker
//   thread of ours that polls that word runs the call and writes the id into a second word, for
//   which the stream waits (cuStreamWaitValue32) before it clears it and copies the output back.
//   No driver thread has to be woken on either side; the worker spins while calls keep coming.
// A call may also come in two halves (the start and finish targets): the start queues the copy
// in and the signal, the finish the wait for the answer and the copy out, so that what the step
// queues between them (the layer's card experts) runs on the card while the host computes. Only
// the doorbell lets the stream go on past the start; with hostfunc the stream waits for the host
// function there, and the halves cost what the whole call does.

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "bloomery_ffi_layout.h"  // enum Field (the record's words) and kCounterWords, generated from ffi_layout.py
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using HostFn = void (*)(int64_t* record, int64_t x, int64_t experts, int64_t weights, int64_t on_host,
                        int64_t out, int64_t n);

constexpr int64_t kSlots = 1 << 16;
std::atomic<int64_t*> g_records[kSlots];

int64_t* Record(int64_t slot) {
  return (slot >= 0 && slot < kSlots) ? g_records[slot].load(std::memory_order_acquire) : nullptr;
}

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t Ticks() {  // the time-stamp counter, as host/ticks.py reads it in Numba code
#if defined(__x86_64__) || defined(__i386__)
  return static_cast<int64_t>(__builtin_ia32_rdtsc());
#else
  return 0;
#endif
}

// --- The host team --------------------------------------------------------------------------------
// Threads that stay awake between a decode step's layer calls, so that a call costs no fork and
// no join of a Numba parallel region (~6 us each and ~13 us of waking even with spinning OpenMP
// workers, twenty-first session). The caller is thread 0; the others spin on the call counter
// for the record's TEAM_SPIN_US after their last part, then sleep until the next call. Each runs
// its part of the call (entry.team_entry), taking work items from the record's counters, and the
// caller waits until every part is done. One call at a time: a call that finds the team busy
// (another thread's call) runs the Numba kernel instead.
using TeamFn = void (*)(int64_t* record, int64_t x, int64_t experts, int64_t weights, int64_t on_host, int64_t out,
                        int64_t n, int64_t tid, int64_t nthreads);

struct TeamCall {
  int64_t* rec;
  int64_t x, experts, weights, on_host, out, n, nthreads;
};

class Team {
 public:
  // Runs `call` on `call.nthreads` threads (this one included); false when the team is busy.
  bool Run(const TeamCall& call) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    Grow(static_cast<int>(call.nthreads) - 1);
    int64_t* rec = call.rec;
    std::memset(reinterpret_cast<void*>(rec[kTeamCounters]), 0, kCounterWords * sizeof(int64_t));
    call_ = call;
    spin_us_.store(rec[kTeamSpinUs], std::memory_order_relaxed);
    int helpers = static_cast<int>(helpers_.size());
    pending_.store(helpers, std::memory_order_relaxed);
    int64_t t0 = Ticks();
    gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes call_ (release) to the spinning helpers
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    Part(0);
    int64_t mine = Ticks();
    // Part set this thread's Numba thread count to 1; other parallel Numba code it runs (XLA's CPU
    // thread, the doorbell worker) must find the record's count again
    reinterpret_cast<void (*)(int)>(rec[kSetThreads])(static_cast<int>(call.nthreads));
    while (pending_.load(std::memory_order_acquire) != 0) Pause();
    int64_t t1 = Ticks(), began = 0, ended = mine;
    for (int i = 0; i < helpers; ++i) {
      if (stamps_[i].first > began) began = stamps_[i].first;
      if (stamps_[i].last > ended) ended = stamps_[i].last;
    }
    // the spans as the Numba kernel counts them (swiglu.SPANS): the call is one region
    __atomic_fetch_add(&rec[kTicks], t1 - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&rec[kTicksRegions], t1 - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&rec[kTicksWake], (began > t0 ? began : t0) - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&rec[kTicksJoin], t1 - ended, __ATOMIC_RELAXED);
    __atomic_fetch_add(&rec[kTeamCalls], 1, __ATOMIC_RELAXED);
    return true;
  }

 private:
  struct alignas(64) Stamps {
    int64_t first = 0, last = 0;
  };

  // Thread `tid`'s part; helpers beyond the call's thread count have none. Each part is one Numba
  // parallel region of one iteration (swiglu._share_alone, for its code), which runs on the thread
  // that starts it only while that thread's Numba thread count is 1. (Run sets the caller's back.)
  void Part(int64_t tid) {
    const TeamCall& c = call_;
    if (tid < c.nthreads) {
      reinterpret_cast<void (*)(int)>(c.rec[kSetThreads])(1);
      reinterpret_cast<TeamFn>(c.rec[kTeamFn])(c.rec, c.x, c.experts, c.weights, c.on_host, c.out, c.n, tid,
                                               c.nthreads);
    }
  }

  void Grow(int helpers) {
    while (static_cast<int>(helpers_.size()) < helpers) {
      int tid = static_cast<int>(helpers_.size()) + 1;
      uint64_t seen = gen_.load(std::memory_order_relaxed);  // before this call's: it must not miss it
      stamps_.emplace_back();
      helpers_.emplace_back([this, tid, seen] { Helper(tid, seen); });
      helpers_.back().detach();  // the team lives as long as the process
    }
  }

  void Helper(int tid, uint64_t seen) {
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      int spins = 0;
      while (gen_.load(std::memory_order_acquire) == seen) {
        Pause();
        if (++spins % 1024 == 0 &&
            std::chrono::steady_clock::now() - since > std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed))) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
        }
      }
      seen = gen_.load(std::memory_order_acquire);
      stamps_[tid - 1].first = Ticks();
      Part(tid);
      stamps_[tid - 1].last = Ticks();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex run_mu_, sleep_mu_;
  std::condition_variable wake_;
  std::deque<std::thread> helpers_;
  std::deque<Stamps> stamps_;  // a deque: growing it never moves the stamps a helper writes
  TeamCall call_{};
  alignas(64) std::atomic<uint64_t> gen_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int64_t> spin_us_{0};
};

Team& HostTeam() {
  static Team* team = new Team();  // never destroyed: its detached helpers may still be spinning at exit
  return *team;
}

// Runs the host function and counts the call: calls, (token, expert) pairs on the host, time.
// A call of at most the record's TEAM_TOKENS tokens runs on the host team where the record asks.
void RunHost(int64_t* rec, const void* x, const int32_t* experts, const void* weights, const bool* on_host,
             void* out, int64_t n) {
  auto t0 = std::chrono::steady_clock::now();
  bool teamed = rec[kTeam] != 0 && n <= rec[kTeamTokens] && rec[kTeamScratch] != 0 &&
                HostTeam().Run(TeamCall{rec, reinterpret_cast<int64_t>(x), reinterpret_cast<int64_t>(experts),
                                        reinterpret_cast<int64_t>(weights), reinterpret_cast<int64_t>(on_host),
                                        reinterpret_cast<int64_t>(out), n, rec[kThreads]});
  if (!teamed) {
    reinterpret_cast<void (*)(int)>(rec[kSetThreads])(static_cast<int>(rec[kThreads]));
    reinterpret_cast<unsigned (*)(unsigned)>(rec[kSetChunksize])(static_cast<unsigned>(rec[kChunksize]));
    reinterpret_cast<HostFn>(rec[kFn])(rec, reinterpret_cast<int64_t>(x), reinterpret_cast<int64_t>(experts),
                                       reinterpret_cast<int64_t>(weights), reinterpret_cast<int64_t>(on_host),
                                       reinterpret_cast<int64_t>(out), n);
  }
  int64_t pairs = 0;
  for (int64_t i = 0; i < n * rec[kK]; ++i) pairs += on_host[experts[i]] ? 1 : 0;
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  __atomic_fetch_add(&rec[kCalls], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&rec[kPairs], pairs, __ATOMIC_RELAXED);
  __atomic_fetch_add(&rec[kNanos], static_cast<int64_t>(ns), __ATOMIC_RELAXED);
}

// Byte offsets of the packed inputs of n tokens: x f32 [n, D], experts s32 [n, k], weights f32
// [n, k], on_host bool [E], one after the other (host/ffi.py's FfiHostBridge.moe packs them).
struct Packed {
  size_t x, experts, weights, on_host, total;
};

Packed Offsets(const int64_t* rec, int64_t n) {
  size_t act = 4 * n * rec[kD], pairs = 4 * n * rec[kK];
  return {0, act, act + pairs, act + 2 * pairs, act + 2 * pairs + static_cast<size_t>(rec[kE])};
}

// The slot's record and the token count, after checking the call against the record: packed
// u8 [Offsets(n).total], out f32 [n, D].
ffi::ErrorOr<std::pair<int64_t*, int64_t>> Checked(int64_t slot, const ffi::AnyBuffer& packed,
                                                   const ffi::Result<ffi::AnyBuffer>& out) {
  int64_t* rec = Record(slot);
  if (rec == nullptr)
    return ffi::Error::InvalidArgument("bloomery host bridge: slot " + std::to_string(slot) +
                                       " has no layer record (its bridge was freed?)");
  if (packed.element_type() != ffi::U8 || out->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("bloomery host bridge: wants u8 packed inputs and an f32 output");
  auto pd = packed.dimensions(), od = out->dimensions();
  if (pd.size() != 1 || od.size() != 2 || od[1] != rec[kD] ||
      static_cast<size_t>(pd[0]) != Offsets(rec, od[0]).total)
    return ffi::Error::InvalidArgument("bloomery host bridge: shapes do not match the layer record");
  return std::make_pair(rec, static_cast<int64_t>(od[0]));
}

// A layer's expert tensor `role` (0 gate, 1 up, 2 down): its address and byte size, or an error
// when the output buffer is not exactly that size.
ffi::ErrorOr<std::pair<const void*, size_t>> Tensor(int64_t slot, int64_t role,
                                                    const ffi::Result<ffi::AnyBuffer>& out) {
  int64_t* rec = Record(slot);
  if (rec == nullptr || role < 0 || role > 2)
    return ffi::Error::InvalidArgument("bloomery host bridge: no layer record at slot " + std::to_string(slot) +
                                       " or a role not in 0..2");
  const int64_t address[] = {rec[kGate], rec[kUp], rec[kDown]};
  const int64_t rows[] = {rec[kF], rec[kF], rec[kD]};
  const int64_t row_bytes[] = {rec[kGateRowBytes], rec[kUpRowBytes], rec[kDownRowBytes]};
  size_t bytes = static_cast<size_t>(rec[kE] * rows[role] * row_bytes[role]);
  if (out->size_bytes() != bytes)
    return ffi::Error::InvalidArgument("bloomery host bridge: stream output of " + std::to_string(out->size_bytes()) +
                                       " bytes for a tensor of " + std::to_string(bytes));
  return std::make_pair(reinterpret_cast<const void*>(address[role]), bytes);
}

ffi::Error StreamCpu(int64_t slot, int64_t role, ffi::Result<ffi::AnyBuffer> out) {
  auto t = Tensor(slot, role, out);
  if (t.has_error()) return t.error();
  std::memcpy(out->untyped_data(), t->first, t->second);
  __atomic_fetch_add(&Record(slot)[kStreamed], static_cast<int64_t>(t->second), __ATOMIC_RELAXED);
  return ffi::Error::Success();
}

ffi::Error HostMoeCpu(int64_t slot, ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> out) {
  auto checked = Checked(slot, packed, out);
  if (checked.has_error()) return checked.error();
  auto [rec, n] = *checked;
  const auto* base = static_cast<const uint8_t*>(packed.untyped_data());
  Packed off = Offsets(rec, n);
  RunHost(rec, base + off.x, reinterpret_cast<const int32_t*>(base + off.experts), base + off.weights,
          reinterpret_cast<const bool*>(base + off.on_host), out->untyped_data(), n);
  return ffi::Error::Success();
}

// --- CUDA, through the driver API -------------------------------------------------------------
struct CUstream_st;
using CUstream = CUstream_st*;
using CUresult = int;

struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(void**, int) = nullptr;
  CUresult (*ctx_push)(void*) = nullptr;
  CUresult (*ctx_pop)(void**) = nullptr;
  CUresult (*host_alloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*memcpy_async)(uint64_t, uint64_t, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod)(uint64_t, const void*, size_t) = nullptr;
  CUresult (*launch_host_func)(CUstream, void (*)(void*), void*) = nullptr;
  CUresult (*host_device_pointer)(uint64_t*, void*, unsigned) = nullptr;
  CUresult (*write_value32)(CUstream, uint64_t, uint32_t, unsigned) = nullptr;
  CUresult (*wait_value32)(CUstream, uint64_t, uint32_t, unsigned) = nullptr;
  std::string error;
};

const Driver& Cuda() {
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("cannot open libcuda.so.1: ") + dlerror();
      return d;
    }
    auto sym = [&](auto& fn, const char* name, bool required = true) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && required && d.error.empty()) d.error = std::string("libcuda.so.1 has no ") + name;
    };
    sym(d.init, "cuInit");
    sym(d.device_get, "cuDeviceGet");
    sym(d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    sym(d.ctx_push, "cuCtxPushCurrent_v2");
    sym(d.ctx_pop, "cuCtxPopCurrent_v2");
    sym(d.host_alloc, "cuMemHostAlloc");
    sym(d.host_register, "cuMemHostRegister_v2", false);  // huge-page host experts only
    sym(d.memcpy_async, "cuMemcpyAsync");
    sym(d.memcpy_htod, "cuMemcpyHtoD_v2");
    sym(d.launch_host_func, "cuLaunchHostFunc");
    // the doorbell's (CUDA 11.7+); the hostfunc signal works without them
    sym(d.host_device_pointer, "cuMemHostGetDevicePointer_v2", false);
    sym(d.write_value32, "cuStreamWriteValue32_v2", false);
    sym(d.wait_value32, "cuStreamWaitValue32_v2", false);
    return d;
  }();
  return driver;
}

// What one enqueued host function needs. The pointer is the host node's argument, so it has to
// outlive every CUDA graph that recorded it: made once per (record, staging, n) and kept.
struct HostCall {
  uint32_t id;  // 1 + its index in g_calls: what the doorbell carries
  int64_t* rec;
  const void* x;
  const int32_t* experts;
  const void* weights;
  const bool* on_host;
  void* out;
  int64_t n;
};

constexpr uint32_t kMaxCalls = 1 << 16;
std::atomic<HostCall*> g_calls[kMaxCalls];  // by id - 1, for the doorbell worker

HostCall* Intern(int64_t* rec, int64_t n) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t*, int64_t, int64_t>, HostCall*> calls;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(rec, rec[kStageIn], n);
  auto it = calls.find(key);
  if (it != calls.end()) return it->second;
  const auto* in = reinterpret_cast<const uint8_t*>(rec[kStageIn]);
  Packed off = Offsets(rec, n);
  if (calls.size() + 1 >= kMaxCalls) return nullptr;
  auto* c = new HostCall{static_cast<uint32_t>(calls.size() + 1),
                         rec,
                         in + off.x,
                         reinterpret_cast<const int32_t*>(in + off.experts),
                         in + off.weights,
                         reinterpret_cast<const bool*>(in + off.on_host),
                         reinterpret_cast<void*>(rec[kStageOut]),
                         n};
  calls.emplace(key, c);
  g_calls[c->id - 1].store(c, std::memory_order_release);
  return c;
}

void HostCallback(void* arg) {
  auto* c = static_cast<HostCall*>(arg);
  RunHost(c->rec, c->x, c->experts, c->weights, c->on_host, c->out, c->n);
}

// Runs `work` (returning a CUresult) with device `ordinal`'s primary context current; "" on
// success, else what failed (`what` names the work).
template <typename Work>
std::string InContext(const Driver& cu, int ordinal, const std::string& what, Work work) {
  if (!cu.error.empty()) return cu.error;
  int device = 0;
  void* ctx = nullptr;
  if (cu.init(0) != 0 || cu.device_get(&device, ordinal) != 0 || cu.primary_ctx_retain(&ctx, device) != 0)
    return "no CUDA context for device " + std::to_string(ordinal);
  if (cu.ctx_push(ctx) != 0) return "cannot make the CUDA context current";
  CUresult r = work();
  void* popped = nullptr;
  cu.ctx_pop(&popped);
  return r == 0 ? "" : what + " failed (" + std::to_string(r) + ")";
}

// --- The doorbell ------------------------------------------------------------------------------
// One pair of words a device, each on its own cache line of pinned memory: `ring` is written by
// the device's stream and cleared by the worker, `done` the other way round. A device's calls
// follow each other on its stream, so one pair a device is enough; a stream writes `ring` only
// after it has seen the previous call's `done` and cleared it, so no id is lost or read twice.
constexpr int kMaxDevices = 16;
struct alignas(64) Bell {
  uint32_t ring;
  uint8_t pad_ring[60];
  uint32_t done;
  uint8_t pad_done[60];
};
constexpr uint32_t kWaitEq = 0x1;     // CU_STREAM_WAIT_VALUE_EQ
constexpr uint32_t kWriteDefault = 0;  // CU_STREAM_WRITE_VALUE_DEFAULT: after all earlier work of the stream
// How long the worker spins after its last call before it polls at kPollSleep (a decode step
// calls every few hundred microseconds; between requests the worker should not hold a core),
// and after how long it dozes at kDozeSleep (an idle server: a ~1 ms later first call of the
// next request instead of tens of thousands of wake-ups a second).
constexpr auto kSpinIdle = std::chrono::milliseconds(200);
constexpr auto kPollSleep = std::chrono::microseconds(20);
constexpr auto kDozeIdle = std::chrono::seconds(5);
constexpr auto kDozeSleep = std::chrono::milliseconds(1);

Bell* g_bells = nullptr;                // [kMaxDevices], pinned
uint64_t g_bell_device[kMaxDevices];    // each bell's device address, 0 until started
std::atomic<int> g_bell_devices{0};     // the worker polls bells [0, this)
std::mutex g_bell_mu;
std::atomic<bool> g_bell_stop{false};
std::thread* g_bell_worker = nullptr;

void BellWorker() {
  auto last = std::chrono::steady_clock::now();
  while (!g_bell_stop.load(std::memory_order_relaxed)) {
    bool ran = false;
    int devices = g_bell_devices.load(std::memory_order_acquire);
    for (int d = 0; d < devices; ++d) {
      uint32_t id = __atomic_load_n(&g_bells[d].ring, __ATOMIC_ACQUIRE);
      if (id == 0) continue;
      __atomic_store_n(&g_bells[d].ring, 0, __ATOMIC_RELAXED);
      HostCall* c = id <= kMaxCalls ? g_calls[id - 1].load(std::memory_order_acquire) : nullptr;
      if (c != nullptr) HostCallback(c);  // an unknown id (cannot happen) still rings done: never hang the stream
      __atomic_store_n(&g_bells[d].done, id, __ATOMIC_RELEASE);
      ran = true;
    }
    auto now = std::chrono::steady_clock::now();
    if (ran)
      last = now;
    else if (now - last > kDozeIdle)
      std::this_thread::sleep_for(kDozeSleep);
    else if (now - last > kSpinIdle)
      std::this_thread::sleep_for(kPollSleep);
    else
      Pause();
  }
}

// The doorbell of device `ordinal` (allocating the bells and starting the worker on first use);
// "" on success, else what failed.
std::string StartBell(const Driver& cu, int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxDevices) return "device ordinal " + std::to_string(ordinal) + " out of range";
  std::lock_guard<std::mutex> lock(g_bell_mu);
  if (g_bell_device[ordinal] != 0) return "";
  if (!cu.error.empty()) return cu.error;
  if (!cu.host_device_pointer || !cu.write_value32 || !cu.wait_value32)
    return "this CUDA driver has no stream memory operations (cuStreamWaitValue32_v2 and "
           "cuStreamWriteValue32_v2, CUDA 11.7+); use the hostfunc signal";
  std::string failed;
  if (g_bells == nullptr) {
    void* p = nullptr;
    failed = InContext(cu, ordinal, "cuMemHostAlloc of the doorbells", [&] {
      return cu.host_alloc(&p, sizeof(Bell) * kMaxDevices, 0x3 /* PORTABLE | DEVICEMAP */);
    });
    if (!failed.empty()) return failed;
    std::memset(p, 0, sizeof(Bell) * kMaxDevices);
    g_bells = static_cast<Bell*>(p);
    g_bell_worker = new std::thread(BellWorker);
    // At exit the worker stops before the driver's own exit handlers (registered earlier, so run
    // later) unmap the pinned bells it polls.
    std::atexit([] {
      g_bell_stop.store(true);
      g_bell_worker->join();
    });
  }
  uint64_t device_address = 0;
  failed = InContext(cu, ordinal, "cuMemHostGetDevicePointer", [&] {
    return cu.host_device_pointer(&device_address, &g_bells[ordinal], 0);
  });
  if (!failed.empty()) return failed;
  g_bell_device[ordinal] = device_address;
  if (g_bell_devices.load() <= ordinal) g_bell_devices.store(ordinal + 1, std::memory_order_release);
  return "";
}

// The CUDA path's work for one call, queued on `stream` of device `ordinal`: with kStart, the copy
// in and the hand-over to the host; with kFinish, the wait for the host's answer and the copy
// out. The buffers are device pointers: the packed inputs (read by kStart) and the output of n
// tokens (written by kFinish).
constexpr int kStart = 1, kFinish = 2, kWhole = kStart | kFinish;

ffi::Error Enqueue(CUstream stream, int ordinal, int64_t* rec, const void* packed, void* out, int64_t n,
                   int halves = kWhole) {
  const Driver& cu = Cuda();
  if (!cu.error.empty()) return ffi::Error::Internal("bloomery host bridge: " + cu.error);
  if (n > rec[kStageTokens])
    return ffi::Error::Internal("bloomery host bridge: " + std::to_string(n) + " tokens but staging for " +
                                std::to_string(rec[kStageTokens]));
  bool doorbell = rec[kSignal] == 1;
  uint64_t bell = (ordinal >= 0 && ordinal < kMaxDevices) ? g_bell_device[ordinal] : 0;
  if (doorbell && bell == 0)
    return ffi::Error::Internal("bloomery host bridge: no doorbell for device " + std::to_string(ordinal) +
                                " (bloomery_ffi_doorbell_start was not called for it)");
  HostCall* c = Intern(rec, n);
  if (c == nullptr) return ffi::Error::Internal("bloomery host bridge: too many distinct host calls");
  size_t act = 4 * n * rec[kD];
  auto dev = [](const void* p) { return reinterpret_cast<uint64_t>(p); };
  CUresult r = 0;
  if (halves & kStart) {
    r |= cu.memcpy_async(dev(c->x), dev(packed), Offsets(rec, n).total, stream);  // c->x: the staging's start
    if (doorbell)
      r |= cu.write_value32(stream, bell + offsetof(Bell, ring), c->id, kWriteDefault);
    else
      r |= cu.launch_host_func(stream, HostCallback, c);
  }
  if (halves & kFinish) {
    if (doorbell) {
      r |= cu.wait_value32(stream, bell + offsetof(Bell, done), c->id, kWaitEq);
      r |= cu.write_value32(stream, bell + offsetof(Bell, done), 0, kWriteDefault);
    }
    r |= cu.memcpy_async(dev(out), dev(c->out), act, stream);
  }
  if (r != 0) return ffi::Error::Internal("bloomery host bridge: a CUDA driver call failed");
  return ffi::Error::Success();
}

// One copy of a whole expert tensor to the card, queued on the stream (prefill streaming). The
// tensor is in pinned memory (the bridge copies the file's experts there on a GPU), so the copy
// runs at the link's speed and may be recorded into a CUDA graph.
// The copy's bytes are counted by a host function queued after it: a recorded graph replays the
// copy without calling the handler again.
struct StreamCount {
  int64_t* rec;
  int64_t bytes;
};

void CountStreamed(void* arg) {
  auto* c = static_cast<StreamCount*>(arg);
  __atomic_fetch_add(&c->rec[kStreamed], c->bytes, __ATOMIC_RELAXED);
}

ffi::Error StreamCuda(CUstream stream, int64_t slot, int64_t role, ffi::Result<ffi::AnyBuffer> out) {
  auto t = Tensor(slot, role, out);
  if (t.has_error()) return t.error();
  const Driver& cu = Cuda();
  if (!cu.error.empty()) return ffi::Error::Internal("bloomery host bridge: " + cu.error);
  static std::mutex mu;
  static std::map<std::pair<int64_t*, int64_t>, StreamCount*> counts;  // kept: graphs hold them
  StreamCount* count;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& c = counts[{Record(slot), role}];
    if (c == nullptr) c = new StreamCount{Record(slot), static_cast<int64_t>(t->second)};
    count = c;
  }
  if (cu.memcpy_async(reinterpret_cast<uint64_t>(out->untyped_data()), reinterpret_cast<uint64_t>(t->first),
                      t->second, stream) != 0 ||
      cu.launch_host_func(stream, CountStreamed, count) != 0)
    return ffi::Error::Internal("bloomery host bridge: queueing the copy of an expert tensor failed");
  return ffi::Error::Success();
}

// A call on its packed inputs: the whole call (kWhole), or its start half (kStart). The start's
// output (f32 [n, D]) is what the finish half reads: on the CPU the whole call runs into it (the
// start target takes HostMoeCpu); on CUDA it is left as it is and the answer waits in the staging.
template <int kHalves>
ffi::Error HostMoeCuda(CUstream stream, int32_t ordinal, int64_t slot, ffi::AnyBuffer packed,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto checked = Checked(slot, packed, out);
  if (checked.has_error()) return checked.error();
  return Enqueue(stream, ordinal, checked->first, packed.untyped_data(),
                 (kHalves & kFinish) ? out->untyped_data() : nullptr, checked->second, kHalves);
}

// The finish half's record and token count: `started` and `out` are both f32 [n, D]. `after`
// (any buffer) is only an operand, so that the step orders the finish after the work it made it.
ffi::ErrorOr<std::pair<int64_t*, int64_t>> CheckedFinish(int64_t slot, const ffi::AnyBuffer& started,
                                                         const ffi::Result<ffi::AnyBuffer>& out) {
  int64_t* rec = Record(slot);
  if (rec == nullptr)
    return ffi::Error::InvalidArgument("bloomery host bridge: slot " + std::to_string(slot) +
                                       " has no layer record (its bridge was freed?)");
  auto sd = started.dimensions(), od = out->dimensions();
  if (started.element_type() != ffi::F32 || out->element_type() != ffi::F32 || sd.size() != 2 || od.size() != 2 ||
      sd[0] != od[0] || sd[1] != rec[kD] || od[1] != rec[kD])
    return ffi::Error::InvalidArgument("bloomery host bridge: the finish wants the start's f32 [n, D] and gives the same");
  return std::make_pair(rec, static_cast<int64_t>(od[0]));
}

ffi::Error HostMoeFinishCpu(int64_t slot, ffi::AnyBuffer started, ffi::AnyBuffer after,
                            ffi::Result<ffi::AnyBuffer> out) {
  auto checked = CheckedFinish(slot, started, out);
  if (checked.has_error()) return checked.error();
  if (out->untyped_data() != started.untyped_data())
    std::memcpy(out->untyped_data(), started.untyped_data(), out->size_bytes());
  return ffi::Error::Success();
}

ffi::Error HostMoeFinishCuda(CUstream stream, int32_t ordinal, int64_t slot, ffi::AnyBuffer started,
                             ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> out) {
  auto checked = CheckedFinish(slot, started, out);
  if (checked.has_error()) return checked.error();
  return Enqueue(stream, ordinal, checked->first, nullptr, out->untyped_data(), checked->second, kFinish);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryHostMoeCpu, HostMoeCpu,
                              ffi::Ffi::Bind().Attr<int64_t>("slot").Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

namespace {
// The CUDA binding of a call on packed inputs (the whole call and its start half).
auto PackedCudaBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Attr<int64_t>("slot")
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryHostMoeCuda, HostMoeCuda<kWhole>, PackedCudaBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryHostMoeStartCuda, HostMoeCuda<kStart>, PackedCudaBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryHostMoeFinishCpu, HostMoeFinishCpu,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("slot")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryHostMoeFinishCuda, HostMoeFinishCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("slot")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryStreamCpu, StreamCpu,
                              ffi::Ffi::Bind().Attr<int64_t>("slot").Attr<int64_t>("role").Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BloomeryStreamCuda, StreamCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("role")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

int bloomery_ffi_record_words() { return kWords; }

// Points slot at a record (nullptr clears it); 0 on success.
int bloomery_ffi_set_record(int64_t slot, int64_t* record) {
  if (slot < 0 || slot >= kSlots) return 1;
  g_records[slot].store(record, std::memory_order_release);
  return 0;
}

// For tests on machines without a GPU: the CUDA path's queue of work (Enqueue) for slot's record
// on a null stream of device 0, with whatever libcuda.so.1 the process has loaded (tests load a stand-in that
// runs every call at once), the four inputs packed here as the step packs them; `halves` as
// Enqueue's (1 the start, 2 the finish, 3 the whole call). 0 on success, else 1 with the message
// in `error`.
int bloomery_ffi_test_enqueue(int64_t slot, const void* x, const void* experts, const void* weights,
                              const void* on_host, void* out, int64_t n, int halves, char* error, size_t error_len) {
  int64_t* rec = Record(slot);
  ffi::Error e = ffi::Error::InvalidArgument("no record");
  if (rec != nullptr) {
    Packed off = Offsets(rec, n);
    std::vector<uint8_t> packed(off.total);
    std::memcpy(packed.data() + off.x, x, off.experts - off.x);
    std::memcpy(packed.data() + off.experts, experts, off.weights - off.experts);
    std::memcpy(packed.data() + off.weights, weights, off.on_host - off.weights);
    std::memcpy(packed.data() + off.on_host, on_host, off.total - off.on_host);
    e = Enqueue(nullptr, 0, rec, halves & kStart ? packed.data() : nullptr, halves & kFinish ? out : nullptr, n,
                halves);
  }
  if (e.success()) return 0;
  snprintf(error, error_len, "%s", e.message().c_str());
  return 1;
}

// For probes of the host call (scripts/host_call_probe.py): the handlers' host work for `rec` on
// the calling thread (on the host team where the record asks), with no device and no packing.
void bloomery_ffi_run_host(int64_t* rec, const void* x, const int32_t* experts, const void* weights,
                           const bool* on_host, void* out, int64_t n) {
  RunHost(rec, x, experts, weights, on_host, out, n);
}

// Seating experts on the card (placement/slots.py): rows `ids[0..n)` of a host tensor whose rows
// are `row_bytes` apart from `src` (pinned memory: the copies run at the link's speed, with no
// staging copy on the host) copied one after the other into the device buffer at `dst`, in
// device `ordinal`'s primary context. Synchronous: the buffer holds them when this returns. 0 on
// success, else 1 with a message in `error`.
int bloomery_ffi_rows_to_device(int ordinal, uint64_t dst, const uint8_t* src, const int64_t* ids, int64_t n,
                                int64_t row_bytes, char* error, size_t error_len) {
  const Driver& cu = Cuda();
  std::string failed = InContext(cu, ordinal, "cuMemcpyHtoD", [&] {
    CUresult r = 0;
    for (int64_t j = 0; j < n && r == 0; ++j)
      r = cu.memcpy_htod(dst + static_cast<uint64_t>(j * row_bytes), src + ids[j] * row_bytes,
                         static_cast<size_t>(row_bytes));
    return r;
  });
  if (failed.empty()) return 0;
  snprintf(error, error_len, "%s", failed.c_str());
  return 1;
}

// Starts the doorbell of device `ordinal` (a pinned pair of words it writes and waits on, and the
// worker thread that answers them; see the top of this file). 0 on success, else 1 with the
// message in `error`.
int bloomery_ffi_doorbell_start(int ordinal, char* error, size_t error_len) {
  const Driver& cu = Cuda();
  std::string failed = StartBell(cu, ordinal);
  if (failed.empty()) return 0;
  snprintf(error, error_len, "%s", failed.c_str());
  return 1;
}

// Page-locked host memory usable by the device `ordinal`'s copies (cuMemHostAlloc, portable);
// nullptr with a message in `error` (of `error_len` bytes) on failure.
void* bloomery_ffi_pinned_alloc(int ordinal, size_t bytes, char* error, size_t error_len) {
  const Driver& cu = Cuda();
  void* p = nullptr;
  std::string failed = InContext(cu, ordinal, "cuMemHostAlloc of " + std::to_string(bytes) + " bytes",
                                 [&] { return cu.host_alloc(&p, bytes, 1 /* CU_MEMHOSTALLOC_PORTABLE */); });
  if (failed.empty()) return p;
  snprintf(error, error_len, "%s", failed.c_str());
  return nullptr;
}

// Page-lock `bytes` of host memory at `p` (allocated by the caller, e.g. on huge pages) for the
// device `ordinal`'s copies (cuMemHostRegister, portable); 0, or 1 with a message in `error`.
int bloomery_ffi_host_register(int ordinal, void* p, size_t bytes, char* error, size_t error_len) {
  const Driver& cu = Cuda();
  std::string failed = cu.host_register == nullptr && cu.error.empty()
                           ? std::string("libcuda.so.1 has no cuMemHostRegister_v2")
                           : InContext(cu, ordinal, "cuMemHostRegister of " + std::to_string(bytes) + " bytes",
                                       [&] { return cu.host_register(p, bytes, 1 /* CU_MEMHOSTREGISTER_PORTABLE */); });
  if (failed.empty()) return 0;
  snprintf(error, error_len, "%s", failed.c_str());
  return 1;
}

}  // extern "C"

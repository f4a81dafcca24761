// The functional collectives (``torch.ops._c10d_functional``: TP / DTensor's path) traced in torch's dispatcher:
// a wrapper kernel per op at the CPU key that takes the op's sequence number and a CLOCK_MONOTONIC reading,
// calls the kernel torch computed for that key before (``install``: its CompositeExplicitAutograd kernel) on
// the same stack, and keys the op by its output's data pointer; ``wait_tensor``'s kernel times the wait and
// moves the op to a bounded list the tracer drains on its flusher thread (agent/instrument/funcol_kernels.py).
// No Python runs per op: a Python wrapper of funcol's functions costs 5.8-6.3 us of training-thread CPU per
// op on the dev VM however little it does (bench/hooks_overhead.py's funcol floor; the probe of this design:
// bench/funcol_dispatcher_probe.py).
//
// Why the backend key and not ADInplaceOrView (the probe's): an op called inside a tensor subclass's
// __torch_dispatch__ — the wait an AsyncCollectiveTensor makes on its first use, DTensor's redistributions
// during its own dispatch — runs below autograd with ADInplaceOrView excluded, so a kernel there never sees it
// (a TP step of the trainer lost 10 of its 27 funcol ops so); and inference-mode tensors have no such key.
// Every call on a CPU tensor reaches the CPU key.
//
// What is recorded is what comm_funcol's Python sites record for the same call: the op, its group (by
// c10d's group name), its bytes (all-gather: the output's), the sequence number from the group's counter
// (shared with the Python and C sites of the c10d ops: ``counter``), the issue time, and at its
// ``wait_tensor`` the wait's end and its blocked time. Only CPU tensors reach these kernels (a process with
// CUDA keeps the Python sites: funcol_kernels.usable); a tracing mode's stand-ins (fake tensors) are handled
// above this key. Nothing of this code may fail the op: its own errors are counted (``stats``), the op's own
// exceptions propagate unchanged.
//
// DDP's gradient buckets (``ddp_*`` below): DDP's C++ reducer all-reduces each bucket through its built-in comm
// hook, ProcessGroup::allreduce, which dispatches ``c10d::allreduce_``; a kernel of ours at its CPU key sees each
// bucket with DDP's built-in all-reduce left in place (a Python comm hook, the only other way to see them,
// costs a step of the 6-bucket toy in bench/hooks_overhead.py 6-16 % more CPU than the built-in, whatever it
// does). Recorded: a call inside a backward (an autograd graph task), on a group a DDP model was attached with
// (``ddp_arm``), not made by one of meshscope's sites (``site_depth``: those record their own call). Its
// completion is stamped by a C++ callback on the work's future (gloo's thread, no GIL); the time backward then
// blocks in the reducer's finalize is the window between two autograd final callbacks queued around it (the
// first one queued at the backward's first bucket, before the reducer queues its finalize; it queues the
// second, which runs after the finalize), as comm_ddp's hook does it in Python; the tracer splits it across
// the buckets (comm_ddp.split_window).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <time.h>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

enum Op { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST };
const char* const kOpNames[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"};

struct Pending { int op, gid; int64_t nbytes, seq, t0; };
struct Done { int op, gid; int64_t nbytes, seq, t0, t1, wait; };
using Counter = std::shared_ptr<std::atomic<int64_t>>;

std::atomic<bool> g_on{false};
std::mutex g_mu;  // everything below
std::unordered_map<const void*, Pending> g_pending;
std::vector<Done> g_done;
size_t g_max_pending = 4096, g_max_done = 65536;
std::unordered_map<std::string, int> g_gids;  // c10d group name -> index into g_names / g_counter_of
std::vector<std::string> g_names;
std::vector<Counter> g_counter_of;
std::unordered_map<std::string, Counter> g_counters;  // by group name, shared with the tracer's GroupTable
int64_t g_bound = 0;  // the tracer bound (its token), 0 when none
int64_t g_unmatched = 0, g_unmatched_ns = 0, g_dropped_done = 0, g_dropped_pending = 0, g_errors = 0;

// >0 while this thread is inside one of meshscope's sites (the C sites of _hot.c through ``site_depth``, the
// kernels here): an all-reduce they make is their op, recorded by them, not a DDP bucket.
thread_local int t_site_depth = 0;
struct SiteScope {
  SiteScope() { ++t_site_depth; }
  ~SiteScope() { --t_site_depth; }
};


inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

Counter& counter_locked(const std::string& name) {
  Counter& c = g_counters[name];
  if (!c) c = std::make_shared<std::atomic<int64_t>>(0);
  return c;
}

int gid_locked(const std::string& name) {
  auto it = g_gids.find(name);
  if (it != g_gids.end()) return it->second;
  int id = static_cast<int>(g_names.size());
  g_gids.emplace(name, id);
  g_names.push_back(name);
  g_counter_of.push_back(counter_locked(name));
  return id;
}

// A tensor whose op is recorded: dense CPU memory with a data pointer to key its wait by.
bool recordable(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == c10::kStrided && t.has_storage();
}

// torch's own kernel of each op for the CPU key, taken before ours took its place (``install``).
enum Slot { S_ALL_REDUCE, S_ALL_GATHER, S_REDUCE_SCATTER, S_ALL_TO_ALL, S_BROADCAST, S_ALL_REDUCE_CO, S_ALL_GATHER_CO,
            S_REDUCE_SCATTER_CO, S_WAIT, N_SLOTS };
std::optional<c10::SafeKernelFunction> g_torch[N_SLOTS];

template <int SLOT>
inline void pass_on(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  g_torch[SLOT]->callBoxed(op, ks, stack);
}

// An issuing op: its first argument a Tensor (or a list of them: the *_coalesced ops, one record per
// tensor), its last the group's name. OUTPUT_BYTES: the op's bytes are its output's (all-gather).
template <int SLOT, int OP, bool OUTPUT_BYTES>
void issue_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!g_on.load(std::memory_order_relaxed)) return pass_on<SLOT>(op, ks, stack);
  std::vector<at::Tensor> inputs;
  int gid = -1;
  int64_t seq0 = 0;
  try {
    const size_t n = op.schema().arguments().size();
    const c10::IValue& first = (*stack)[stack->size() - n];
    const c10::IValue& name = stack->back();
    if (name.isString()) {
      if (first.isTensor()) {
        inputs.push_back(first.toTensor());
      } else if (first.isTensorList()) {
        for (const at::Tensor& t : first.toTensorList()) inputs.push_back(t);
      }
    }
    for (const at::Tensor& t : inputs) {
      if (!recordable(t)) {
        inputs.clear();
        break;
      }
    }
    if (!inputs.empty()) {  // numbered at the issue, as the Python sites number theirs
      std::lock_guard<std::mutex> lock(g_mu);
      gid = gid_locked(name.toStringRef());
      seq0 = g_counter_of[gid]->fetch_add(static_cast<int64_t>(inputs.size())) + 1;
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_errors;
    inputs.clear();
  }
  if (inputs.empty()) return pass_on<SLOT>(op, ks, stack);
  const int64_t t0 = now_ns();
  {
    SiteScope scope;  // its ProcessGroup call (c10d::allreduce_ for all_reduce) is this op
    pass_on<SLOT>(op, ks, stack);  // the op itself: its exceptions are the caller's
  }
  try {
    std::vector<at::Tensor> outputs;
    const c10::IValue& out = stack->back();
    if (out.isTensor()) {
      outputs.push_back(out.toTensor());
    } else if (out.isTensorList()) {
      for (const at::Tensor& t : out.toTensorList()) outputs.push_back(t);
    }
    std::lock_guard<std::mutex> lock(g_mu);
    if (outputs.size() != inputs.size()) {
      ++g_errors;
      return;
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      const at::Tensor& t = OUTPUT_BYTES ? outputs[i] : inputs[i];
      if (g_pending.size() >= g_max_pending) {
        ++g_dropped_pending;
        continue;
      }
      g_pending[outputs[i].data_ptr()] =
          Pending{OP, gid, static_cast<int64_t>(t.nbytes()), seq0 + static_cast<int64_t>(i), t0};
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_errors;
  }
}

// wait_tensor(Tensor tensor) -> Tensor: the op whose output this is completes at the wait's return.
void wait_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!g_on.load(std::memory_order_relaxed)) return pass_on<S_WAIT>(op, ks, stack);
  const void* key = nullptr;
  try {
    const at::Tensor& t = stack->back().toTensor();
    if (recordable(t)) key = t.data_ptr();
  } catch (...) {
    key = nullptr;
  }
  if (key == nullptr) return pass_on<S_WAIT>(op, ks, stack);
  const int64_t w0 = now_ns();
  pass_on<S_WAIT>(op, ks, stack);
  const int64_t w1 = now_ns();
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_pending.find(key);
  if (it == g_pending.end()) {  // an op issued untraced (before the tracer bound, or not recordable)
    ++g_unmatched;
    g_unmatched_ns += w1 - w0;
    return;
  }
  const Pending p = it->second;
  g_pending.erase(it);
  if (g_done.size() >= g_max_done) {
    ++g_dropped_done;
    return;
  }
  g_done.push_back(Done{p.op, p.gid, p.nbytes, p.seq, p.t0, w1, w1 - w0});
}

#include "_ddp_kernel.h"

// Called by _hot.c's sites around their call: +1 on entry, -1 on return.
void site_depth(int delta) { t_site_depth += delta; }

inline double seconds(int64_t ns) { return static_cast<double>(ns) / 1e9; }  // as time.perf_counter converts

}  // namespace

// Puts the kernels in place at the CPU key of each op, once per process (a registration is never undone:
// ``bind`` / ``unbind`` switch recording); each keeps torch's kernel for the key it replaces. False (nothing
// registered) where an op is missing or has a kernel of its own for the CPU key already: then the sites trace.
template <c10::BoxedKernel::BoxedKernelFunction_withDispatchKeys* FN>
void impl(torch::Library& lib, const char* name) {
  lib.impl(name, torch::CppFunction::makeFromBoxedFunction<FN>());
}

bool install_kernels() {
  static std::mutex mu;
  static std::unique_ptr<torch::Library> lib;
  std::lock_guard<std::mutex> lock(mu);
  if (lib) return true;
  struct Entry { const char* name; Slot slot; void (*impl)(torch::Library&, const char*); };
  const Entry entries[] = {
      {"all_reduce", S_ALL_REDUCE, &impl<&issue_kernel<S_ALL_REDUCE, ALL_REDUCE, false>>},
      {"all_gather_into_tensor", S_ALL_GATHER, &impl<&issue_kernel<S_ALL_GATHER, ALL_GATHER, true>>},
      {"reduce_scatter_tensor", S_REDUCE_SCATTER, &impl<&issue_kernel<S_REDUCE_SCATTER, REDUCE_SCATTER, false>>},
      {"all_to_all_single", S_ALL_TO_ALL, &impl<&issue_kernel<S_ALL_TO_ALL, ALL_TO_ALL, false>>},
      {"broadcast", S_BROADCAST, &impl<&issue_kernel<S_BROADCAST, BROADCAST, false>>},
      {"all_reduce_coalesced", S_ALL_REDUCE_CO, &impl<&issue_kernel<S_ALL_REDUCE_CO, ALL_REDUCE, false>>},
      {"all_gather_into_tensor_coalesced", S_ALL_GATHER_CO, &impl<&issue_kernel<S_ALL_GATHER_CO, ALL_GATHER, true>>},
      {"reduce_scatter_tensor_coalesced", S_REDUCE_SCATTER_CO,
       &impl<&issue_kernel<S_REDUCE_SCATTER_CO, REDUCE_SCATTER, false>>},
      {"wait_tensor", S_WAIT, &impl<&wait_kernel>},
  };
  auto& dispatcher = c10::Dispatcher::singleton();
  // DDP's buckets: c10d::allreduce_ has a kernel of its own at the CPU key (gloo's), which ours replaces and
  // calls. Torch warns (once per process) that a kernel is overridden: not a job's business, so not shown.
  auto allreduce = dispatcher.findOp(c10::OperatorName("c10d::allreduce_", ""));
  const bool ddp = allreduce && allreduce->hasComputedKernelForDispatchKey(c10::DispatchKey::CPU)
                   && allreduce->schema().arguments().size() == 6 && allreduce->schema().returns().size() == 2;
  if (ddp) g_torch_allreduce.emplace(allreduce->getComputedKernelForDispatchKey(c10::DispatchKey::CPU));
  for (const Entry& e : entries) {
    auto handle = dispatcher.findOp(c10::OperatorName(std::string("_c10d_functional::") + e.name, ""));
    if (!handle || handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)
        || !handle->hasComputedKernelForDispatchKey(c10::DispatchKey::CPU))
      return false;
    g_torch[e.slot].emplace(handle->getComputedKernelForDispatchKey(c10::DispatchKey::CPU));
  }
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_c10d_functional", c10::DispatchKey::CPU, __FILE__,
                                         __LINE__);
  for (const Entry& e : entries) e.impl(*lib, e.name);
  if (ddp) {
    struct Silent : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } silent;
    c10::WarningUtils::WarningHandlerGuard guard(&silent);
    static torch::Library c10d_lib(torch::Library::IMPL, "c10d", c10::DispatchKey::CPU, __FILE__, __LINE__);
    c10d_lib.impl("allreduce_", torch::CppFunction::makeFromBoxedFunction<&ddp_allreduce_kernel>());
    g_ddp_installed = true;
  }
  return true;
}

// A group's issue counter, shared by the kernels and the tracer's sites (grouptable.GroupTable): ``next``
// gives the next sequence number (from 1); ``address`` the int64 it counts in (for _hot.SharedCount).
struct PyCounter {
  Counter c;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("install", &install_kernels);
  py::class_<PyCounter>(m, "Counter")
      .def("__iter__", [](PyCounter& self) -> PyCounter& { return self; })
      .def("__next__", [](PyCounter& self) { return self.c->fetch_add(1) + 1; })
      .def_property_readonly("address", [](PyCounter& self) { return reinterpret_cast<uintptr_t>(self.c.get()); });
  m.def("bind", [](int64_t token, size_t max_pending, size_t max_done) {
    // Recording on for ``token`` (a tracer); a tracer other than the last one bound starts afresh (its
    // counters from 1, as a new GroupTable's). False when another tracer holds it.
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_bound != 0 && g_bound != token) return false;
    if (g_bound == 0) {
      static int64_t last = 0;
      if (last != token) {
        g_gids.clear(); g_names.clear(); g_counter_of.clear(); g_counters.clear();
        g_done.clear(); g_pending.clear(); g_windows.clear();
        g_unmatched = g_unmatched_ns = g_dropped_done = g_dropped_pending = g_errors = 0;
        last = token;
      }
    }
    g_bound = token;
    g_max_pending = max_pending;
    g_max_done = max_done;
    g_on.store(true);
    return true;
  });
  m.def("unbind", [](int64_t token) {
    // Recording off; the ops still waiting for their wait_tensor are dropped (counted).
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_bound != token) return;
    g_on.store(false);
    g_ddp_on.store(false);
    g_bound = 0;
    g_dropped_pending += static_cast<int64_t>(g_pending.size());
    g_pending.clear();
    g_ddp_groups.clear();
    if (g_window) {  // a backward in flight: its buckets are dropped (counted)
      g_dropped_pending += static_cast<int64_t>(g_window->ops.size());
      g_window.reset();
      g_window_task = -1;
    }
  });
  m.def("counter", [](const std::string& name) {
    std::lock_guard<std::mutex> lock(g_mu);
    return PyCounter{counter_locked(name)};
  });
  m.def("drain", []() {
    // The completed ops, as (op, group name, bytes, seq, t_start, t_end, wait_s) in time.perf_counter's
    // seconds, and the counts since the last drain (dict).
    std::vector<Done> done;
    std::vector<std::string> names;
    int64_t unmatched, unmatched_ns, dropped_done, dropped_pending, errors;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      done.swap(g_done);
      names = g_names;
      unmatched = g_unmatched; unmatched_ns = g_unmatched_ns; dropped_done = g_dropped_done;
      dropped_pending = g_dropped_pending; errors = g_errors;
      g_unmatched = g_unmatched_ns = g_dropped_done = g_dropped_pending = g_errors = 0;
    }
    py::list rows;
    for (const Done& d : done) {
      rows.append(py::make_tuple(kOpNames[d.op], names[d.gid], d.nbytes, d.seq, seconds(d.t0), seconds(d.t1),
                                 seconds(d.wait)));
    }
    py::dict stats;
    stats["unmatched_waits"] = unmatched;
    stats["unmatched_wait_us"] = unmatched_ns / 1000;
    stats["dropped_done"] = dropped_done;
    stats["dropped_pending"] = dropped_pending;
    stats["kernel_errors"] = errors;
    return py::make_tuple(rows, stats);
  });
  m.def("ddp_installed", []() { return g_ddp_installed; });
  m.def("ddp_arm", [](const std::string& name) {
    // DDP's buckets on group ``name`` recorded from now on (while bound). False where they cannot be.
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_ddp_installed || g_bound == 0) return false;
    g_ddp_groups.insert(name);
    g_ddp_on.store(true);
    return true;
  });
  m.def("ddp_disarm", [](const std::string& name) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_ddp_groups.erase(name);
    if (g_ddp_groups.empty()) g_ddp_on.store(false);
  });
  m.def("ddp_drain", []() {
    // The closed backward windows: (t_a, t_b, [(group name, bytes, seq, t_start, t_done)]) in
    // time.perf_counter's seconds; 0.0 where a time was not stamped.
    std::vector<std::shared_ptr<Window>> windows;
    std::vector<std::string> names;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      windows.swap(g_windows);
      names = g_names;
    }
    py::list out;
    for (const auto& w : windows) {
      py::list ops;
      for (const auto& o : w->ops) {
        ops.append(py::make_tuple(names[o->gid], o->nbytes, o->seq, seconds(o->t0), seconds(o->t_done.load())));
      }
      out.append(py::make_tuple(seconds(w->t_a), seconds(w->t_b), ops));
    }
    return out;
  });
  // The address of ``site_depth(int delta)``, which _hot.c's sites call around their call (native.depth_hook).
  m.def("site_depth_address", []() { return reinterpret_cast<uintptr_t>(&site_depth); });
  m.def("pending", []() {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_pending.size();
  });
}

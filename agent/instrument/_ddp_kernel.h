// DDP's gradient buckets in torch's dispatcher: the kernel at c10d::allreduce_'s CPU key and the backward
// windows it records (the why and the what: _funcol_kernels.cpp's opening comment, "DDP's gradient buckets").
// Included once by _funcol_kernels.cpp, inside its anonymous namespace, after what it shares (g_mu, now_ns,
// recordable, gid_locked, the limits and counts, t_site_depth).
#pragma once

// One DDP bucket's all-reduce; ``t_done`` stamped by its future's callback (0 until then).
struct DdpOp {
  int gid;
  int64_t nbytes, seq, t0;
  std::atomic<int64_t> t_done{0};
};
// One backward's buckets and the reducer's blocked window [t_a, t_b] (0: not stamped).
struct Window {
  int64_t t_a = 0, t_b = 0;
  std::vector<std::shared_ptr<DdpOp>> ops;
};
std::atomic<bool> g_ddp_on{false};
std::unordered_set<std::string> g_ddp_groups;       // under g_mu: the groups of attached DDP models
std::shared_ptr<Window> g_window;                   // under g_mu: the open backward's
int g_window_task = -1;                             // its autograd graph task
std::vector<std::shared_ptr<Window>> g_windows;     // under g_mu: closed, for drain

// The window ends (t_b; 0 when it could not be stamped) and goes to the drain list, if still the open one.
void close_window_locked(const std::shared_ptr<Window>& window, int64_t t_b) {
  window->t_b = t_b;
  if (g_window == window) {
    g_window.reset();
    g_window_task = -1;
  }
  if (g_windows.size() >= g_max_done) {
    g_dropped_done += static_cast<int64_t>(window->ops.size());
    return;
  }
  g_windows.push_back(window);
}

// Queued at a backward's first bucket: stamps t_a and queues the second callback, which runs after the
// reducer's finalize (queued in between) and stamps t_b. Never throws into backward.
void window_start(std::shared_ptr<Window> window) {
  const int64_t t_a = now_ns();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    window->t_a = t_a;
  }
  try {
    torch::autograd::Engine::get_default_engine().queue_callback([window]() {
      const int64_t t_b = now_ns();
      std::lock_guard<std::mutex> lock(g_mu);
      close_window_locked(window, t_b);
    });
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_errors;
    close_window_locked(window, 0);
  }
}

std::optional<c10::SafeKernelFunction> g_torch_allreduce;
bool g_ddp_installed = false;

// c10d::allreduce_(Tensor[] tensors, ProcessGroup process_group, ReduceOp reduce_op, Tensor? sparse_indices,
//                  bool async_op, int timeout) -> (Tensor[], Work)
void ddp_allreduce_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!g_ddp_on.load(std::memory_order_relaxed) || t_site_depth > 0)
    return g_torch_allreduce->callBoxed(op, ks, stack);
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return g_torch_allreduce->callBoxed(op, ks, stack);
  std::shared_ptr<DdpOp> rec;
  std::shared_ptr<Window> first;  // set when this bucket opens its backward's window
  try {
    const size_t n = op.schema().arguments().size();
    const c10::IValue& tensors = (*stack)[stack->size() - n];
    const c10::IValue& group = (*stack)[stack->size() - n + 1];
    int64_t nbytes = 0;
    bool ok = tensors.isTensorList() && group.isCustomClass();
    if (ok) {
      for (const at::Tensor& t : tensors.toTensorList()) {
        if (!recordable(t)) {
          ok = false;
          break;
        }
        nbytes += static_cast<int64_t>(t.nbytes());
      }
    }
    if (ok) {
      const std::string& name = group.toCustomClass<c10d::ProcessGroup>()->getGroupName();
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_ddp_groups.count(name)) {
        if (!g_window || g_window_task != task) {
          if (g_window) close_window_locked(g_window, 0);  // a backward whose window never closed
          g_window = std::make_shared<Window>();
          g_window_task = task;
          first = g_window;
        }
        if (g_window->ops.size() >= g_max_pending) {
          ++g_dropped_pending;
        } else {
          const int gid = gid_locked(name);
          rec = std::make_shared<DdpOp>();
          rec->gid = gid;
          rec->nbytes = nbytes;
          rec->seq = g_counter_of[gid]->fetch_add(1) + 1;
          rec->t0 = now_ns();  // set before the window holds it: the drain reads it on another thread
          g_window->ops.push_back(rec);
        }
      }
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_errors;
    rec.reset();
  }
  if (first) {
    try {
      torch::autograd::Engine::get_default_engine().queue_callback([first]() { window_start(first); });
    } catch (...) {
      std::lock_guard<std::mutex> lock(g_mu);
      ++g_errors;
      close_window_locked(first, 0);
    }
  }
  if (!rec) return g_torch_allreduce->callBoxed(op, ks, stack);
  g_torch_allreduce->callBoxed(op, ks, stack);  // the op itself: its exceptions are the caller's
  try {
    auto work = stack->back().toCustomClass<c10d::Work>();
    work->getFuture()->addCallback([rec](c10::ivalue::Future&) { rec->t_done.store(now_ns()); });
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_errors;
  }
}


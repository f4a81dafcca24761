// What CUDA timing costs the issuing thread when done in C++ (bench/gpu_event_probe.py builds and runs this).
//
// The CUDA path of the tracer (agent/instrument/comm_nccl.py) records two or three `torch.Event`s per op from
// Python: 2.5 µs each, and `torch.cuda.current_stream()` 3.9 µs, on an H100's host
// (bench/results/gpu-check-2026-11-27-h100-84d4362-partial.md, check 2). The same through c10's
// device-generic API needs no CUDA headers (the build is the same as the CPU kernels'), and a C site could
// call it without a Python object per event. Each figure is training-thread CPU per call (CLOCK_THREAD_CPUTIME_ID
// around n calls), on the current device and stream.
#include <torch/extension.h>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <time.h>

#include <deque>
#include <vector>

namespace {

double thread_us() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

c10::Event timing_event() { return c10::Event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT); }

// The marks a tracer would make around ops issued from Python (`mark()`): one event per call, kept until
// `resolve()` reads the pairs' elapsed times. Single-threaded, as the probe calls it.
std::deque<c10::Event> g_marks;

}  // namespace

// {name: µs per call} for the pieces of a C++ event path; n calls each.
py::dict cost(int64_t n) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  const c10::Device device = impl.getDevice();
  py::dict out;
  int64_t sink = 0;
  double t0 = thread_us();
  for (int64_t i = 0; i < n; i++) sink += impl.getStream(device).id();
  out["current_stream_us"] = (thread_us() - t0) / n;

  std::vector<c10::Event> fresh;
  fresh.reserve(n);
  t0 = thread_us();
  for (int64_t i = 0; i < n; i++) {
    fresh.push_back(timing_event());
    fresh.back().record(impl.getStream(device));
  }
  out["new_event_record_us"] = (thread_us() - t0) / n;  // created on its first record, as torch.Event
  fresh.back().synchronize();
  double total = 0.0;
  t0 = thread_us();
  for (int64_t i = 1; i < n; i++) {
    if (fresh[i].query()) total += fresh[i - 1].elapsedTime(fresh[i]);
  }
  out["query_elapsed_us"] = (thread_us() - t0) / (n - 1);
  t0 = thread_us();
  fresh.clear();
  out["destroy_us"] = (thread_us() - t0) / n;

  std::vector<c10::Event> pool;
  for (int i = 0; i < 64; i++) {
    pool.push_back(timing_event());
    pool.back().record(impl.getStream(device));
  }
  pool.back().synchronize();
  t0 = thread_us();
  for (int64_t i = 0; i < n; i++) pool[i % 64].record(impl.getStream(device));
  out["pooled_event_record_us"] = (thread_us() - t0) / n;
  pool.back().synchronize();
  out["sink"] = sink + static_cast<int64_t>(total > 0);
  return out;
}

// One timing event recorded now on the current stream (what a C site would call before and after an op).
void mark() {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  g_marks.push_back(timing_event());
  g_marks.back().record(impl.getStream(impl.getDevice()));
}

// The elapsed ms of each (before, after) pair of marks, oldest first; waits for the last one; clears.
std::vector<double> resolve() {
  std::vector<double> ms;
  if (!g_marks.empty()) g_marks.back().synchronize();
  for (size_t i = 0; i + 1 < g_marks.size(); i += 2) ms.push_back(g_marks[i].elapsedTime(g_marks[i + 1]));
  g_marks.clear();
  return ms;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cost", &cost, py::arg("n"));
  m.def("mark", &mark);
  m.def("resolve", &resolve);
}

// The one boundary between Python and native code: transport._C.
// Only integers, byte counts and addresses cross it; no torch at build time. Native failures
// arrive in Python as RuntimeError and are translated into the TransportError tree in
// transport/_native.py, the single place that knows about this module.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstring>

#include "copy_engine.h"
#include "host_memory.h"

namespace nb = nanobind;
using namespace transport;

NB_MODULE(_C, m) {
  m.doc() = "Native core of transport: copy engine, shareable host memory, CMA.";
  // Tensors over SharedBuffers may legitimately outlive the interpreter's teardown.
  nb::set_leak_warnings(false);

  nb::class_<CopyEngine>(m, "CopyEngine")
      .def(nb::init<int, uint64_t>(), nb::arg("threads"), nb::arg("chunk_bytes"))
      .def_prop_ro("event_fd", &CopyEngine::event_fd)
      .def(
          "submit",
          [](CopyEngine& e, int kind, int pid,
             const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& segs) {
            if (kind < 0 || kind > 2) throw std::invalid_argument("unknown copy kind");
            std::vector<Segment> v;
            v.reserve(segs.size());
            for (auto& [dst, src, len] : segs) v.push_back({dst, src, len});
            return e.submit(static_cast<CopyKind>(kind), pid, v);
          },
          nb::arg("kind"), nb::arg("pid"), nb::arg("segments"))
      .def("cancel", &CopyEngine::cancel)
      .def("drain",
           [](CopyEngine& e) {
             std::vector<std::tuple<uint64_t, int, int, uint64_t>> out;
             for (const Completion& c : e.drain())
               out.emplace_back(c.id, static_cast<int>(c.status), c.err, c.bytes);
             return out;
           })
      .def("shutdown", &CopyEngine::shutdown, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<SharedBuffer>(m, "SharedBuffer")
      .def(nb::init<size_t, const std::string&>(), nb::arg("nbytes"), nb::arg("name"),
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("address", &SharedBuffer::address)
      .def_prop_ro("nbytes", &SharedBuffer::nbytes)
      .def_prop_ro("fd", &SharedBuffer::fd)
      .def(
          "array",
          [](nb::handle self) {
            SharedBuffer& b = nb::cast<SharedBuffer&>(self);
            size_t shape[1] = {b.nbytes()};
            // The array (and any tensor made from it through DLPack) keeps the buffer alive.
            return nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cpu>(
                reinterpret_cast<void*>(b.address()), 1, shape, self);
          },
          "A 1-D uint8 DLPack array over the buffer that keeps it alive.");

  nb::class_<PeerMapping>(m, "PeerMapping")
      .def(nb::init<int, int, size_t, bool>(), nb::arg("pid"), nb::arg("fd"), nb::arg("nbytes"),
           nb::arg("writable"))
      .def_prop_ro("address", &PeerMapping::address)
      .def_prop_ro("nbytes", &PeerMapping::nbytes);

  m.def(
      "copy_now",
      [](int kind, int pid, uint64_t dst, uint64_t src, uint64_t n) {
        if (kind < 0 || kind > 2) throw std::invalid_argument("unknown copy kind");
        return copy_now(static_cast<CopyKind>(kind), pid, {dst, src, n});
      },
      nb::arg("kind"), nb::arg("pid"), nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"),
      nb::call_guard<nb::gil_scoped_release>(),
      "Copies on the calling thread; returns 0 or errno. For small copies only.");
  m.def(
      "memory_fence", [] { std::atomic_thread_fence(std::memory_order_seq_cst); },
      "A full memory fence: orders a flag store before the next load of another process's flag.");
  m.def("cma_probe", &cma_probe, nb::arg("pid"), nb::arg("address"), nb::arg("nbytes"));
  m.def("probe_address", &probe_address);
  m.def("allow_ptrace_from_any", &allow_ptrace_from_any);
  m.def(
      "memcpy",
      [](uint64_t dst, uint64_t src, uint64_t n) {
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>(),
      "Plain single-threaded memcpy: the same-run baseline of the benchmarks.");
}

// The one boundary between Python and native code: transport._C.
// Only integers, byte counts and addresses cross it; no torch at build time. Native failures
// arrive in Python as RuntimeError and are translated into the TransportError tree in
// the transport._native package, the single place that knows about this module.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "copy_engine.h"
#include "stream_copy.h"
#include "cuda_driver.h"
#include "cuda_engine.h"
#include "cuda_ops.h"
#include "delta.h"
#include "host_memory.h"
#include "tcp_direct.h"
#ifdef TRANSPORT_HAVE_KERNELS
#include "transport_kernels_image.h"  // generated from csrc/kernels/*.cu by nvcc (CMakeLists.txt)
#endif
#ifdef TRANSPORT_HAVE_UCX
#include "ucx_engine.h"
#endif

namespace nb = nanobind;
using namespace transport;

namespace {

// A table of u64 triples packed by Python (transport._native.pack_segments) as a vector of
// `T` (Segment, ucx::Piece: three u64 fields). Copied out of the bytes object, which may not
// be 8-aligned. Throws std::invalid_argument for a ragged table.
template <class T>
std::vector<T> unpack_triples(const nb::bytes& packed) {
  static_assert(sizeof(T) == 3 * sizeof(uint64_t), "a packed entry is three u64");
  if (packed.size() % sizeof(T) != 0)
    throw std::invalid_argument("packed segments must be a whole number of u64 triples");
  std::vector<T> v(packed.size() / sizeof(T));
  std::memcpy(v.data(), packed.c_str(), packed.size());
  return v;
}

// -- cuda: the driver (dlopen'ed at run time) and the operations built on it ----------------
// Without a driver every cuda_* call raises transport._C.CudaUnavailable (its message says
// why); a refused driver call raises transport._C.CudaError with the driver's error name.
void bind_cuda(nb::module_& m) {
  nb::exception<cuda::Unavailable>(m, "CudaUnavailable", PyExc_RuntimeError);
  nb::exception<cuda::Error>(m, "CudaError", PyExc_RuntimeError);
  m.def("cuda_load", [](const std::string& path) { return cuda::load(path); }, nb::arg("path") = "",
        nb::call_guard<nb::gil_scoped_release>(),
        "Loads the CUDA driver once; returns '' when usable, else why not (later calls repeat the first outcome).");
  m.def("cuda_driver_version", &cuda::driver_version);
  m.def("cuda_device_count", &cuda::device_count);
  m.def("cuda_device_uuid", &cuda::device_uuid, nb::arg("device"));
  m.def("cuda_device_name", &cuda::device_name, nb::arg("device"));
  m.def("cuda_allocation", &cuda::allocation, nb::arg("ptr"), nb::arg("device") = -1,
        "(base, size, device, legacy_ipc_capable) of the device allocation holding ptr; `device` (-1: unknown) "
        "is the context made current for the queries.");
  m.def("cuda_ipc_export", [](uint64_t base, int device) { return nb::bytes(cuda::ipc_export(base, device).data(), 64); },
        nb::arg("base"), nb::arg("device"));
  m.def(
      "cuda_ipc_open",
      [](nb::bytes h, int device) {
        std::string handle(h.c_str(), h.size());  // read the Python object while the GIL is held
        nb::gil_scoped_release unlocked;
        return cuda::ipc_open(handle, device);
      },
      nb::arg("handle"), nb::arg("device"));
  m.def("cuda_ipc_close", &cuda::ipc_close, nb::arg("ptr"), nb::arg("device"), nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_stream_create", &cuda::stream_create, nb::arg("device"));
  m.def("cuda_stream_destroy", &cuda::stream_destroy, nb::arg("stream"), nb::arg("device"));
  m.def("cuda_stream_synchronize", &cuda::stream_synchronize, nb::arg("stream"), nb::arg("device"),
        nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_host_register", &cuda::host_register, nb::arg("ptr"), nb::arg("nbytes"), nb::arg("read_only"), nb::arg("device"),
        nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_host_unregister", &cuda::host_unregister, nb::arg("ptr"), nb::arg("device"),
        nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_module_load", [](nb::bytes image, int device) { return cuda::module_load(std::string(image.c_str(), image.size()), device); },
        nb::arg("image"), nb::arg("device"));
  m.def("cuda_module_function", &cuda::module_function, nb::arg("module"), nb::arg("name"), nb::arg("device"));
  m.def(
      "cuda_launch",
      [](uint64_t f, std::tuple<unsigned, unsigned, unsigned> grid, std::tuple<unsigned, unsigned, unsigned> block,
         unsigned shared, uint64_t stream, nb::bytes params, int device) {
        cuda::launch(f, grid, block, shared, stream, std::string(params.c_str(), params.size()), device);
      },
      nb::arg("function"), nb::arg("grid"), nb::arg("block"), nb::arg("shared_bytes"), nb::arg("stream"), nb::arg("params"),
      nb::arg("device"));
  // The CUDA copy engine (cuda_engine.h): copies enqueued on the calling thread, their ends
  // polled inline for a short budget or reaped by the engine's thread and announced on its
  // eventfd. `after`: (device, stream) pairs whose queued work the copies wait for.
  using Refs = std::vector<std::pair<int, uint64_t>>;
  auto refs = [](const Refs& after) {
    std::vector<cuda::StreamRef> out;
    out.reserve(after.size());
    for (const auto& [device, stream] : after) out.push_back({device, stream});
    return out;
  };
  auto result = [](const cuda::JobResult& r) {
    return nb::make_tuple(r.id, static_cast<int>(r.status), r.code, r.message);
  };
  nb::class_<cuda::Engine>(m, "CudaEngine")
      .def(nb::init<>())
      .def_prop_ro("event_fd", &cuda::Engine::event_fd)
      .def(
          "order",
          [refs](cuda::Engine& e, int device, uint64_t stream, const Refs& after, const std::vector<uint64_t>& events) {
            std::vector<cuda::StreamRef> a = refs(after);
            nb::gil_scoped_release unlocked;
            e.order(device, stream, a, events);
          },
          nb::arg("device"), nb::arg("stream"), nb::arg("after"), nb::arg("events"),
          "`stream` waits for the work queued so far on the `after` streams and for `events`.")
      .def(
          "submit",
          [refs, result](cuda::Engine& e, uint64_t id, int device, uint64_t stream, const Refs& after,
                         const std::vector<uint64_t>& events, nb::bytes packed, uint64_t spin_ns) -> nb::object {
            std::vector<Segment> v = unpack_triples<Segment>(packed);  // (dst, src, nbytes)
            static_assert(sizeof(Segment) == 3 * sizeof(uint64_t), "a Segment is a u64 triple");
            std::vector<cuda::StreamRef> a = refs(after);
            cuda::JobResult r;
            bool done;
            {
              nb::gil_scoped_release unlocked;
              done = e.submit(id, device, stream, a, events, reinterpret_cast<const uint64_t*>(v.data()), v.size(),
                              spin_ns, &r);
            }
            if (!done) return nb::none();
            return result(r);
          },
          nb::arg("id"), nb::arg("device"), nb::arg("stream"), nb::arg("after"), nb::arg("events"), nb::arg("packed"),
          nb::arg("spin_ns"),
          "Enqueues job `id` (the waits, every packed (dst, src, nbytes) copy, its event) and polls it for spin_ns: "
          "(id, status, code, message) when it ended by then (claimed), else None (drain reports it).")
      .def(
          "drain",
          [result](cuda::Engine& e) {
            std::vector<cuda::JobResult> done = e.drain();
            nb::list out;
            for (const auto& r : done) out.append(result(r));
            return out;
          },
          "(id, status, code, message) of every ended, unclaimed job since the last call.")
      .def("inflight", &cuda::Engine::inflight)
      .def("shutdown", &cuda::Engine::shutdown, nb::call_guard<nb::gil_scoped_release>());
  m.def("kernels_image", []() -> nb::object {
#ifdef TRANSPORT_HAVE_KERNELS
    return nb::bytes(reinterpret_cast<const char*>(kTransportKernelsImage), kTransportKernelsImageSize);
#else
    return nb::none();
#endif
  }, "The fatbin of csrc/kernels (None when the build had no nvcc).");
  m.def("kernels_arches", []() -> std::string {
#ifdef TRANSPORT_KERNELS_ARCHES
    return TRANSPORT_KERNELS_ARCHES;
#else
    return "";
#endif
  });
}

// -- ucx: the engine behind the `ucx` backend (compiled only when UCX headers were found) -----
void bind_ucx(nb::module_& m) {
#ifdef TRANSPORT_HAVE_UCX
  m.attr("ucx_compiled") = true;
  m.def(
      "ucx_load",
      [](const std::string& path) {
        const ucx::Api& api = ucx::load_api(path);
        return std::make_tuple(api.path, api.version());
      },
      nb::arg("path"), nb::call_guard<nb::gil_scoped_release>(),
      "dlopens libucp (once per process); returns (loaded path, version). Raises RuntimeError.");
  nb::class_<ucx::Engine>(m, "UcxEngine")
      .def(nb::init<const std::string&, const std::string&, int, uint64_t, int>(), nb::arg("library"), nb::arg("name"),
           nb::arg("lanes"), nb::arg("chunk_bytes"), nb::arg("window"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("event_fd", &ucx::Engine::event_fd)
      .def_prop_ro("lanes", &ucx::Engine::lanes)
      .def(
          "worker_address",
          [](ucx::Engine& e, int lane) {
            const std::string& a = e.worker_address(lane);
            return nb::bytes(a.data(), a.size());
          },
          nb::arg("lane"))
      .def(
          "mem_map",
          [](ucx::Engine& e, uint64_t address, uint64_t nbytes, bool remote_write, bool local_write) {
            std::string rkey;
            uint64_t id;
            {
              nb::gil_scoped_release release;
              id = e.mem_map(address, nbytes, remote_write, local_write, &rkey);
            }
            return std::make_tuple(id, nb::bytes(rkey.data(), rkey.size()));
          },
          nb::arg("address"), nb::arg("nbytes"), nb::arg("remote_write") = true, nb::arg("local_write") = true)
      .def("mem_unmap", &ucx::Engine::mem_unmap, nb::arg("mem"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "ep_create",
          [](ucx::Engine& e, int lane, nb::bytes address) {
            std::string a(address.c_str(), address.size());
            nb::gil_scoped_release release;
            return e.ep_create(lane, a);
          },
          nb::arg("lane"), nb::arg("address"))
      .def("ep_close", &ucx::Engine::ep_close, nb::arg("lane"), nb::arg("ep"), nb::arg("force"))
      .def(
          "rkey_unpack",
          [](ucx::Engine& e, int lane, uint64_t ep, nb::bytes packed) {
            std::string p(packed.c_str(), packed.size());
            nb::gil_scoped_release release;
            return e.rkey_unpack(lane, ep, p);
          },
          nb::arg("lane"), nb::arg("ep"), nb::arg("packed"))
      .def("rkey_destroy", &ucx::Engine::rkey_destroy, nb::arg("lane"), nb::arg("rkey"))
      .def(
          "submit",
          [](ucx::Engine& e, int lane, int op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote,
             uint64_t nbytes) {
            if (op < 0 || op > 1) throw std::invalid_argument("unknown ucx op");
            return e.submit(lane, static_cast<ucx::Op>(op), ep, rkey, local, remote, nbytes);
          },
          nb::arg("lane"), nb::arg("op"), nb::arg("ep"), nb::arg("rkey"), nb::arg("local"), nb::arg("remote"),
          nb::arg("nbytes"))
      .def(
          "submit_many",
          [](ucx::Engine& e, int lane, int op, uint64_t ep, uint64_t rkey, nb::bytes packed) {
            if (op < 0 || op > 1) throw std::invalid_argument("unknown ucx op");
            std::vector<ucx::Piece> pieces = unpack_triples<ucx::Piece>(packed);
            pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const ucx::Piece& p) { return p.len == 0; }),
                         pieces.end());
            return e.submit_many(lane, static_cast<ucx::Op>(op), ep, rkey, std::move(pieces));
          },
          nb::arg("lane"), nb::arg("op"), nb::arg("ep"), nb::arg("rkey"), nb::arg("packed"),
          "Queues many ranges of one region as one job (one completion, one flush); returns its id.")
      .def("cancel", &ucx::Engine::cancel, nb::arg("lane"), nb::arg("job"))
      .def(
          "read_word",
          [](ucx::Engine& e, int lane, uint64_t ep, uint64_t rkey, uint64_t remote, int timeout_ms) {
            uint64_t value = 0;
            int status;
            {
              nb::gil_scoped_release release;
              status = e.read_word(lane, ep, rkey, remote, timeout_ms, &value);
            }
            return std::make_tuple(status, value);
          },
          nb::arg("lane"), nb::arg("ep"), nb::arg("rkey"), nb::arg("remote"), nb::arg("timeout_ms"),
          "Reads an 8-byte remote word synchronously (bounded); returns (ucs status, value).")
      .def(
          "transfer_now",
          [](ucx::Engine& e, int lane, int op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote,
             uint64_t nbytes, int timeout_us) {
            if (op < 0 || op > 1) throw std::invalid_argument("unknown op");
            uint64_t moved = 0;
            int status;
            {
              nb::gil_scoped_release release;
              status = e.transfer_now(lane, static_cast<ucx::Op>(op), ep, rkey, local, remote, nbytes, timeout_us,
                                      &moved);
            }
            return std::make_tuple(status, moved);
          },
          nb::arg("lane"), nb::arg("op"), nb::arg("ep"), nb::arg("rkey"), nb::arg("local"), nb::arg("remote"),
          nb::arg("nbytes"), nb::arg("timeout_us"),
          "Moves bytes synchronously on the lane's thread; returns (ucs status, bytes moved) once the job ended.")
      .def(
          "transfer_now_pair",
          [](ucx::Engine& e, int op, std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t> first,
             std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t> second, int timeout_us) {
            if (op < 0 || op > 1) throw std::invalid_argument("unknown op");
            auto part = [](const auto& t) {
              auto [lane, ep, rkey, local, remote, nbytes] = t;
              return ucx::Engine::NowPart{lane, ep, rkey, local, remote, nbytes};
            };
            uint64_t moved = 0;
            int status;
            {
              nb::gil_scoped_release release;
              status = e.transfer_now_pair(static_cast<ucx::Op>(op), part(first), part(second), timeout_us, &moved);
            }
            return std::make_tuple(status, moved);
          },
          nb::arg("op"), nb::arg("first"), nb::arg("second"), nb::arg("timeout_us"),
          "Two parts (lane, ep, rkey, local, remote, nbytes) moved at once, the second by the engine's assistant "
          "thread; returns (ucs status, bytes moved) once both ended.")
      .def("drain",
           [](ucx::Engine& e) {
             std::vector<std::tuple<uint64_t, int, int, uint64_t>> out;
             for (const ucx::Completion& c : e.drain())
               out.emplace_back(c.id, static_cast<int>(c.status), c.ucs_status, c.bytes);
             return out;
           })
      .def("shutdown", &ucx::Engine::shutdown, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "ucx_status_string",
      [](int status) {
        const ucx::Api* api = ucx::loaded_api();
        return api != nullptr ? api->describe(static_cast<ucs_status_t>(status))
                              : "ucs status " + std::to_string(status);
      },
      nb::arg("status"));
#else
  m.attr("ucx_compiled") = false;
#endif
}

// -- tcp: the direct lane (single-range puts and gets served by native threads) --------------
void bind_tcp(nb::module_& m) {
  using namespace transport::tcp;
  nb::class_<RegionMirror>(m, "RegionMirror")
      .def(nb::init<>())
      .def("set", &RegionMirror::set, nb::arg("key"), nb::arg("address"), nb::arg("nbytes"), nb::arg("itemsize"),
           nb::arg("writable"), nb::arg("dtype"))
      .def("remove", &RegionMirror::remove, nb::arg("key"), nb::arg("token"),
           "Withdraws key; True when a request still moves its bytes (then `token` comes back from released()).")
      .def("mark_moved", &RegionMirror::mark_moved, nb::arg("key"))
      .def("released", &RegionMirror::released)
      .def("clear", &RegionMirror::clear)
      .def("__len__", &RegionMirror::size);
  nb::class_<DirectServer>(m, "DirectServer")
      .def(nb::init<std::shared_ptr<RegionMirror>, std::string, double, int>(), nb::arg("mirror"), nb::arg("owner"),
           nb::arg("io_timeout_s"), nb::arg("max_conns"))
      .def("adopt", &DirectServer::adopt, nb::arg("fd"), "Takes ownership of a connected socket; False: closed it.")
      .def_prop_ro("connections", &DirectServer::connections)
      .def_prop_ro("served", &DirectServer::served)
      .def("close", &DirectServer::close, nb::call_guard<nb::gil_scoped_release>());
  nb::class_<DirectLane>(m, "DirectLane")
      .def(nb::init<int>(), nb::arg("fd"))
      .def("start", &DirectLane::start, nb::arg("op"), nb::arg("key"), nb::arg("dtype"), nb::arg("offset"),
           nb::arg("nbytes"), nb::arg("local"), nb::arg("wait_s"), nb::call_guard<nb::gil_scoped_release>())
      .def("finish", &DirectLane::finish, nb::arg("wait_s"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("pending", &DirectLane::pending)
      .def_prop_ro("writing", &DirectLane::writing)
      .def_prop_ro("closed", &DirectLane::closed)
      .def_prop_ro("fd", &DirectLane::fd)
      .def_prop_ro("message", &DirectLane::message)
      .def("close", &DirectLane::close);
}

}  // namespace

// -- delta: diff + encode (publisher) and checked scatter (subscriber) of weight deltas -------
// Addresses and sizes only; the GIL is released for every call (they run on copy threads).
void bind_delta(nb::module_& m) {
  m.def(
      "delta_encode",
      [](uint64_t fresh, uint64_t base, uint64_t snap, uint64_t n, int es, uint64_t out, uint64_t cap, int isa,
         bool steps) {
        auto r = delta::encode(reinterpret_cast<const void*>(fresh), reinterpret_cast<const void*>(base),
                               reinterpret_cast<void*>(snap), n, es, reinterpret_cast<void*>(out), cap, isa, steps);
        return std::make_tuple(r.kind, r.changed, r.payload_bytes, r.pos_bytes, r.checksum, r.sum_old, r.sum_new);
      },
      nb::arg("fresh"), nb::arg("base"), nb::arg("snap"), nb::arg("n"), nb::arg("es"), nb::arg("out"),
      nb::arg("cap"), nb::arg("isa") = 0, nb::arg("steps") = false, nb::call_guard<nb::gil_scoped_release>(),
      "Copies fresh to snap, diffs it against base and encodes the changes at out (at most cap bytes; with "
      "steps, 2-byte values as steps where smaller); returns (kind, changed, payload_bytes, pos_bytes, checksum, "
      "sum_old, sum_new).");
  m.def(
      "delta_encode_many",
      [](uint64_t rows, uint64_t count, uint64_t results, uint64_t next, uint64_t budget, uint64_t taken, int isa) {
        return delta::encode_many(reinterpret_cast<const uint64_t*>(rows), count, reinterpret_cast<uint64_t*>(results),
                                  reinterpret_cast<uint64_t*>(next), budget, reinterpret_cast<uint64_t*>(taken), isa);
      },
      nb::arg("rows"), nb::arg("count"), nb::arg("results"), nb::arg("next"), nb::arg("budget"), nb::arg("taken"),
      nb::arg("isa") = 0, nb::call_guard<nb::gil_scoped_release>(),
      "delta_encode of the rows this call claims (see delta.h: encode_many); returns how many it claimed.");
  m.def(
      "delta_sample_changed",
      [](uint64_t fresh, uint64_t base, uint64_t n, int es, uint64_t runs, uint64_t run, int isa) {
        return delta::sample_changed(reinterpret_cast<const void*>(fresh), reinterpret_cast<const void*>(base), n,
                                     es, runs, run, isa);
      },
      nb::arg("fresh"), nb::arg("base"), nb::arg("n"), nb::arg("es"), nb::arg("runs"), nb::arg("run"),
      nb::arg("isa") = 0, nb::call_guard<nb::gil_scoped_release>(),
      "Elements that differ in runs ranges of run elements spread evenly over n.");
  m.def(
      "delta_reserve_scratch", [](uint64_t count, uint64_t n) { delta::reserve_scratch(count, n); },
      nb::arg("count"), nb::arg("n"), nb::call_guard<nb::gil_scoped_release>(),
      "Readies count scratch buffers of the diffs for tensors of up to n elements (see delta.h).");
  m.def(
      "delta_sample_changed_many",
      [](uint64_t rows, uint64_t count, uint64_t changed, int isa) {
        delta::sample_changed_many(reinterpret_cast<const uint64_t*>(rows), count,
                                   reinterpret_cast<uint64_t*>(changed), isa);
      },
      nb::arg("rows"), nb::arg("count"), nb::arg("changed"), nb::arg("isa") = 0,
      nb::call_guard<nb::gil_scoped_release>(),
      "delta_sample_changed of count rows (fresh, base, n, es, runs, run) of uint64 into changed[count].");
  m.def(
      "delta_checksum",
      [](uint64_t p, uint64_t n, int es, uint64_t first, uint64_t dst, int isa) {
        return delta::checksum(reinterpret_cast<const void*>(p), n, es, first, reinterpret_cast<void*>(dst), isa);
      },
      nb::arg("p"), nb::arg("n"), nb::arg("es"), nb::arg("first") = 0, nb::arg("dst") = 0, nb::arg("isa") = 0,
      nb::call_guard<nb::gil_scoped_release>(), "The checksum of n elements (copied to dst when not 0).");
  m.def(
      "delta_scatter",
      [](uint64_t live, uint64_t n, int es, uint64_t payload, uint64_t payload_len, uint32_t kind, uint64_t count,
         uint64_t pos_bytes, bool write) {
        auto r = delta::scatter(reinterpret_cast<void*>(live), n, es, reinterpret_cast<const void*>(payload),
                                payload_len, kind, count, pos_bytes, write);
        return std::make_tuple(r.refusal, r.sum_old, r.sum_new);
      },
      nb::arg("live"), nb::arg("n"), nb::arg("es"), nb::arg("payload"), nb::arg("payload_len"), nb::arg("kind"),
      nb::arg("count"), nb::arg("pos_bytes"), nb::arg("write"), nb::call_guard<nb::gil_scoped_release>(),
      "Checks an encoded delta against a live tensor of n elements (and, with write, stores it); returns "
      "(refusal, sum_old, sum_new).");
  m.def(
      "delta_apply",
      [](uint64_t live, uint64_t n, int es, uint64_t payload, uint64_t payload_len, uint32_t kind, uint64_t count,
         uint64_t pos_bytes, uint64_t pos, uint64_t undo, int isa) {
        auto r = delta::apply(reinterpret_cast<void*>(live), n, es, reinterpret_cast<const void*>(payload),
                              payload_len, kind, count, pos_bytes, reinterpret_cast<const void*>(pos),
                              reinterpret_cast<void*>(undo), isa);
        return std::make_tuple(r.refusal, r.sum_old, r.sum_new, r.stored);
      },
      nb::arg("live"), nb::arg("n"), nb::arg("es"), nb::arg("payload"), nb::arg("payload_len"), nb::arg("kind"),
      nb::arg("count"), nb::arg("pos_bytes"), nb::arg("pos"), nb::arg("undo"), nb::arg("isa") = 0,
      nb::call_guard<nb::gil_scoped_release>(),
      "The one-pass checked apply of an encoded delta; returns (refusal, sum_old, sum_new, stored).");
  m.def(
      "delta_apply_many",
      [](uint64_t rows, uint64_t count, uint64_t results, uint64_t next, uint64_t taken, int isa) {
        return delta::apply_many(reinterpret_cast<const uint64_t*>(rows), count, reinterpret_cast<uint64_t*>(results),
                                 reinterpret_cast<uint64_t*>(next), reinterpret_cast<uint64_t*>(taken), isa);
      },
      nb::arg("rows"), nb::arg("count"), nb::arg("results"), nb::arg("next"), nb::arg("taken"), nb::arg("isa") = 0,
      nb::call_guard<nb::gil_scoped_release>(),
      "delta_apply of the rows this call claims (see delta.h: apply_many); returns how many it claimed.");
  m.def(
      "delta_undo",
      [](uint64_t live, uint64_t n, int es, uint32_t kind, uint64_t pos, uint64_t pos_bytes, uint64_t stored,
         uint64_t saved) {
        delta::undo(reinterpret_cast<void*>(live), n, es, kind, reinterpret_cast<const void*>(pos), pos_bytes,
                    stored, reinterpret_cast<const void*>(saved));
      },
      nb::arg("live"), nb::arg("n"), nb::arg("es"), nb::arg("kind"), nb::arg("pos"), nb::arg("pos_bytes"),
      nb::arg("stored"), nb::arg("saved"), nb::call_guard<nb::gil_scoped_release>(),
      "Restores the live values delta_apply saved.");
  m.def(
      "delta_diff_in_place",
      [](uint64_t fresh, uint64_t snap, uint64_t n, int es, uint64_t offset, uint64_t positions, uint64_t old,
         uint64_t cap, int isa) {
        return delta::diff_in_place(reinterpret_cast<const void*>(fresh), reinterpret_cast<void*>(snap), n, es,
                                    offset, reinterpret_cast<uint64_t*>(positions), reinterpret_cast<void*>(old), cap,
                                    isa);
      },
      nb::arg("fresh"), nb::arg("snap"), nb::arg("n"), nb::arg("es"), nb::arg("offset"), nb::arg("positions"),
      nb::arg("old"), nb::arg("cap"), nb::arg("isa") = 0, nb::call_guard<nb::gil_scoped_release>(),
      "Diffs fresh against snap, records up to cap changed byte offsets and old values, copies fresh into snap; "
      "returns how many changed.");
  m.def(
      "delta_diff_bf16_in_place",
      [](uint64_t fresh, uint64_t snap, uint64_t n, uint64_t offset, uint64_t positions, uint64_t old, uint64_t cap,
         int isa) {
        return delta::diff_bf16_in_place(reinterpret_cast<const void*>(fresh), reinterpret_cast<void*>(snap), n,
                                         offset, reinterpret_cast<uint64_t*>(positions), reinterpret_cast<void*>(old),
                                         cap, isa);
      },
      nb::arg("fresh"), nb::arg("snap"), nb::arg("n"), nb::arg("offset"), nb::arg("positions"), nb::arg("old"),
      nb::arg("cap"), nb::arg("isa") = 0, nb::call_guard<nb::gil_scoped_release>(),
      "diff_in_place of fp32 fresh against its bf16 cast at snap; returns how many changed.");
  m.def(
      "delta_cut_runs",
      [](uint64_t units, uint64_t old_vals, uint64_t new_vals, uint64_t count, uint64_t runs, uint64_t nruns,
         uint64_t out_units, uint64_t out_old, uint64_t out_new) {
        return delta::cut_runs(reinterpret_cast<const uint64_t*>(units), reinterpret_cast<const uint16_t*>(old_vals),
                               reinterpret_cast<const uint16_t*>(new_vals), count,
                               reinterpret_cast<const int64_t*>(runs), nruns, reinterpret_cast<uint64_t*>(out_units),
                               reinterpret_cast<uint16_t*>(out_old), reinterpret_cast<uint16_t*>(out_new));
      },
      nb::arg("units"), nb::arg("old_vals"), nb::arg("new_vals"), nb::arg("count"), nb::arg("runs"),
      nb::arg("nruns"), nb::arg("out_units"), nb::arg("out_old"), nb::arg("out_new"),
      nb::call_guard<nb::gil_scoped_release>(), "The changes that fall in runs, at slot positions.");
  m.def(
      "delta_encode_positions",
      [](uint64_t positions, uint64_t count, uint64_t out, uint64_t cap) {
        return delta::encode_positions(reinterpret_cast<const uint64_t*>(positions), count,
                                       reinterpret_cast<void*>(out), cap);
      },
      nb::arg("positions"), nb::arg("count"), nb::arg("out"), nb::arg("cap"),
      nb::call_guard<nb::gil_scoped_release>(), "LEB128 gaps of increasing positions; bytes written or 2**64-1.");
  m.def(
      "delta_terms",
      [](uint64_t values, uint64_t positions, uint64_t count, int es) {
        return delta::terms(reinterpret_cast<const void*>(values), reinterpret_cast<const uint64_t*>(positions),
                            count, es);
      },
      nb::arg("values"), nb::arg("positions"), nb::arg("count"), nb::arg("es"),
      nb::call_guard<nb::gil_scoped_release>(), "The checksum terms of values at positions.");
  m.def(
      "delta_checksum_runs",
      [](uint64_t base, uint64_t runs, uint64_t count, int addr_col, int pos_col, int isa) {
        return delta::checksum_runs(reinterpret_cast<const void*>(base), reinterpret_cast<const int64_t*>(runs),
                                    count, addr_col, pos_col, isa);
      },
      nb::arg("base"), nb::arg("runs"), nb::arg("count"), nb::arg("addr_col"), nb::arg("pos_col"),
      nb::arg("isa") = 0, nb::call_guard<nb::gil_scoped_release>(), "The checksum of the bytes of byte runs.");
  m.def("delta_best_isa", &delta::best_isa);
  m.def("delta_supports", &delta::supports, nb::arg("isa"));
}

NB_MODULE(_C, m) {
  m.doc() = "Native core of transport: copy engine, shareable host memory, CMA, UCX engine.";
  // Tensors over SharedBuffers may legitimately outlive the interpreter's teardown.
  nb::set_leak_warnings(false);

  nb::class_<CopyPlan>(m, "CopyPlan")
      .def_prop_ro("kind", [](const CopyPlan& p) { return static_cast<int>(p.kind); })
      .def_prop_ro("pid", [](const CopyPlan& p) { return p.pid; })
      .def_prop_ro("segments", [](const CopyPlan& p) { return p.segs.size(); })
      .def_prop_ro("units", [](const CopyPlan& p) { return p.units.size(); })
      .def_prop_ro("nbytes", [](const CopyPlan& p) { return p.total; });

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
      .def(
          "submit_packed",
          [](CopyEngine& e, int kind, int pid, nb::bytes packed) {
            if (kind < 0 || kind > 2) throw std::invalid_argument("unknown copy kind");
            return e.submit(static_cast<CopyKind>(kind), pid, unpack_triples<Segment>(packed));
          },
          nb::arg("kind"), nb::arg("pid"), nb::arg("packed"))
      .def(
          "plan_packed",
          [](const CopyEngine& e, int kind, int pid, nb::bytes packed) {
            if (kind < 0 || kind > 2) throw std::invalid_argument("unknown copy kind");
            std::vector<Segment> v = unpack_triples<Segment>(packed);
            nb::gil_scoped_release unlocked;
            return std::const_pointer_cast<CopyPlan>(e.plan(static_cast<CopyKind>(kind), pid, v.data(), v.size()));
          },
          nb::arg("kind"), nb::arg("pid"), nb::arg("packed"))
      .def(
          "submit_plan",
          [](CopyEngine& e, std::shared_ptr<CopyPlan> plan) {
            if (!plan) throw std::invalid_argument("no plan");
            return e.submit(std::shared_ptr<const CopyPlan>(std::move(plan)));
          },
          nb::arg("plan"))
      .def_prop_ro("threads", &CopyEngine::threads)
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
      .def(nb::init<size_t, const std::string&, bool>(), nb::arg("nbytes"), nb::arg("name"),
           nb::arg("read_only") = false, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("address", &SharedBuffer::address)
      .def_prop_ro("nbytes", &SharedBuffer::nbytes)
      .def_prop_ro("fd", &SharedBuffer::fd)
      .def_prop_ro("inode", &SharedBuffer::inode)
      .def_prop_ro("sealed", &SharedBuffer::sealed)
      .def("seal_writes", &SharedBuffer::seal_writes,
           "Seals the memfd against new writable mappings and writes (F_SEAL_FUTURE_WRITE); returns 0 or errno.")
      .def("read_only_address", &SharedBuffer::read_only_address, nb::call_guard<nb::gil_scoped_release>(),
           "The address of a PROT_READ mapping of the same memfd (made on first call). Raises RuntimeError.")
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
      .def(nb::init<int, int, size_t, bool, uint64_t>(), nb::arg("pid"), nb::arg("fd"), nb::arg("nbytes"),
           nb::arg("writable"), nb::arg("inode") = 0)
      .def_prop_ro("address", &PeerMapping::address)
      .def_prop_ro("nbytes", &PeerMapping::nbytes)
      .def(
          "populate",
          [](const PeerMapping& self, nb::bytes packed, int column, bool write) {
            // Rows (dst, src, nbytes); `column` 0 or 1 names the side in this mapping.
            if (column != 0 && column != 1) throw std::invalid_argument("column must be 0 or 1");
            std::vector<Segment> v = unpack_triples<Segment>(packed);
            std::vector<uint64_t> ranges(2 * v.size());
            for (size_t i = 0; i < v.size(); ++i) {
              ranges[2 * i] = column == 0 ? v[i].dst : v[i].src;
              ranges[2 * i + 1] = v[i].len;
            }
            nb::gil_scoped_release unlocked;
            return self.populate(ranges.data(), v.size(), write);
          },
          nb::arg("packed"), nb::arg("column"), nb::arg("write"),
          "Fills this mapping's page tables for the pages of packed (dst, src, nbytes) rows' `column` side; "
          "returns 0 or errno (ERANGE: a row outside the mapping, nothing touched).");

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
      "copy_plan_now",
      [](const std::shared_ptr<CopyPlan>& plan) {
        if (!plan) throw std::invalid_argument("no plan");
        uint64_t copied = 0;
        int err;
        {
          nb::gil_scoped_release release;
          err = copy_segments(plan->kind, plan->pid, plan->segs.data(), plan->segs.size(), &copied);
          std::atomic_thread_fence(std::memory_order_seq_cst);
        }
        return std::make_tuple(err, copied);
      },
      nb::arg("plan"));
  m.def(
      "copy_packed_now",
      [](int kind, int pid, nb::bytes packed) {
        if (kind < 0 || kind > 2) throw std::invalid_argument("unknown copy kind");
        std::vector<Segment> v = unpack_triples<Segment>(packed);
        uint64_t copied = 0;
        int err;
        {
          nb::gil_scoped_release release;
          err = copy_segments(static_cast<CopyKind>(kind), pid, v.data(), v.size(), &copied);
          std::atomic_thread_fence(std::memory_order_seq_cst);
        }
        return std::make_tuple(err, copied);
      },
      nb::arg("kind"), nb::arg("pid"), nb::arg("packed"),
      "Copies packed (dst, src, nbytes) segments on the calling thread; returns (errno or 0, bytes copied).");
  m.def(
      "memory_fence", [] { std::atomic_thread_fence(std::memory_order_seq_cst); },
      "A full memory fence: orders a flag store before the next load of another process's flag.");
  m.def("cma_probe", &cma_probe, nb::arg("pid"), nb::arg("address"), nb::arg("nbytes"));
  m.def("probe_address", &probe_address);
  m.def("allow_ptrace_from_any", &allow_ptrace_from_any);
  m.def(
      "stream_copy",
      [](uint64_t dst, uint64_t src, uint64_t n) {
        stream_copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>(),
      "Copies with streaming (non-temporal) stores and a store fence; for large copies not read back soon.");
  m.def(
      "memcpy",
      [](uint64_t dst, uint64_t src, uint64_t n) {
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>(),
      "Plain single-threaded memcpy: the same-run baseline of the benchmarks.");

  bind_ucx(m);
  bind_cuda(m);
  bind_tcp(m);
  bind_delta(m);
}

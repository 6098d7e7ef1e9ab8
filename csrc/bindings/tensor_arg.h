// Tensor arguments of the kernel bindings: a borrowed DLPack view of the
// caller's tensor, valid for the duration of the call.
//
// A decode step calls the kernels ~300 times, so the import is on the hot
// path. Going through `tensor.__dlpack__()` (what nanobind's ndarray caster
// does) costs a Python-level call and a capsule per tensor, ~15 us each. Types
// that publish DLPack's C exchange API (`type(t).__dlpack_c_exchange_api__`,
// DLPack >= 1.2; torch has it) fill a DLTensor view in C with no Python call
// and no allocation. Anything else that speaks DLPack (older torch, numpy, ...)
// goes through nanobind's ndarray import, which also keeps it alive.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>

namespace cpuinfer::bind {

namespace nb = nanobind;

// The leading members of DLPack's DLPackExchangeAPI (dlpack.h >= 1.2), up to
// the one we call. Declared here because the kernels are built without any
// framework's headers; the layout is DLPack's stable ABI.
struct DLPackExchangeApiPrefix {
    struct {
        uint32_t major, minor;  // DLPackVersion
        void *prev_api;
    } header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, nb::dlpack::dltensor *out);
};

// The exchange API of a Python type, or nullptr. Looked up once per type (the
// kernels see one or two tensor types in a process).
inline const DLPackExchangeApiPrefix *exchange_api(PyTypeObject *type) {
    struct Entry {
        PyTypeObject *type;
        const DLPackExchangeApiPrefix *api;
    };
    static Entry cache[4] = {};
    for (const Entry &e : cache)
        if (e.type == type) return e.api;
    const DLPackExchangeApiPrefix *api = nullptr;
    PyObject *cap = PyObject_GetAttrString(reinterpret_cast<PyObject *>(type), "__dlpack_c_exchange_api__");
    if (cap && PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
        auto *a = static_cast<const DLPackExchangeApiPrefix *>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
        // A newer major version links the older tables it still serves.
        for (; a && !api; a = static_cast<const DLPackExchangeApiPrefix *>(a->header.prev_api))
            if (a->header.major == 1 && a->header.minor >= 2 && a->dltensor_from_py_object_no_sync) api = a;
    }
    Py_XDECREF(cap);
    PyErr_Clear();
    // The API table is static in its library and types live as long as the
    // process in practice; a type that dies early only costs a missed entry.
    for (Entry &e : cache) {
        if (!e.type) {
            e = {type, api};
            break;
        }
    }
    return api;
}

// ReadOnly: an input (the nanobind fallback then accepts read-only arrays).
template <bool ReadOnly>
class TensorArg {
  public:
    int32_t device_type() const { return t_.device.device_type; }
    nb::dlpack::dtype dtype() const { return t_.dtype; }
    size_t ndim() const { return size_t(t_.ndim); }
    size_t shape(size_t i) const { return size_t(t_.shape[i]); }
    int64_t stride(size_t i) const { return strides_[i]; }
    size_t itemsize() const { return (size_t(t_.dtype.bits) * t_.dtype.lanes + 7) / 8; }
    void *data() const { return static_cast<char *>(t_.data) + t_.byte_offset; }

    // Fills the view from a Python object; false (no Python error set) if it
    // is not a tensor.
    template <typename Flags>
    bool load(nb::handle src, Flags flags, nb::detail::cleanup_list *cleanup) noexcept {
        const DLPackExchangeApiPrefix *api = exchange_api(Py_TYPE(src.ptr()));
        if (api && api->dltensor_from_py_object_no_sync(src.ptr(), &t_) == 0) return finish();
        PyErr_Clear();  // e.g. a tensor that requires grad: the fallback reports it like any non-tensor
        nb::detail::make_caster<Fallback> caster;
        if (!caster.from_python(src, flags, cleanup)) return false;
        owner_ = std::move(caster.value);
        t_.data = const_cast<void *>(static_cast<const void *>(owner_.data()));  // byte_offset applied
        t_.byte_offset = 0;
        t_.device = {owner_.device_type(), owner_.device_id()};
        t_.ndim = int32_t(owner_.ndim());
        t_.dtype = owner_.dtype();
        t_.shape = const_cast<int64_t *>(owner_.shape_ptr());
        t_.strides = const_cast<int64_t *>(owner_.stride_ptr());
        return finish();
    }

  private:
    using Fallback = std::conditional_t<ReadOnly, nb::ndarray<nb::ro>, nb::ndarray<>>;
    static constexpr int kMaxDims = 8;

    bool finish() {
        if (t_.ndim < 0 || t_.ndim > kMaxDims) return false;
        // DLPack allows strides == NULL for a compact row-major tensor.
        int64_t s = 1;
        for (int i = t_.ndim - 1; i >= 0; --i) {
            strides_[i] = t_.strides ? t_.strides[i] : s;
            s *= t_.shape[i];
        }
        return true;
    }

    nb::dlpack::dltensor t_;
    int64_t strides_[kMaxDims] = {};
    Fallback owner_;
};

}  // namespace cpuinfer::bind

namespace nanobind::detail {
template <bool ReadOnly>
struct type_caster<cpuinfer::bind::TensorArg<ReadOnly>> {
    NB_TYPE_CASTER(cpuinfer::bind::TensorArg<ReadOnly>, const_name("torch.Tensor"))
    template <typename Flags>
    bool from_python(handle src, Flags flags, cleanup_list *cleanup) noexcept {
        return value.load(src, flags, cleanup);
    }
};
}  // namespace nanobind::detail

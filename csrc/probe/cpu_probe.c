/* CPU feature probe: what this CPU and OS can run, found without executing
 * any ISA-specific instruction beyond CPUID/XGETBV (x86) or asking the kernel
 * (hwcaps on Linux, sysctl on macOS).
 *
 * Compiled with baseline flags only. Built two ways from this one file:
 *   - the Python extension `cpuinfer._cpu_probe` (the dispatcher's input);
 *   - with CPUINFER_PROBE_MAIN, a program that CMake runs on the build host
 *     to decide which variants a local build includes.
 * Feature names match the "features" lists of cmake/isa_table.json. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_FEATURES 64
typedef struct {
    const char *names[MAX_FEATURES];
    int count;
} feature_list;

static void add(feature_list *f, int present, const char *name) {
    if (present && f->count < MAX_FEATURES) f->names[f->count++] = name;
}

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
static const char *probe_arch(void) { return "x86_64"; }

static uint64_t read_xcr0(void) {
    uint32_t lo, hi;
    /* xgetbv, spelled as bytes so that no -mxsave is needed */
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static void probe(feature_list *f) {
    unsigned a, b, c, d, max_leaf = __get_cpuid_max(0, NULL);
    if (max_leaf < 1) return;
    __cpuid(1, a, b, c, d);
    int osxsave = (c >> 27) & 1;
    add(f, (c >> 0) & 1, "sse3");
    add(f, (c >> 9) & 1, "ssse3");
    add(f, (c >> 12) & 1, "fma");
    add(f, (c >> 19) & 1, "sse4_1");
    add(f, (c >> 20) & 1, "sse4_2");
    add(f, (c >> 22) & 1, "movbe");
    add(f, (c >> 23) & 1, "popcnt");
    add(f, (c >> 26) & 1, "xsave");
    add(f, osxsave, "osxsave");
    add(f, (c >> 28) & 1, "avx");
    add(f, (c >> 29) & 1, "f16c");
    if (max_leaf >= 7) {
        unsigned eax1 = 0, t;
        __cpuid_count(7, 0, a, b, c, d);
        if (a >= 1) __cpuid_count(7, 1, eax1, t, t, t);
        add(f, (b >> 3) & 1, "bmi1");
        add(f, (b >> 5) & 1, "avx2");
        add(f, (b >> 8) & 1, "bmi2");
        add(f, (b >> 16) & 1, "avx512f");
        add(f, (b >> 17) & 1, "avx512dq");
        add(f, (b >> 28) & 1, "avx512cd");
        add(f, (b >> 30) & 1, "avx512bw");
        add(f, (b >> 31) & 1, "avx512vl");
        add(f, (c >> 1) & 1, "avx512_vbmi");
        add(f, (c >> 11) & 1, "avx512_vnni");
        add(f, (d >> 22) & 1, "amx_bf16");
        add(f, (d >> 23) & 1, "avx512_fp16");
        add(f, (d >> 24) & 1, "amx_tile");
        add(f, (d >> 25) & 1, "amx_int8");
        add(f, (eax1 >> 4) & 1, "avx_vnni");
        add(f, (eax1 >> 5) & 1, "avx512_bf16");
        add(f, (eax1 >> 21) & 1, "amx_fp16");
    }
    if (__get_cpuid_max(0x80000000, NULL) >= 0x80000001) {
        __cpuid(0x80000001, a, b, c, d);
        add(f, (c >> 5) & 1, "lzcnt");
    }
    if (osxsave) {
        /* The OS must save the wider registers, or using them corrupts state. */
        uint64_t xcr0 = read_xcr0();
        add(f, (xcr0 & 0x6) == 0x6, "os_ymm");
        add(f, (xcr0 & 0xe6) == 0xe6, "os_zmm");
        add(f, (xcr0 & 0x60000) == 0x60000, "os_amx");
    }
}

#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
static const char *probe_arch(void) { return "arm64-apple"; }

static int sysctl_flag(const char *name) {
    int value = 0;
    size_t size = sizeof(value);
    if (sysctlbyname(name, &value, &size, NULL, 0) != 0) return 0;
    return value != 0;
}

static void probe(feature_list *f) {
    add(f, sysctl_flag("hw.optional.AdvSIMD") || sysctl_flag("hw.optional.neon"), "asimd");
    add(f, sysctl_flag("hw.optional.arm.FEAT_DotProd"), "asimddp");
    int fp16 = sysctl_flag("hw.optional.arm.FEAT_FP16") || sysctl_flag("hw.optional.neon_fp16");
    add(f, fp16, "fphp");
    add(f, fp16, "asimdhp");
    add(f, sysctl_flag("hw.optional.arm.FEAT_FHM") || sysctl_flag("hw.optional.armv8_2_fhm"), "asimdfhm");
    add(f, sysctl_flag("hw.optional.arm.FEAT_BF16"), "bf16");
    add(f, sysctl_flag("hw.optional.arm.FEAT_I8MM"), "i8mm");
}

#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
static const char *probe_arch(void) { return "aarch64"; }

static void probe(feature_list *f) {
    unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    add(f, (hw >> 1) & 1, "asimd");
    add(f, (hw >> 9) & 1, "fphp");
    add(f, (hw >> 10) & 1, "asimdhp");
    add(f, (hw >> 20) & 1, "asimddp");
    add(f, (hw >> 23) & 1, "asimdfhm");
    int sve = (hw >> 22) & 1;
    add(f, sve, "sve");
    add(f, (hw2 >> 1) & 1, "sve2");
    add(f, (hw2 >> 13) & 1, "i8mm");
    add(f, (hw2 >> 14) & 1, "bf16");
    if (sve) {
        /* PR_SVE_GET_VL: vector length in bytes in the low 16 bits. 128-bit SVE
         * (e.g. Graviton4) gains nothing over NEON, so the dispatcher demotes it. */
        int vl = prctl(51, 0, 0, 0, 0);
        add(f, vl > 0 && (vl & 0xffff) > 16, "sve_wide");
    }
}

#elif defined(__s390x__) && defined(__linux__)
#include <sys/auxv.h>
static const char *probe_arch(void) { return "s390x"; }

static void probe(feature_list *f) {
    unsigned long hw = getauxval(AT_HWCAP);
    add(f, (hw >> 11) & 1, "vx");
    add(f, (hw >> 13) & 1, "vxe");
    add(f, (hw >> 15) & 1, "vxe2");
}

#else
static const char *probe_arch(void) { return "unknown"; }
static void probe(feature_list *f) { (void)f; }
#endif

#if defined(CPUINFER_PROBE_LIB)
/* For the C++ kernel test program (tests/cpp): ';'-separated feature names. */
const char *cpuinfer_probe_features(void) {
    static char buf[1024];
    feature_list f = {{0}, 0};
    probe(&f);
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0; i < f.count; ++i) {
        size_t len = strlen(f.names[i]);
        if (n + len + 2 >= sizeof(buf)) break;
        buf[n++] = ';';
        memcpy(buf + n, f.names[i], len + 1);
        n += len;
    }
    return buf;
}
const char *cpuinfer_probe_arch(void) { return probe_arch(); }
#elif defined(CPUINFER_PROBE_MAIN)
#include <stdio.h>
/* Prints "<arch>;<feature>;<feature>..." for CMake to split into a list. */
int main(void) {
    feature_list f = {{0}, 0};
    probe(&f);
    printf("%s", probe_arch());
    for (int i = 0; i < f.count; ++i) printf(";%s", f.names[i]);
    printf("\n");
    return 0;
}
#else
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *features(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    feature_list f = {{0}, 0};
    probe(&f);
    PyObject *list = PyList_New(f.count);
    if (!list) return NULL;
    for (int i = 0; i < f.count; ++i) {
        PyObject *s = PyUnicode_FromString(f.names[i]);
        if (!s) {
            Py_DECREF(list);
            return NULL;
        }
        if (PyList_SetItem(list, i, s) < 0) { /* steals s; the limited API has no PyList_SET_ITEM */
            Py_DECREF(list);
            return NULL;
        }
    }
    return Py_BuildValue("(sN)", probe_arch(), list);
}

static PyMethodDef methods[] = {
    {"features", features, METH_NOARGS, "Return (platform, [feature names]) for this CPU and OS."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_probe", "CPU feature probe.", -1, methods};

PyMODINIT_FUNC PyInit__cpu_probe(void) { return PyModule_Create(&module); }
#endif

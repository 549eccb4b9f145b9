/* Host-to-host copies with streaming (non-temporal) stores, for tiered_ckpt/memcopy.py.
 *
 * A snapshot's bytes are not read again soon after they are copied (a slot is drained from memory, a restored
 * tensor is next read by a training step), so writing them around the caches saves the read of every
 * destination line that an ordinary store makes first, and the eviction of the caller's working set.
 * glibc's memmove streams only above a threshold it derives from the last-level cache size (192 MiB on the
 * development VM, whose hypervisor reports a 256 MiB cache), while a copy here comes in pieces of a few MiB.
 * On x86-64 this copies with SSE2 streaming stores (part of the base instruction set: nothing to detect);
 * elsewhere it is memcpy. docs/architecture.md, "The data path of a save". */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

#if STREAMING
/* One cache line: four loads, then four streaming stores. ``d`` is 16-byte aligned. */
static inline void stream_line(char *d, const char *s)
{
    __m128i a = _mm_loadu_si128((const __m128i *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}

/* Line after line, the last partial line with memcpy. ``dst`` is 16-byte aligned. */
static void stream_lines(char *dst, const char *src, size_t n)
{
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        stream_line(dst + i, src + i);
    memcpy(dst + i, src + i, n - i);
}

#define PAGE 4096
#define PAGES 4 /* pages copied side by side */

/* Whole groups of PAGES destination pages, one cache line of each page in turn: several pages' streams in
 * flight at once keep more of the memory's parallelism busy than one long stream (about 15-20% faster than
 * stream_lines alone for a 1 GiB copy on two threads of the development VM; glibc's memmove copies its largest
 * sizes the same way). ``dst`` is page aligned. Returns the bytes copied. */
static size_t stream_pages(char *dst, const char *src, size_t n)
{
    size_t done = 0;
    for (; done + PAGES * PAGE <= n; done += PAGES * PAGE)
        for (size_t line = 0; line < PAGE; line += 64)
            for (size_t p = 0; p < PAGES; p++)
                stream_line(dst + done + p * PAGE + line, src + done + p * PAGE + line);
    return done;
}

/* The bytes from address ``p`` up to the next multiple of ``align`` (a power of two), at most ``n``. */
static size_t up_to(const char *p, size_t align, size_t n)
{
    size_t k = (align - ((uintptr_t)p & (align - 1))) & (align - 1);
    return k < n ? k : n;
}
#endif

static void stream_copy(char *dst, const char *src, size_t n)
{
#if STREAMING
    size_t head = up_to(dst, 16, n); /* streaming stores need 16-byte aligned targets */
    memcpy(dst, src, head);
    size_t to_page = up_to(dst + head, PAGE, n - head); /* then line by line up to a page boundary */
    stream_lines(dst + head, src + head, to_page);
    size_t at = head + to_page;
    size_t done = stream_pages(dst + at, src + at, n - at);
    stream_lines(dst + at + done, src + at + done, n - at - done);
    _mm_sfence(); /* the streamed stores are visible to other threads before the caller goes on */
#else
    memcpy(dst, src, n);
#endif
}

/* An address argument: an int in [0, 2**64), refused (OverflowError) outside it rather than wrapped around. */
static int address(PyObject *obj, void *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(uintptr_t *)out = (uintptr_t)value;
    return 1;
}

static PyObject *copy(PyObject *self, PyObject *args)
{
    uintptr_t dst, src;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&O&n:copy", address, &dst, address, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "copy: byte count %zd is negative", n);
        return NULL;
    }
    if (n > 0 && (dst == 0 || src == 0)) {
        PyErr_SetString(PyExc_ValueError, "copy: a null address");
        return NULL;
    }
    int overlap = dst < src + (size_t)n && src < dst + (size_t)n;
    Py_BEGIN_ALLOW_THREADS /* the copy threads of memcopy.py run at once */
    if (overlap) /* never a snapshot's case; memmove keeps it right whatever the size */
        memmove((char *)dst, (const char *)src, (size_t)n);
    else
        stream_copy((char *)dst, (const char *)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy_many(spans, stream_min): ``spans`` a buffer of unsigned 64-bit (dst, src, n) triples; each one copied as
 * ``copy`` would, those under ``stream_min`` bytes with memcpy (see memcopy.STREAM_MIN), all under one release of
 * the GIL: a snapshot of thousands of small tensors pays one call, not one per tensor. */
static PyObject *copy_many(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t stream_min;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n:copy_many", &view, &stream_min))
        return NULL;
    if (view.len % (Py_ssize_t)(3 * sizeof(uint64_t)) != 0) {
        PyErr_Format(PyExc_ValueError, "copy_many: %zd bytes of spans is not a whole number of (dst, src, n) "
                     "triples of 64-bit integers", view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint64_t *spans = (const uint64_t *)view.buf;
    Py_ssize_t count = view.len / (Py_ssize_t)(3 * sizeof(uint64_t));
    for (Py_ssize_t i = 0; i < count; i++) {
        if (spans[3 * i + 2] > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "copy_many: span %zd is %llu bytes long", i,
                         (unsigned long long)spans[3 * i + 2]);
            PyBuffer_Release(&view);
            return NULL;
        }
        if (spans[3 * i + 2] > 0 && (spans[3 * i] == 0 || spans[3 * i + 1] == 0)) {
            PyErr_Format(PyExc_ValueError, "copy_many: span %zd has a null address", i);
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        char *dst = (char *)(uintptr_t)spans[3 * i];
        const char *src = (const char *)(uintptr_t)spans[3 * i + 1];
        size_t n = (size_t)spans[3 * i + 2];
        int overlap = dst < src + n && src < dst + n;
        if (overlap)
            memmove(dst, src, n);
        else if (stream_min >= 0 && n >= (size_t)stream_min)
            stream_copy(dst, src, n);
        else
            memcpy(dst, src, n);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src, n): move n bytes from address src to address dst (host memory), with streaming stores "
     "where the CPU has them (overlapping ranges: memmove), without holding the GIL."},
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(spans, stream_min): copy each (dst, src, n) triple of the buffer spans (unsigned 64-bit "
     "integers), those of at least stream_min bytes (>= 0) as copy does, the others with memcpy, without holding "
     "the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy", "Host-memory copies with streaming stores (tiered_ckpt/memcopy.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

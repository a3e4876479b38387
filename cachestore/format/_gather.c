/* Verified batch gather for fixed-layout generations: one call per batch, without the GIL.
 *
 * gather_verified: rows of a memmap generation's columns into a batch, each checked against its
 * checksum; gather_records: the same for lmdb's wide records, one buffer each; row_checksums: the
 * checksums of rows already in memory (lmdb's column chunks); populate: map a generation's pages
 * into this process before its first batch (docs/ARCHITECTURE.md, "Verified reads"); pread_rows:
 * explicit reads of scattered rows of a generation larger than memory ("Larger than memory");
 * stat_digest: the data files' part of a dataset's fingerprint (loader/cache/files.py).
 *
 * Why compiled: the pure-Python gather (cachestore/backends/memmap_generation.py and
 * cachestore/backends/batch.py) makes ~500 calls into numpy
 * and xxhash for a 256-sample batch of 48 KiB records; each call is cheap, but together they cost a
 * third of the batch and serialise on the GIL, so two gather threads scale poorly. Here each row
 * is hashed from the store (which brings it into this core's cache) and copied from that cache to
 * the batch, so the data crosses the memory bus once, and the whole batch runs with the GIL released.
 *
 * Reading a mapping of a file that was truncated after it was mapped is a SIGBUS, which kills the
 * process: a store is a directory anyone with write access may change under a reader
 * (docs/ARCHITECTURE.md, "Untrusted stores"). So every loop over a mapping runs under a guard: a
 * SIGBUS handler (installed, ahead of any other, at each guarded call) that finds a guard set by
 * the faulting thread jumps back out of the loop, and the call reports the fault (gather_verified
 * -2, gather_records kind 3, row_checksums False) instead of the process dying. A SIGBUS with no
 * guard set goes on to the handler found before ours, or to the default action. The guard costs a
 * sigaction call and a sigsetjmp per call, nothing per row.
 *
 * The hash is the xxh3 of the `xxhash` package the checksums were written with: its extension
 * module exports the XXH3 functions, and we look them up there (dlsym) instead of carrying a second
 * copy of the hash. The module fails to import when they cannot be found; the loader then uses the
 * pure-Python gather, which computes the same checksums (docs/ARCHITECTURE.md, "Verified reads").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <signal.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef uint64_t (*xxh3_oneshot_fn)(const void *, size_t);
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(void *);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_fn)(const void *);

static xxh3_oneshot_fn xxh3_oneshot;
static xxh3_create_fn xxh3_create;
static xxh3_free_fn xxh3_free;
static xxh3_reset_fn xxh3_reset;
static xxh3_update_fn xxh3_update;
static xxh3_digest_fn xxh3_digest;

/* Records up to this many bytes are assembled in a stack buffer and hashed in one call: the
 * streaming state's reset and digest cost more than hashing a small record. */
#define SMALL_RECORD 4096
/* Copies at least this long use non-temporal stores: the batch (megabytes) is read by the
 * training step long after this core's cache has moved on, and plain stores would first read
 * each destination line from memory (a third more memory traffic than the copy itself). */
#define STREAM_MIN 4096
#define MAX_LEAVES 64

/* Copy n bytes; while it does, bring the next record's `ahead` bytes at `next` into this core's L2
 * (one line per 64 bytes copied): its read from memory then overlaps these stores, where the hash of
 * the next record would otherwise start every row waiting on memory (docs/ARCHITECTURE.md,
 * "Verified reads"). */
static void copy_out(uint8_t *dst, const uint8_t *src, size_t n, int stream, const uint8_t *next,
                     size_t ahead)
{
#if defined(__SSE2__)
    if (stream && n >= STREAM_MIN) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t fetched = 0;
        for (; n >= 64; n -= 64, src += 64, dst += 64) {
            if (fetched < ahead) {
                _mm_prefetch((const char *)next + fetched, _MM_HINT_T1);
                fetched += 64;
            }
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}


/* The guard (see the top of this file). guard_env is this thread's jump target while it reads a
 * mapping; guards counts the threads inside one, so a SIGBUS elsewhere never touches this module's
 * thread-local storage (whose first use in a thread may allocate: nothing a signal handler may do). */
static __thread sigjmp_buf *guard_env;
static int guards;
static struct sigaction previous_bus;

static volatile sig_atomic_t chaining, reentered;

static void set_bus_action(const struct sigaction *action)
{
    sigaction(SIGBUS, action, NULL);
}

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    if (__atomic_load_n(&guards, __ATOMIC_SEQ_CST) > 0 && guard_env != NULL) {
        sigjmp_buf *env = guard_env;
        guard_env = NULL;
        siglongjmp(*env, 1);
    }
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    if (chaining) {
        /* Back here from the handler we chained to (faulthandler, enabled after us, raises the
         * signal again to the handler it found, which is us): the default action ends it. */
        reentered = 1;
        set_bus_action(&dfl);
        return;
    }
    int is_function = (previous_bus.sa_flags & SA_SIGINFO) ? previous_bus.sa_sigaction != NULL
                      : (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN);
    if (!is_function) {
        /* The default action: returning re-runs the faulting access, which now kills the process
         * as it would have without us (an ignored SIGBUS from a fault would loop forever). */
        set_bus_action(&dfl);
        return;
    }
    chaining = 1;
    reentered = 0;
    if (previous_bus.sa_flags & SA_SIGINFO)
        previous_bus.sa_sigaction(sig, info, context);
    else
        previous_bus.sa_handler(sig);
    chaining = 0;
    /* It returned: it either made the access good (the re-run succeeds) or let it through, to
     * whatever it leaves installed; we step out of the way, unless it came back to us. */
    if (!reentered)
        set_bus_action(&previous_bus);
}

/* Put on_sigbus first in line for SIGBUS, keeping whatever handled it before for faults that are
 * not ours; called with the GIL held (so two threads never install at once) before each guarded
 * loop, since another library (faulthandler, torch's workers) may have installed its own since. */
static int ensure_guard(void)
{
    struct sigaction current, ours;
    if (sigaction(SIGBUS, NULL, &current) < 0)
        return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus)
        return 0;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    /* SA_NODEFER: SIGBUS stays unblocked in the handler, so the jump out (which restores no
     * signal mask, costing no system call) leaves the next fault catchable too. */
    ours.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    previous_bus = current;
    return sigaction(SIGBUS, &ours, NULL);
}

/* Enter and leave a guarded region (the caller's sigsetjmp is the target). */
#define GUARD_ENTER(env) (__atomic_add_fetch(&guards, 1, __ATOMIC_SEQ_CST), guard_env = &(env))
#define GUARD_LEAVE() (guard_env = NULL, __atomic_sub_fetch(&guards, 1, __ATOMIC_SEQ_CST))

/* Look a symbol up in the xxhash extension, preferring its CPU-dispatching variant. */
static void *lookup(void *lib, const char *name)
{
    char dispatch[64];
    snprintf(dispatch, sizeof dispatch, "%s_dispatch", name);
    void *fn = dlsym(lib, dispatch);
    return fn ? fn : dlsym(lib, name);
}

static int load_xxh3(void)
{
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL)
        return -1;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL)
        return -1;
    const char *path = PyUnicode_AsUTF8(file);
    /* RTLD_NOLOAD: the module is loaded already; this only takes a handle on it. */
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    Py_DECREF(file);
    if (lib == NULL) {
        PyErr_SetString(PyExc_ImportError, "cannot open the xxhash extension module");
        return -1;
    }
    xxh3_oneshot = (xxh3_oneshot_fn)lookup(lib, "XXH3_64bits");
    xxh3_update = (xxh3_update_fn)lookup(lib, "XXH3_64bits_update");
    xxh3_create = (xxh3_create_fn)dlsym(lib, "XXH3_createState");
    xxh3_free = (xxh3_free_fn)dlsym(lib, "XXH3_freeState");
    xxh3_reset = (xxh3_reset_fn)dlsym(lib, "XXH3_64bits_reset");
    xxh3_digest = (xxh3_digest_fn)dlsym(lib, "XXH3_64bits_digest");
    if (!xxh3_oneshot || !xxh3_update || !xxh3_create || !xxh3_free || !xxh3_reset || !xxh3_digest) {
        PyErr_SetString(PyExc_ImportError, "the xxhash extension module does not export the XXH3 functions");
        return -1;
    }
    return 0;
}

typedef struct {
    Py_buffer columns[MAX_LEAVES], outs[MAX_LEAVES], idx, expected;
    Py_ssize_t widths[MAX_LEAVES];
    int ncol, nout, have_idx, have_expected;
} Args;

static void release(Args *a)
{
    for (int k = 0; k < a->ncol; k++)
        PyBuffer_Release(&a->columns[k]);
    for (int k = 0; k < a->nout; k++)
        PyBuffer_Release(&a->outs[k]);
    if (a->have_idx)
        PyBuffer_Release(&a->idx);
    if (a->have_expected)
        PyBuffer_Release(&a->expected);
}

/* Whether `view` holds native 64-bit integers of one of the struct format codes `codes`. */
static int is_64bit(const Py_buffer *view, const char *codes)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && !PY_LITTLE_ENDIAN))
        f++;
    return view->itemsize == 8 && f[0] != '\0' && f[1] == '\0' && strchr(codes, f[0]) != NULL;
}

/* Leaf k's row width (an int >= 0) and column (a contiguous buffer) into `a`; on failure set an
 * exception and return -1 (the caller releases what was taken). */
static int take_column(Args *a, int k, PyObject *width, PyObject *column)
{
    a->widths[k] = PyLong_AsSsize_t(width);
    if (a->widths[k] < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "row widths are >= 0");
        return -1;
    }
    if (PyObject_GetBuffer(column, &a->columns[k], PyBUF_SIMPLE) < 0)
        return -1;
    a->ncol++;
    return 0;
}

/* Leaf k's out (writable, room for n rows of a->widths[k] bytes) into `a`; as take_column. */
static int take_out(Args *a, int k, PyObject *out, Py_ssize_t n)
{
    if (PyObject_GetBuffer(out, &a->outs[k], PyBUF_WRITABLE) < 0)
        return -1;
    a->nout++;
    if (a->outs[k].len < n * a->widths[k]) {
        PyErr_Format(PyExc_ValueError, "out leaf %d holds %zd bytes, the batch needs %zd", k, a->outs[k].len,
                     n * a->widths[k]);
        return -1;
    }
    return 0;
}

/* Fill `a` from the call's arguments; on failure set an exception and return -1 (the caller
 * releases what was taken). */
static int parse(Args *a, PyObject *columns, PyObject *widths, PyObject *idx, PyObject *outs,
                 PyObject *expected)
{
    if (!PyTuple_Check(columns) || !PyTuple_Check(widths) || !PyTuple_Check(outs)) {
        PyErr_SetString(PyExc_TypeError, "columns, widths and outs are tuples");
        return -1;
    }
    Py_ssize_t n_leaves = PyTuple_GET_SIZE(columns);
    if (n_leaves > MAX_LEAVES || PyTuple_GET_SIZE(widths) != n_leaves || PyTuple_GET_SIZE(outs) != n_leaves) {
        PyErr_Format(PyExc_ValueError, "columns, widths and outs must have one entry per leaf (at most %d)",
                     MAX_LEAVES);
        return -1;
    }
    if (PyObject_GetBuffer(idx, &a->idx, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    a->have_idx = 1;
    if (PyObject_GetBuffer(expected, &a->expected, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    a->have_expected = 1;
    Py_ssize_t n = a->idx.len / (Py_ssize_t)sizeof(int64_t);
    if (!is_64bit(&a->idx, "lq") || !is_64bit(&a->expected, "LQ")
        || a->expected.len != n * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "idx is a contiguous int64 array and expected a uint64 one, one per row");
        return -1;
    }
    const int64_t *rows = (const int64_t *)a->idx.buf;
    for (int k = 0; k < (int)n_leaves; k++) {
        if (take_column(a, k, PyTuple_GET_ITEM(widths, k), PyTuple_GET_ITEM(columns, k)) < 0
            || take_out(a, k, PyTuple_GET_ITEM(outs, k), n) < 0)
            return -1;
        Py_ssize_t w = a->widths[k];
        Py_ssize_t available = w ? a->columns[k].len / w : PY_SSIZE_T_MAX;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (rows[j] < 0 || rows[j] >= available) {
                PyErr_Format(PyExc_IndexError, "row %lld is outside column %d", (long long)rows[j], k);
                return -1;
            }
        }
    }
    return 0;
}

/* The xxh3 of one record whose leaves lie at src[k] (w[k] bytes each): the checksum of their
 * concatenation, which is how records are hashed when written. */
static uint64_t hash_record(const uint8_t *const *src, const Py_ssize_t *w, int n_leaves, size_t total,
                            void *state, unsigned char *small)
{
    if (n_leaves == 1)
        return xxh3_oneshot(src[0], total);
    if (total <= SMALL_RECORD) {
        size_t at = 0;
        for (int k = 0; k < n_leaves; k++) {
            memcpy(small + at, src[k], (size_t)w[k]);
            at += (size_t)w[k];
        }
        return xxh3_oneshot(small, total);
    }
    xxh3_reset(state);
    for (int k = 0; k < n_leaves; k++)
        xxh3_update(state, src[k], (size_t)w[k]);
    return xxh3_digest(state);
}

/* The xxh3 streaming state each_row needs for `a` (NULL when it needs none); 0, or -1 when out of
 * memory. Made before a guarded loop, so a jump out of the loop leaks nothing. */
static int row_state(const Args *a, void **state)
{
    size_t total = 0;
    for (int k = 0; k < a->ncol; k++)
        total += (size_t)a->widths[k];
    *state = NULL;
    if (a->ncol > 1 && total > SMALL_RECORD && (*state = xxh3_create()) == NULL)
        return -1;
    return 0;
}

/* Rows `rows` (or 0..n-1 when NULL) of the columns: each hashed into sums[j] when `sums` is set,
 * else checked against expected[j] and copied into the outs. Runs without the GIL, under the
 * guard (guarded_rows). Returns the position of the first row whose checksum differs (rows after
 * it are not gathered), n when all match. */
/* noinline (here and record_rows): a function that calls sigsetjmp is compiled with every local
 * kept in memory, and the loop inlined into guarded_rows ran a fifth slower. */
static __attribute__((noinline)) Py_ssize_t each_row(const Args *a, Py_ssize_t n, const int64_t *rows,
                                                     int stream, uint64_t *sums, void *state)
{
    int n_leaves = a->ncol;
    const uint64_t *expected = (const uint64_t *)a->expected.buf;
    size_t total = 0;
    for (int k = 0; k < n_leaves; k++)
        total += (size_t)a->widths[k];
    unsigned char small[SMALL_RECORD];
    const uint8_t *src[MAX_LEAVES];
    int wide = 0;
    for (int k = 1; k < n_leaves; k++)
        if (a->widths[k] > a->widths[wide])
            wide = k;
    Py_ssize_t j = 0;
    for (; j < n; j++) {
        size_t row = rows ? (size_t)rows[j] : (size_t)j;
        for (int k = 0; k < n_leaves; k++)
            src[k] = (const uint8_t *)a->columns[k].buf + row * (size_t)a->widths[k];
        /* Hashing first brings the record into this core's cache; the copy then reads it there. */
        uint64_t h = hash_record(src, a->widths, n_leaves, total, state, small);
        if (sums) {
            sums[j] = h;
            continue;
        }
        if (h != expected[j])
            break;
        /* The next row's widest leaf is fetched while this row's widest one is copied. */
        const uint8_t *next = NULL;
        if (j + 1 < n) {
            size_t nrow = rows ? (size_t)rows[j + 1] : (size_t)j + 1;
            next = (const uint8_t *)a->columns[wide].buf + nrow * (size_t)a->widths[wide];
        }
        for (int k = 0; k < n_leaves; k++)
            copy_out((uint8_t *)a->outs[k].buf + (size_t)j * (size_t)a->widths[k], src[k],
                     (size_t)a->widths[k], stream, next, k == wide && next ? (size_t)a->widths[wide] : 0);
    }
#if defined(__SSE2__)
    if (stream)
        _mm_sfence(); /* streamed stores are ordered before whatever this thread does next */
#endif
    return j;
}

/* each_row under the guard: -2 when a page of a column could not be read (SIGBUS: the file behind
 * the mapping is shorter than the mapping). */
static Py_ssize_t guarded_rows(const Args *a, Py_ssize_t n, const int64_t *rows, int stream,
                               uint64_t *sums, void *state)
{
    sigjmp_buf env;
    if (sigsetjmp(env, 0) != 0) {
        GUARD_LEAVE();
        return -2;
    }
    GUARD_ENTER(env);
    Py_ssize_t j = each_row(a, n, rows, stream, sums, state);
    GUARD_LEAVE();
    return j;
}

PyDoc_STRVAR(gather_verified_doc,
"gather_verified(columns, widths, idx, outs, expected, stream=True)\n--\n\n"
"Copy rows `idx` of each column into `outs`, checking each row's xxh3 against `expected`.\n\n"
"columns: one contiguous buffer per leaf, rows of widths[k] bytes; idx: int64 rows;\n"
"outs: one writable buffer per leaf, len(idx) rows; expected: uint64 checksums, one per row.\n"
"Returns the position of the first row whose checksum differs, -1 when all match, or -2 when a\n"
"page of a column could not be read (SIGBUS: its file was truncated after it was mapped).");

static PyObject *gather_verified(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"columns", "widths", "idx", "outs", "expected", "stream", NULL};
    PyObject *columns, *widths, *idx, *outs, *expected;
    int stream = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|p", names, &columns, &widths, &idx, &outs,
                                     &expected, &stream))
        return NULL;
    Args a;
    memset(&a, 0, sizeof a);
    if (parse(&a, columns, widths, idx, outs, expected) < 0) {
        release(&a);
        return NULL;
    }
    Py_ssize_t n = a.idx.len / (Py_ssize_t)sizeof(int64_t), bad;
    void *state;
    if (row_state(&a, &state) < 0) {
        release(&a);
        return PyErr_NoMemory();
    }
    if (ensure_guard() < 0) {
        if (state)
            xxh3_free(state);
        release(&a);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_BEGIN_ALLOW_THREADS
    bad = guarded_rows(&a, n, (const int64_t *)a.idx.buf, stream, NULL, state);
    Py_END_ALLOW_THREADS
    if (state)
        xxh3_free(state);
    release(&a);
    return PyLong_FromSsize_t(bad == n ? -1 : bad);
}

PyDoc_STRVAR(row_checksums_doc,
"row_checksums(columns, widths, n, sums)\n--\n\n"
"Write into `sums` (n uint64) the xxh3 of each row's leaves concatenated.\n\n"
"columns: one contiguous buffer per leaf, `n` rows of widths[k] bytes each. Returns True, or\n"
"False when a page of a column could not be read (SIGBUS: a mapped file truncated).");

static PyObject *row_checksums(PyObject *self, PyObject *args)
{
    PyObject *columns, *widths, *sums;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOnO", &columns, &widths, &n, &sums))
        return NULL;
    if (!PyTuple_Check(columns) || !PyTuple_Check(widths) || PyTuple_GET_SIZE(columns) != PyTuple_GET_SIZE(widths)
        || PyTuple_GET_SIZE(columns) > MAX_LEAVES || n < 0) {
        PyErr_Format(PyExc_ValueError, "columns and widths: tuples, one entry per leaf (at most %d)", MAX_LEAVES);
        return NULL;
    }
    Args a;
    memset(&a, 0, sizeof a);
    int n_leaves = (int)PyTuple_GET_SIZE(columns);
    for (int k = 0; k < n_leaves; k++) {
        if (take_column(&a, k, PyTuple_GET_ITEM(widths, k), PyTuple_GET_ITEM(columns, k)) < 0)
            goto fail;
        if (a.columns[k].len < n * a.widths[k]) {
            PyErr_Format(PyExc_ValueError, "column %d holds %zd bytes, %zd rows need %zd", k, a.columns[k].len,
                         n, n * a.widths[k]);
            goto fail;
        }
    }
    if (PyObject_GetBuffer(sums, &a.expected, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    a.have_expected = 1;
    if (!is_64bit(&a.expected, "LQ") || a.expected.len != n * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "sums is a contiguous uint64 array, one per row");
        goto fail;
    }
    Py_ssize_t done;
    void *state;
    if (row_state(&a, &state) < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    if (ensure_guard() < 0) {
        if (state)
            xxh3_free(state);
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    done = guarded_rows(&a, n, NULL, 0, (uint64_t *)a.expected.buf, state);
    Py_END_ALLOW_THREADS
    if (state)
        xxh3_free(state);
    release(&a);
    return PyBool_FromLong(done >= 0);
fail:
    release(&a);
    return NULL;
}

/* The records of a gather_records call (see there). */
typedef struct {
    const Py_buffer *views;
    Py_ssize_t start, stop, size, body;
    const Py_buffer *prefix;
    const Py_ssize_t *offsets;
    const Args *a;
    int verify, stream;
} Records;

/* Records r->start..r->stop-1 checked and copied, *at naming the one at hand: 0 when all are
 * copied, 1 when one is laid out otherwise, 2 when its checksum differs. Without the GIL. */
static __attribute__((noinline)) int record_rows(const Records *r, volatile Py_ssize_t *at)
{
    int kind = 0;
    Py_ssize_t j;
    for (j = r->start; j < r->stop; j++) {
        *at = j;
        const uint8_t *v = (const uint8_t *)r->views[j].buf;
        if (r->views[j].len != r->size || memcmp(v + r->body, r->prefix->buf, (size_t)r->prefix->len) != 0) {
            kind = 1;
            break;
        }
        if (r->verify) {
            uint64_t stored;
            memcpy(&stored, v, sizeof stored);
#if PY_BIG_ENDIAN
            stored = __builtin_bswap64(stored);
#endif
            /* Hashing first brings the record into this core's cache; the copies then read it there. */
            if (xxh3_oneshot(v + r->body, (size_t)(r->size - r->body)) != stored) {
                kind = 2;
                break;
            }
        }
        for (int k = 0; k < r->a->nout; k++)
            copy_out((uint8_t *)r->a->outs[k].buf + (size_t)j * (size_t)r->a->widths[k], v + r->offsets[k],
                     (size_t)r->a->widths[k], r->stream, NULL, 0);
    }
    *at = j;
#if defined(__SSE2__)
    if (r->stream)
        _mm_sfence();
#endif
    return kind;
}

/* record_rows under the guard: 3 when record *at could not be read (SIGBUS). */
static int guarded_records(const Records *r, volatile Py_ssize_t *at)
{
    sigjmp_buf env;
    if (sigsetjmp(env, 0) != 0) {
        GUARD_LEAVE();
        return 3;
    }
    GUARD_ENTER(env);
    int kind = record_rows(r, at);
    GUARD_LEAVE();
    return kind;
}

PyDoc_STRVAR(gather_records_doc,
"gather_records(values, start, size, body, prefix, spans, outs, verify, stream=True)\n--\n\n"
"Copy the leaves of records `values[start:]` (buffers) into `outs`, one row per record.\n\n"
"Each value must be `size` bytes and hold `prefix` at `body` (the layout of the batch's first\n"
"record); with `verify`, its first 8 bytes (little-endian) must be the xxh3 of value[body:].\n"
"spans: (offset in the value, bytes) per out. Returns (0, len(values)) when all are copied,\n"
"(1, j) when record j is None or laid out otherwise, (2, j) when its checksum differs, (3, j)\n"
"when it could not be read (SIGBUS: the file mapped behind it was truncated).");

static PyObject *gather_records(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"values", "start", "size", "body", "prefix", "spans", "outs", "verify", "stream", NULL};
    PyObject *values, *spans, *outs;
    Py_ssize_t start, size, body;
    Py_buffer prefix;
    int verify, stream = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onnny*OOp|p", names, &values, &start, &size, &body, &prefix,
                                     &spans, &outs, &verify, &stream))
        return NULL;
    Args a;
    memset(&a, 0, sizeof a);
    Py_buffer *views = NULL;
    Py_ssize_t offsets[MAX_LEAVES], taken = 0, n = 0, stop = 0;
    PyObject *result = NULL;
    if (!PyList_Check(values) || !PyTuple_Check(spans) || !PyTuple_Check(outs)
        || PyTuple_GET_SIZE(spans) != PyTuple_GET_SIZE(outs) || PyTuple_GET_SIZE(outs) > MAX_LEAVES) {
        PyErr_Format(PyExc_ValueError, "values is a list; spans and outs tuples, one entry per leaf (at most %d)",
                     MAX_LEAVES);
        goto done;
    }
    n = PyList_GET_SIZE(values);
    if (start < 0 || start > n || body < 8 || body + prefix.len > size) {
        PyErr_SetString(PyExc_ValueError, "start, body or prefix do not fit the records");
        goto done;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(outs); k++) {
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(spans, k), "nn", &offsets[k], &a.widths[k]))
            goto done;
        if (offsets[k] < 0 || a.widths[k] < 0 || offsets[k] + a.widths[k] > size) {
            PyErr_Format(PyExc_ValueError, "span %zd lies outside a record of %zd bytes", k, size);
            goto done;
        }
        if (take_out(&a, (int)k, PyTuple_GET_ITEM(outs, k), n) < 0)
            goto done;
    }
    /* The buffers are taken with the GIL held; the records are then read without it. */
    if ((views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (stop = start; stop < n; stop++) {
        PyObject *value = PyList_GET_ITEM(values, stop);
        if (value == Py_None)
            break;
        if (PyObject_GetBuffer(value, &views[stop], PyBUF_SIMPLE) < 0)
            goto done;
        taken = stop + 1;
    }
    Records r = {views, start, stop, size, body, &prefix, offsets, &a, verify, stream};
    volatile Py_ssize_t j = start;
    int kind;
    if (ensure_guard() < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    kind = guarded_records(&r, &j);
    if (kind == 0 && stop < n)
        kind = 1; /* a missing record */
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(in)", kind, (Py_ssize_t)j);
done:
    if (views != NULL) {
        for (Py_ssize_t i = start; i < taken; i++)
            PyBuffer_Release(&views[i]);
        PyMem_Free(views);
    }
    release(&a);
    PyBuffer_Release(&prefix);
    return result;
}

PyDoc_STRVAR(populate_doc,
"populate(buffer)\n--\n\n"
"Map every page of a file-backed `buffer` (an mmap) into this process now, the GIL released.\n\n"
"Returns False where the kernel cannot (MADV_POPULATE_READ is Linux 5.14 and later).");

static PyObject *populate(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int done = 0;
#ifdef MADV_POPULATE_READ
    if (view.len > 0) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t start = (uintptr_t)view.buf & ~(page - 1), end = (uintptr_t)view.buf + (uintptr_t)view.len;
        Py_BEGIN_ALLOW_THREADS
        done = madvise((void *)start, end - start, MADV_POPULATE_READ) == 0;
        Py_END_ALLOW_THREADS
    }
#endif
    PyBuffer_Release(&view);
    return PyBool_FromLong(done);
}

PyDoc_STRVAR(pread_rows_doc,
"pread_rows(fd, dest, width, rows, slots)\n--\n\n"
"Read rows `rows` (sorted file row numbers, int64) of `width` bytes from `fd` into rows `slots`\n"
"(int64) of the writable `dest` (n x width bytes), the GIL released: one preadv per run of\n"
"consecutive file rows (at most IOV_MAX rows), a short read finished row by row. `rows` and\n"
"`slots` are contiguous int64 arrays of one length; a row whose byte offset does not fit in\n"
"an int64 is a ValueError.\n\n"
"Returns 0, an errno, or -1 when the file ends before a row (truncated).");

/* Fill `len` bytes at `buf` from `offset` of `fd`: 0, an errno, or -1 at the end of the file. */
static int pread_full(int fd, char *buf, size_t len, off_t offset)
{
    while (len > 0) {
        ssize_t got = pread(fd, buf, len, offset);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (got == 0)
            return -1;
        buf += got;
        len -= (size_t)got;
        offset += got;
    }
    return 0;
}

static PyObject *pread_rows(PyObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t width;
    PyObject *rows_obj, *slots_obj;
    Py_buffer dest, rows, slots;
    if (!PyArg_ParseTuple(args, "iw*nOO", &fd, &dest, &width, &rows_obj, &slots_obj))
        return NULL;
    /* With their format: an int32 array (or bytes) read as int64 would be rows nobody asked for. */
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dest);
        return NULL;
    }
    if (PyObject_GetBuffer(slots_obj, &slots, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dest);
        PyBuffer_Release(&rows);
        return NULL;
    }
    int status = 0;
    Py_ssize_t m = rows.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t n = width > 0 ? dest.len / width : 0;
    if (!is_64bit(&rows, "lq") || !is_64bit(&slots, "lq")) {
        PyErr_SetString(PyExc_ValueError, "pread_rows: rows and slots are contiguous int64 arrays");
        goto done;
    }
    if (width <= 0 || slots.len != rows.len) {
        PyErr_SetString(PyExc_ValueError, "pread_rows: width must be > 0 and rows, slots of one length");
        goto done;
    }
    const int64_t *row = (const int64_t *)rows.buf, *slot = (const int64_t *)slots.buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (slot[i] < 0 || slot[i] >= n || row[i] < 0) {
            PyErr_SetString(PyExc_IndexError, "pread_rows: a row or slot is out of range");
            goto done;
        }
        /* row * width, and the offsets within a run after it, must fit in off_t (64-bit here):
         * an overflow is undefined, and in practice a read at some other offset. */
        if (row[i] > (INT64_MAX - width) / width) {
            PyErr_Format(PyExc_ValueError, "pread_rows: row %lld of %zd bytes lies beyond any file offset",
                         (long long)row[i], width);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov[IOV_MAX];
    Py_ssize_t a = 0;
    while (a < m && status == 0) {
        Py_ssize_t b = a + 1;
        while (b < m && b - a < IOV_MAX && row[b] == row[b - 1] + 1)
            b++;
        for (Py_ssize_t j = a; j < b; j++) {
            iov[j - a].iov_base = (char *)dest.buf + slot[j] * width;
            iov[j - a].iov_len = (size_t)width;
        }
        off_t offset = (off_t)row[a] * width;
        ssize_t got;
        do {
            got = preadv(fd, iov, (int)(b - a), offset);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            status = errno;
            break;
        }
        /* A short read: finish each row it did not fill. */
        for (Py_ssize_t j = a; j < b && status == 0; j++) {
            ssize_t before = (ssize_t)((j - a) * width), filled = got - before;
            if (filled < width) {
                filled = filled < 0 ? 0 : filled;
                status = pread_full(fd, (char *)iov[j - a].iov_base + filled, (size_t)(width - filled),
                                    offset + before + filled);
            }
        }
        a = b;
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&dest);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&slots);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(status);
}

/* stat_digest: the data files' part of a dataset's fingerprint (loader/cache/files.py), a stat per
 * path in `threads` threads without the GIL. The system call is a few microseconds, about what the
 * interpreter spends around each os.stat; threads holding the GIL ran slower than one, and forked
 * processes pay for the fork and the return. Each regular file adds the xxh3 of its encoded path
 * mixed with its size and modification time (the same sum the pure-Python loop computes). */
#define SIZE_MIX 0x9E3779B97F4A7C15ULL
#define TIME_MIX 0xC2B2AE3D27D4EB4FULL

typedef struct {
    const char **paths;
    const Py_ssize_t *lengths;
    Py_ssize_t start, stop, count;
    uint64_t total;
} StatPart;

static void *stat_part(void *arg)
{
    StatPart *part = arg;
    struct stat st;
    for (Py_ssize_t i = part->start; i < part->stop; i++) {
        const char *path = part->paths[i];
        /* A path with a NUL names no file (os.stat raises ValueError for it). */
        if (path == NULL || (Py_ssize_t)strlen(path) != part->lengths[i] || stat(path, &st) != 0
            || !S_ISREG(st.st_mode))
            continue;
        uint64_t mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000ULL + (uint64_t)st.st_mtim.tv_nsec;
        part->count++;
        part->total += xxh3_oneshot(path, (size_t)part->lengths[i]) ^ ((uint64_t)st.st_size * SIZE_MIX)
                       ^ (mtime_ns * TIME_MIX);
    }
    return NULL;
}

PyDoc_STRVAR(stat_digest_doc,
"stat_digest(paths, threads) -> (count, total)\n\n"
"How many of the strings in the list `paths` name regular files (links followed), and the sum mod\n"
"2**64 of xxh3(os.fsencode(path)) ^ size * 0x9E3779B97F4A7C15 ^ mtime_ns * 0xC2B2AE3D27D4EB4F over\n"
"them, statted in `threads` threads without the GIL.");

static PyObject *stat_digest(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *list;
    int threads;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &list, &threads))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    threads = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    if (n < threads * 1024)
        threads = 1;
    const char **paths = PyMem_Calloc((size_t)n + 1, sizeof *paths);
    Py_ssize_t *lengths = PyMem_Calloc((size_t)n + 1, sizeof *lengths);
    /* Paths that are not plain ASCII are encoded as os.fsencode would; the list keeps them alive. */
    PyObject *encoded = PyList_New(0);
    PyObject *result = NULL;
    if (paths == NULL || lengths == NULL || encoded == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyUnicode_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "stat_digest takes a list of str");
            goto done;
        }
        if (PyUnicode_IS_ASCII(item)) {
            paths[i] = (const char *)PyUnicode_DATA(item);
            lengths[i] = PyUnicode_GET_LENGTH(item);
            continue;
        }
        PyObject *raw = PyUnicode_EncodeFSDefault(item);
        if (raw == NULL) {  /* cannot be encoded: names no file, as os.stat would say */
            PyErr_Clear();
            continue;
        }
        int failed = PyList_Append(encoded, raw);
        Py_DECREF(raw);
        if (failed < 0)
            goto done;
        paths[i] = PyBytes_AS_STRING(raw);
        lengths[i] = PyBytes_GET_SIZE(raw);
    }
    StatPart parts[64];
    pthread_t ids[64];
    int started[64] = {0};
    Py_ssize_t step = (n + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        Py_ssize_t start = t * step < n ? t * step : n;
        parts[t] = (StatPart){paths, lengths, start, start + step < n ? start + step : n, 0, 0};
    }
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, stat_part, &parts[t]) == 0;
    stat_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else  /* no thread could be made (a limit): its part is statted here */
            stat_part(&parts[t]);
    }
    Py_END_ALLOW_THREADS
    Py_ssize_t count = 0;
    uint64_t total = 0;
    for (int t = 0; t < threads; t++) {
        count += parts[t].count;
        total += parts[t].total;
    }
    result = Py_BuildValue("nK", count, (unsigned long long)total);
done:
    PyMem_Free(paths);
    PyMem_Free(lengths);
    Py_XDECREF(encoded);
    return result;
}

static PyMethodDef methods[] = {
    {"populate", populate, METH_O, populate_doc},
    {"pread_rows", pread_rows, METH_VARARGS, pread_rows_doc},
    {"gather_records", (PyCFunction)(void (*)(void))gather_records, METH_VARARGS | METH_KEYWORDS,
     gather_records_doc},
    {"row_checksums", row_checksums, METH_VARARGS, row_checksums_doc},
    {"gather_verified", (PyCFunction)(void (*)(void))gather_verified, METH_VARARGS | METH_KEYWORDS,
     gather_verified_doc},
    {"stat_digest", stat_digest, METH_VARARGS, stat_digest_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachestore.format._gather",
    "Verified batch gather for fixed-layout generations, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__gather(void)
{
    if (load_xxh3() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    /* GUARDED: reads of a truncated mapping are reported, not a SIGBUS (cachestore/format/native.py
     * uses no build without it). */
    if (m != NULL && (PyModule_AddIntConstant(m, "MAX_LEAVES", MAX_LEAVES) < 0
                      || PyModule_AddIntConstant(m, "GUARDED", 1) < 0))
        Py_CLEAR(m);
    return m;
}

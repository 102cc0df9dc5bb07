/* kvstage._kvstage: the CPython extension over libkvstage's public API. One Python type per C
 * handle (Pool, InprocNet, Link, Registry, Sender, Receiver), each holding references to what its
 * handle needs alive (a pool its arrays, a sender its pool and link, a link its net), so the
 * C lifetimes follow Python's reference counts. Every call into a sender, receiver, link or
 * registry releases the GIL and holds the mutex of its link domain (an in-process net and all
 * its links share one; a net link or a registry has its own), because libkvstage objects are
 * single-threaded and a progress thread may drive them. Errors: the C call's status and the
 * error it logged on this thread become a kvstage.Error subclass (kvstage/__init__.py maps the
 * codes); progress calls never raise. Log messages go to Python's logging ("kvstage"). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <kvstage/clock.h>
#include <kvstage/inproc.h>
#include <kvstage/layout.h>
#include <kvstage/log.h>
#include <kvstage/net.h>
#include <kvstage/pd.h>
#include <kvstage/pool.h>
#include <kvstage/registry.h>
#include <kvstage/status.h>

/* ---- errors and logging ---- */

static PyObject *g_error_for; /* dict: status code -> exception class (set by __init__.py) */
static PyObject *g_logger;    /* logging.getLogger("kvstage") */
static _Thread_local char t_error[1024]; /* the last error libkvstage logged on this thread */
/* 1 while this thread is in a call whose errors become exceptions: they carry the message, so
 * it is logged at debug level only. Progress calls (whose errors are rooms') clear it. */
static _Thread_local int t_raising;

static int py_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* Any thread, GIL held or not: libkvstage logs from progress calls too. */
static void log_sink(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) arg, (void) file, (void) line;
    if (level == KVS_LOG_ERROR) snprintf(t_error, sizeof(t_error), "%s", msg);
    if (!Py_IsInitialized() || py_finalizing() || g_logger == NULL) {
        fprintf(stderr, "kvstage: %s\n", msg);
        return;
    }
    static const int py_level[] = {40, 30, 20, 10, 5}; /* logging.ERROR ... TRACE-ish */
    int py = level == KVS_LOG_ERROR && t_raising ? 10 : py_level[level];
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *type, *value, *tb; /* an exception being raised on this thread survives the log */
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethod(g_logger, "log", "is", py, msg);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    PyErr_Restore(type, value, tb);
    PyGILState_Release(gil);
}

/* Sets the exception for st (an error status), with the message libkvstage logged for it. */
static PyObject *raise_status(kvs_status_t st)
{
    const char *msg = t_error[0] != '\0' ? t_error : kvs_status_str(st);
    PyObject *key = PyLong_FromLong(st);
    PyObject *cls = key && g_error_for ? PyDict_GetItemWithError(g_error_for, key) : NULL;
    Py_XDECREF(key);
    if (cls == NULL) cls = PyExc_RuntimeError;
    PyObject *args = Py_BuildValue("(is)", (int) st, msg);
    if (args != NULL) {
        PyErr_SetObject(cls, args);
        Py_DECREF(args);
    }
    return NULL;
}

#define ERR_RESET() (t_error[0] = '\0', t_raising = 1)

/* An argument error found by the binding itself (before libkvstage sees the call). */
static PyObject *raise_invalid(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_error, sizeof(t_error), fmt, ap);
    va_end(ap);
    return raise_status(KVS_ERR_INVALID);
}

/* ---- locks: one per link domain ---- */

typedef struct {
    pthread_mutex_t mu;
} domain_t;

static domain_t *domain_new(void)
{
    domain_t *d = PyMem_RawMalloc(sizeof(*d));
    if (d == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    pthread_mutex_init(&d->mu, NULL);
    return d;
}

static void domain_free(domain_t *d)
{
    if (d == NULL) return;
    pthread_mutex_destroy(&d->mu);
    PyMem_RawFree(d);
}

/* Runs stmt without the GIL, holding the domain's mutex, with this thread's error cleared;
 * raising: whether errors it logs become the caller's exception (0 for progress calls). */
#define IN_DOMAIN_(dom, raising, stmt)                                                             \
    do {                                                                                           \
        Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&(dom)->mu);                                     \
        t_error[0] = '\0';                                                                         \
        t_raising = (raising);                                                                     \
        stmt;                                                                                      \
        pthread_mutex_unlock(&(dom)->mu);                                                          \
        Py_END_ALLOW_THREADS                                                                       \
    } while (0)
#define IN_DOMAIN(dom, stmt)          IN_DOMAIN_(dom, 1, stmt)
#define IN_DOMAIN_PROGRESS(dom, stmt) IN_DOMAIN_(dom, 0, stmt)

/* ---- progress threads ---- */

typedef struct {
    pthread_t thread;
    int running;
    atomic_int stop;
    domain_t *dom;
    uint32_t (*step)(void *arg); /* one progress call; returns work done */
    void *arg;
    uint64_t idle_ns; /* sleep after a call that did nothing */
} progress_thread_t;

static void *progress_main(void *arg)
{
    progress_thread_t *p = arg;
    while (!atomic_load(&p->stop)) {
        pthread_mutex_lock(&p->dom->mu);
        uint32_t work = p->step(p->arg);
        pthread_mutex_unlock(&p->dom->mu);
        if (work == 0 && p->idle_ns > 0) {
            struct timespec ts = {(time_t) (p->idle_ns / 1000000000u),
                                  (long) (p->idle_ns % 1000000000u)};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

static PyObject *progress_start(progress_thread_t *p, domain_t *dom, uint32_t (*step)(void *),
                                void *arg, double idle_s)
{
    if (p->running) return raise_status(KVS_ERR_STATE);
    if (!(idle_s >= 0 && idle_s <= 1))
        return raise_invalid("idle: %g s is out of range [0, 1]", idle_s);
    p->dom = dom, p->step = step, p->arg = arg;
    p->idle_ns = (uint64_t) (idle_s * 1e9);
    atomic_store(&p->stop, 0);
    if (pthread_create(&p->thread, NULL, progress_main, p) != 0) {
        PyErr_SetString(PyExc_OSError, "kvstage: cannot start the progress thread");
        return NULL;
    }
    p->running = 1;
    Py_RETURN_NONE;
}

static void progress_stop(progress_thread_t *p)
{
    if (!p->running) return;
    atomic_store(&p->stop, 1);
    Py_BEGIN_ALLOW_THREADS pthread_join(p->thread, NULL);
    Py_END_ALLOW_THREADS p->running = 0;
}

/* ---- argument conversion ---- */

static int to_u32(PyObject *o, uint32_t *out, const char *name)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (PyErr_Occurred() || v > UINT32_MAX) {
        PyErr_Clear();
        raise_invalid("%s: expected an integer in [0, %u]", name, UINT32_MAX);
        return 0;
    }
    *out = (uint32_t) v;
    return 1;
}

/* Seconds as nanoseconds, in [0, 86400] (positive if !zero_ok). */
static int to_ns(double seconds, const char *name, int zero_ok, uint64_t *out)
{
    if (!(seconds >= 0 && seconds <= 86400) || (!zero_ok && seconds == 0)) {
        raise_invalid("%s: %g s is out of range %s0, 86400]", name, seconds, zero_ok ? "[" : "(");
        return 0;
    }
    *out = (uint64_t) (seconds * 1e9);
    return 1;
}

/* shape: (layers, kv_heads, head_dim_k, head_dim_v, elem_bytes, attn) */
static int parse_shape(PyObject *t, kvs_kv_shape_t *s)
{
    uint32_t attn = 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 6) {
        PyErr_SetString(PyExc_TypeError, "shape: expected a 6-tuple");
        return 0;
    }
    memset(s, 0, sizeof(*s));
    if (!to_u32(PyTuple_GET_ITEM(t, 0), &s->layers, "layers") ||
        !to_u32(PyTuple_GET_ITEM(t, 1), &s->kv_heads, "kv_heads") ||
        !to_u32(PyTuple_GET_ITEM(t, 2), &s->head_dim_k, "head_dim_k") ||
        !to_u32(PyTuple_GET_ITEM(t, 3), &s->head_dim_v, "head_dim_v") ||
        !to_u32(PyTuple_GET_ITEM(t, 4), &s->elem_bytes, "elem_bytes") ||
        !to_u32(PyTuple_GET_ITEM(t, 5), &attn, "attn"))
        return 0;
    s->attn = (kvs_attn_t) attn;
    return 1;
}

/* geometry: (shape, prefill_tp, decode_tp, page_size, chunk_tokens, no_checksum) */
static int parse_geo(PyObject *t, kvs_pd_geometry_t *g)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 6) {
        PyErr_SetString(PyExc_TypeError, "layout: expected a 6-tuple");
        return 0;
    }
    memset(g, 0, sizeof(*g));
    return parse_shape(PyTuple_GET_ITEM(t, 0), &g->shape) &&
           to_u32(PyTuple_GET_ITEM(t, 1), &g->prefill_tp, "prefill_tp") &&
           to_u32(PyTuple_GET_ITEM(t, 2), &g->decode_tp, "decode_tp") &&
           to_u32(PyTuple_GET_ITEM(t, 3), &g->page_size, "page_size") &&
           to_u32(PyTuple_GET_ITEM(t, 4), &g->chunk_tokens, "chunk_tokens") &&
           to_u32(PyTuple_GET_ITEM(t, 5), &g->no_checksum, "no_checksum");
}

/* timeouts: dict of seconds by name (retry, bootstrap, transfer, waiting, completion,
 * release); missing names keep the library's defaults. */
static int parse_timeouts(PyObject *d, kvs_pd_timeouts_t *t)
{
    kvs_pd_timeouts_default(t);
    if (d == NULL || d == Py_None) return 1;
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "timeouts: expected a dict of seconds");
        return 0;
    }
    static const struct {
        const char *name;
        size_t off;
    } fields[] = {
        {"retry", offsetof(kvs_pd_timeouts_t, retry_ns)},
        {"bootstrap", offsetof(kvs_pd_timeouts_t, bootstrap_timeout_ns)},
        {"transfer", offsetof(kvs_pd_timeouts_t, transfer_timeout_ns)},
        {"waiting", offsetof(kvs_pd_timeouts_t, waiting_timeout_ns)},
        {"completion", offsetof(kvs_pd_timeouts_t, completion_timeout_ns)},
        {"release", offsetof(kvs_pd_timeouts_t, release_timeout_ns)},
    };
    Py_ssize_t pos = 0, known = 0;
    PyObject *key, *value;
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        PyObject *v = PyDict_GetItemString(d, fields[i].name);
        if (v == NULL) continue;
        known++;
        double s = PyFloat_AsDouble(v);
        if (PyErr_Occurred() || !(s > 0 && s <= 86400)) {
            PyErr_Clear();
            raise_invalid("timeouts[%s]: expected seconds in (0, 86400]", fields[i].name);
            return 0;
        }
        *(uint64_t *) ((char *) t + fields[i].off) = (uint64_t) (s * 1e9);
    }
    if (known != PyDict_Size(d)) {
        while (PyDict_Next(d, &pos, &key, &value)) {
            int found = 0;
            for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
                found |= PyUnicode_Check(key) &&
                         PyUnicode_CompareWithASCIIString(key, fields[i].name) == 0;
            if (!found) {
                PyObject *r = PyObject_Repr(key);
                raise_invalid("timeouts: unknown name %s (accepted: retry, bootstrap, transfer, "
                              "waiting, completion, release)",
                              r ? PyUnicode_AsUTF8(r) : "?");
                Py_XDECREF(r);
                return 0;
            }
        }
    }
    return 1;
}

/* ---- validation and the plan ---- */

static PyObject *py_validate_shape(PyObject *self, PyObject *arg)
{
    kvs_kv_shape_t s;
    if (!parse_shape(arg, &s)) return NULL;
    ERR_RESET();
    kvs_status_t st = kvs_kv_shape_validate(&s);
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_validate_geometry(PyObject *self, PyObject *arg)
{
    kvs_pd_geometry_t g;
    if (!parse_geo(arg, &g)) return NULL;
    ERR_RESET();
    kvs_status_t st = kvs_pd_geometry_validate(&g);
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_validate_tp(PyObject *self, PyObject *args)
{
    PyObject *shape;
    kvs_kv_shape_t s;
    kvs_tp_t tp;
    if (!PyArg_ParseTuple(args, "OII", &shape, &tp.tp_size, &tp.tp_rank) || !parse_shape(shape, &s))
        return NULL;
    ERR_RESET();
    kvs_status_t st = kvs_tp_validate(&s, &tp);
    if (st != KVS_OK) return raise_status(st);
    return Py_BuildValue("(III)", kvs_tp_heads_per_rank(&s, tp.tp_size),
                         kvs_tp_first_head(&s, tp.tp_size, tp.tp_rank),
                         kvs_tp_replication(&s, tp.tp_size));
}

static PyObject *writer_tuple(const kvs_writer_t *w)
{
    return Py_BuildValue("(IIIIK)", w->prefill_rank, w->src_head, w->dst_head, w->heads,
                         (unsigned long long) w->bytes_per_token);
}

static PyObject *ranks_list(const uint32_t *ranks, uint32_t n)
{
    PyObject *l = PyList_New(n);
    for (uint32_t i = 0; l && i < n; i++) PyList_SET_ITEM(l, i, PyLong_FromUnsignedLong(ranks[i]));
    return l;
}

/* plan(shape, prefill_tp, decode_tp, room, tokens) -> (writers per decode rank, slot offsets and
 * size per decode rank for `tokens`, destinations per prefill rank, peers per decode rank, decode
 * peers per prefill rank), all tuples and lists of ints. */
static PyObject *py_plan(PyObject *self, PyObject *args)
{
    PyObject *shape;
    kvs_kv_shape_t s;
    uint32_t ptp, dtp;
    unsigned long long room, tokens;
    if (!PyArg_ParseTuple(args, "OIIKK", &shape, &ptp, &dtp, &room, &tokens) ||
        !parse_shape(shape, &s))
        return NULL;
    if (ptp == 0 || ptp > KVS_MAX_TP || dtp == 0 || dtp > KVS_MAX_TP)
        return raise_invalid("prefill_tp (%u) and decode_tp (%u) must be in [1, %d]", ptp, dtp,
                             KVS_MAX_TP);
    PyObject *writers = PyList_New(0), *slots = PyList_New(0), *dests = PyList_New(0),
             *peers = PyList_New(0), *dpeers = PyList_New(0), *out = NULL;
    kvs_writer_t w[KVS_MAX_WRITERS];
    kvs_dest_t d[KVS_MAX_TP];
    uint32_t ranks[KVS_MAX_TP], n = 0;
    kvs_status_t st = KVS_OK;
    ERR_RESET();
    if (!writers || !slots || !dests || !peers || !dpeers) goto done;
    for (uint32_t r = 0; r < dtp; r++) {
        if ((st = kvs_plan_writers(&s, ptp, dtp, r, room, w, &n)) != KVS_OK) goto fail;
        PyObject *row = PyList_New(n);
        uint64_t offsets[KVS_MAX_WRITERS];
        uint64_t size = kvs_slot_layout(w, n, tokens, offsets);
        PyObject *offs = PyList_New(n);
        for (uint32_t i = 0; row && offs && i < n; i++) {
            PyList_SET_ITEM(row, i, writer_tuple(&w[i]));
            PyList_SET_ITEM(offs, i, PyLong_FromUnsignedLongLong(offsets[i]));
        }
        PyObject *slot = Py_BuildValue("(NK)", offs, (unsigned long long) size);
        if (row == NULL || slot == NULL || PyList_Append(writers, row) < 0 ||
            PyList_Append(slots, slot) < 0) {
            Py_XDECREF(row), Py_XDECREF(slot);
            goto done;
        }
        Py_DECREF(row), Py_DECREF(slot);
        if ((st = kvs_plan_peers(&s, ptp, dtp, r, ranks, &n)) != KVS_OK) goto fail;
        PyObject *l = ranks_list(ranks, n);
        if (l == NULL || PyList_Append(peers, l) < 0) goto done_l;
        Py_DECREF(l);
        continue;
    done_l:
        Py_XDECREF(l);
        goto done;
    }
    for (uint32_t p = 0; p < ptp; p++) {
        if ((st = kvs_plan_destinations(&s, ptp, dtp, p, room, d, &n)) != KVS_OK) goto fail;
        PyObject *row = PyList_New(n);
        for (uint32_t i = 0; row && i < n; i++)
            PyList_SET_ITEM(
                row, i,
                Py_BuildValue("(IIN)", d[i].decode_rank, d[i].writer, writer_tuple(&d[i].w)));
        if (row == NULL || PyList_Append(dests, row) < 0) {
            Py_XDECREF(row);
            goto done;
        }
        Py_DECREF(row);
        if ((st = kvs_plan_decode_peers(&s, ptp, dtp, p, ranks, &n)) != KVS_OK) goto fail;
        PyObject *l = ranks_list(ranks, n);
        if (l == NULL || PyList_Append(dpeers, l) < 0) {
            Py_XDECREF(l);
            goto done;
        }
        Py_DECREF(l);
    }
    out = Py_BuildValue("(OOOOO)", writers, slots, dests, peers, dpeers);
    goto done;
fail:
    raise_status(st);
done:
    Py_XDECREF(writers), Py_XDECREF(slots), Py_XDECREF(dests), Py_XDECREF(peers),
        Py_XDECREF(dpeers);
    return out;
}

/* ---- Pool ---- */

typedef struct {
    PyObject_HEAD kvs_pool_t *pool;
    Py_buffer *views; /* [nviews] buffer-protocol exports, held until dealloc */
    Py_ssize_t nviews;
    PyObject *owners;   /* the caller's arrays (a list), kept alive for the pool's life */
    PyObject *capsules; /* DLPack capsules taken from them (a list): their memory's owners */
} PoolObject;

/* The memory of one array-like: host through the buffer protocol or __array_interface__,
 * device through __cuda_array_interface__, either through DLPack. shape and strides in
 * elements and bytes. */
typedef struct {
    uint8_t *data;
    int ndim;
    Py_ssize_t shape[4], strides[4];
    Py_ssize_t itemsize;
    int device;    /* 1 for GPU memory */
    int device_id; /* its GPU when the object says (DLPack), else -1 */
} array_t;

/* DLPack's ABI (dlpack.h, v0.8 and later): what a "dltensor" capsule points to. */
typedef struct {
    int32_t device_type; /* 1 CPU, 2 CUDA, 3 CUDA host (pinned), 13 CUDA managed */
    int32_t device_id;
} dl_device_t;
typedef struct {
    void *data;
    dl_device_t device;
    int32_t ndim;
    struct {
        uint8_t code, bits;
        uint16_t lanes;
    } dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL: C order */
    uint64_t byte_offset;
} dl_tensor_t;
typedef struct dl_managed {
    dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed_t;

/* Reads obj.__dlpack__(). The capsule is kept unconsumed in *capsule_p: its destructor calls
 * the producer's deleter when the pool lets it go, which is the lifetime wanted. */
static int read_dlpack(PyObject *obj, const char *what, array_t *a, PyObject **capsule_p)
{
    PyObject *cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
    if (cap == NULL) {
        PyErr_Clear();
        raise_invalid("%s: __dlpack__() failed (a read-only array cannot be exported)", what);
        return 0;
    }
    dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m == NULL) {
        PyErr_Clear();
        Py_DECREF(cap);
        raise_invalid("%s: __dlpack__() did not return a fresh \"dltensor\" capsule", what);
        return 0;
    }
    const dl_tensor_t *t = &m->dl_tensor;
    int type = t->device.device_type;
    if (t->ndim != 4 || t->dtype.lanes != 1 || t->dtype.bits % 8 != 0 ||
        (type != 1 && type != 2 && type != 3 && type != 13)) {
        raise_invalid("%s: DLPack tensor of %d dimensions, %u-bit x %u lanes on device type %d; "
                      "expected 4 dimensions of plain elements on the CPU or a CUDA GPU",
                      what, (int) t->ndim, t->dtype.bits, t->dtype.lanes, type);
        Py_DECREF(cap);
        return 0;
    }
    a->data = (uint8_t *) t->data + t->byte_offset;
    a->ndim = 4;
    a->itemsize = t->dtype.bits / 8;
    a->device = type == 2 || type == 13;
    a->device_id = a->device ? t->device.device_id : -1;
    Py_ssize_t st = a->itemsize;
    for (int i = 3; i >= 0; i--) {
        a->shape[i] = (Py_ssize_t) t->shape[i];
        a->strides[i] = t->strides ? (Py_ssize_t) t->strides[i] * a->itemsize : st;
        st *= a->shape[i];
    }
    *capsule_p = cap;
    return 1;
}

static Py_ssize_t typestr_itemsize(PyObject *typestr)
{
    const char *t = PyUnicode_Check(typestr) ? PyUnicode_AsUTF8(typestr) : NULL;
    if (t == NULL || strlen(t) < 3) return -1;
    return strtol(t + 2, NULL, 10);
}

/* Reads a (__cuda_)array_interface__ dict: data, shape, strides (None: C order), typestr. */
static int read_interface(PyObject *iface, const char *what, array_t *a)
{
    PyObject *data = NULL, *shape = NULL, *strides = NULL, *typestr = NULL;
    if (PyDict_Check(iface)) {
        data = PyDict_GetItemString(iface, "data");
        shape = PyDict_GetItemString(iface, "shape");
        strides = PyDict_GetItemString(iface, "strides");
        typestr = PyDict_GetItemString(iface, "typestr");
    }
    if (data == NULL || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 || shape == NULL ||
        !PyTuple_Check(shape) || typestr == NULL ||
        (strides != NULL && strides != Py_None &&
         (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != PyTuple_GET_SIZE(shape)))) {
        raise_invalid("%s: malformed array interface (data, shape, strides, typestr)", what);
        return 0;
    }
    if (PyObject_IsTrue(PyTuple_GET_ITEM(data, 1))) {
        raise_invalid("%s: the array is read-only; a pool's memory must be writable", what);
        return 0;
    }
    a->data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
    a->ndim = (int) PyTuple_GET_SIZE(shape);
    a->itemsize = typestr_itemsize(typestr);
    if (a->ndim != 4 || a->itemsize <= 0) {
        raise_invalid("%s: expected a 4-dimensional array (got %d dimensions)", what, a->ndim);
        return 0;
    }
    for (int i = 0; i < 4; i++) a->shape[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
    if (strides != NULL && strides != Py_None) {
        for (int i = 0; i < 4; i++) a->strides[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
    } else {
        Py_ssize_t st = a->itemsize;
        for (int i = 3; i >= 0; i--) a->strides[i] = st, st *= a->shape[i];
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        raise_invalid("%s: malformed array interface (shape and strides must be integers)", what);
        return 0;
    }
    return 1;
}

/* Fills *a from obj; a buffer-protocol export goes into *view (view->obj set) and a DLPack
 * capsule into *capsule_p (else NULL), to hold. */
static int read_array(PyObject *obj, const char *what, array_t *a, Py_buffer *view,
                      PyObject **capsule_p)
{
    memset(a, 0, sizeof(*a));
    a->device_id = -1;
    view->obj = NULL;
    *capsule_p = NULL;
    PyObject *iface = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (iface != NULL) {
        a->device = 1;
        int ok = read_interface(iface, what, a);
        Py_DECREF(iface);
        return ok;
    }
    PyErr_Clear();
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            raise_invalid("%s: the buffer is not writable (or not strided); a pool's memory "
                          "must be writable",
                          what);
            return 0;
        }
        if (view->ndim != 4) {
            raise_invalid("%s: expected a 4-dimensional array (got %d dimensions)", what,
                          view->ndim);
            PyBuffer_Release(view);
            return 0;
        }
        a->data = view->buf;
        a->ndim = 4;
        a->itemsize = view->itemsize;
        for (int i = 0; i < 4; i++) a->shape[i] = view->shape[i], a->strides[i] = view->strides[i];
        return 1;
    }
    iface = PyObject_GetAttrString(obj, "__array_interface__");
    if (iface != NULL) {
        int ok = read_interface(iface, what, a);
        Py_DECREF(iface);
        return ok;
    }
    PyErr_Clear();
    if (PyObject_HasAttrString(obj, "__dlpack__")) return read_dlpack(obj, what, a, capsule_p);
    raise_invalid("%s: %s has neither the buffer protocol, __array_interface__, "
                  "__cuda_array_interface__ nor __dlpack__",
                  what, Py_TYPE(obj)->tp_name);
    return 0;
}

static void pool_clear_views(PoolObject *self)
{
    for (Py_ssize_t i = 0; i < self->nviews; i++)
        if (self->views[i].obj != NULL) PyBuffer_Release(&self->views[i]);
    PyMem_Free(self->views);
    self->views = NULL;
    self->nviews = 0;
}

/* Pool(shape, tp_size, tp_rank, page_size, arrays, hnd, device): arrays is the flat list
 * [layer 0 K, layer 0 V, layer 1 K, ...] (one per layer for MLA), each [pages][P][heads][dim]
 * (hnd=0) or [pages][heads][P][dim] (hnd=1) with any strides but a contiguous last axis. */
static int Pool_init(PoolObject *self, PyObject *args, PyObject *kw)
{
    PyObject *shape, *arrays;
    kvs_pool_config_t c;
    int hnd = 0, device = -1;
    memset(&c, 0, sizeof(c));
    if (!PyArg_ParseTuple(args, "OIIIO!pi", &shape, &c.tp.tp_size, &c.tp.tp_rank, &c.page_size,
                          &PyList_Type, &arrays, &hnd, &device) ||
        !parse_shape(shape, &c.shape))
        return -1;
    if (self->pool != NULL) {
        raise_status(KVS_ERR_STATE);
        return -1;
    }
    ERR_RESET();
    if (kvs_kv_shape_validate(&c.shape) != KVS_OK) {
        raise_status(KVS_ERR_INVALID);
        return -1;
    }
    uint32_t comps = kvs_kv_shape_components(&c.shape);
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    if (n != (Py_ssize_t) c.shape.layers * comps) {
        raise_invalid("pool: %zd arrays for %u layers x %u components (K%s)", n, c.shape.layers,
                      comps, comps == 2 ? " and V" : " latent");
        return -1;
    }
    c.layout = hnd ? KVS_POOL_HND : KVS_POOL_NHD;
    kvs_region_t *regions = PyMem_Calloc((size_t) n, sizeof(kvs_region_t));
    self->views = PyMem_Calloc((size_t) n, sizeof(Py_buffer));
    if (regions == NULL || self->views == NULL) {
        PyMem_Free(regions);
        PyErr_NoMemory();
        return -1;
    }
    self->nviews = n;
    int devices = 0, first_device = -1;
    Py_XSETREF(self->capsules, PyList_New(0));
    if (self->capsules == NULL) {
        PyMem_Free(regions);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char what[64];
        uint32_t layer = (uint32_t) (i / comps), comp = (uint32_t) (i % comps);
        snprintf(what, sizeof(what), "layer %u %s", layer,
                 comps == 1 ? "latent" : (comp == 0 ? "K" : "V"));
        array_t a;
        PyObject *capsule;
        if (!read_array(PyList_GET_ITEM(arrays, i), what, &a, &self->views[i], &capsule)) goto fail;
        if (capsule != NULL) {
            int r = PyList_Append(self->capsules, capsule);
            Py_DECREF(capsule);
            if (r < 0) goto fail;
        }
        if (i == 0) first_device = a.device_id;
        devices += a.device;
        int tok = hnd ? 2 : 1, head = hnd ? 1 : 2;
        if (i == 0) c.num_pages = (uint32_t) a.shape[0];
        if (a.shape[0] != (Py_ssize_t) c.num_pages || a.shape[tok] != (Py_ssize_t) c.page_size ||
            a.strides[3] != a.itemsize) {
            raise_invalid("%s: shape [%zd, %zd, %zd, %zd] strides [%zd, %zd, %zd, %zd] is not "
                          "%s [pages=%u][%s][%s][dim] with a contiguous last axis",
                          what, a.shape[0], a.shape[1], a.shape[2], a.shape[3], a.strides[0],
                          a.strides[1], a.strides[2], a.strides[3], hnd ? "HND" : "NHD",
                          c.num_pages, hnd ? "heads" : "page_size", hnd ? "page_size" : "heads");
            goto fail;
        }
        for (int d = 0; d < 4; d++)
            if (a.strides[d] < 0 || a.shape[d] <= 0 || a.shape[d] > UINT32_MAX) {
                raise_invalid("%s: empty axes and negative strides are not supported", what);
                goto fail;
            }
        regions[i].base = a.data;
        regions[i].page_stride = (uint64_t) a.strides[0];
        regions[i].token_stride = (uint64_t) a.strides[tok];
        regions[i].head_stride = (uint64_t) a.strides[head];
        regions[i].heads = (uint32_t) a.shape[head];
        regions[i].dim = (uint32_t) a.shape[3];
        regions[i].elem_bytes = (uint32_t) a.itemsize;
    }
    if (devices != 0 && devices != n) {
        raise_invalid("pool: %d of %zd arrays are on a GPU; all or none must be", devices, n);
        goto fail;
    }
    c.mem = devices ? KVS_MEM_DEVICE : KVS_MEM_HOST;
    c.device = !devices ? 0 : device >= 0 ? device : first_device >= 0 ? first_device : 0;
    ERR_RESET();
    kvs_status_t st = kvs_pool_wrap(&c, regions, &self->pool);
    if (st != KVS_OK) {
        raise_status(st);
        goto fail;
    }
    PyMem_Free(regions);
    Py_INCREF(arrays);
    self->owners = arrays;
    return 0;
fail:
    PyMem_Free(regions);
    pool_clear_views(self);
    Py_CLEAR(self->capsules);
    return -1;
}

static void Pool_dealloc(PoolObject *self)
{
    kvs_pool_destroy(self->pool);
    pool_clear_views(self);
    Py_XDECREF(self->capsules);
    Py_XDECREF(self->owners);
    Py_TYPE(self)->tp_free((PyObject *) self);
}

static int pool_ready(PoolObject *self)
{
    if (self->pool == NULL) {
        raise_invalid("pool: not initialised");
        return 0;
    }
    return 1;
}

static PyObject *Pool_alloc(PoolObject *self, PyObject *arg)
{
    uint32_t n;
    if (!pool_ready(self) || !to_u32(arg, &n, "n")) return NULL;
    /* n beyond the free pages fails in libkvstage before it writes: no buffer for them */
    uint32_t room = n <= kvs_pool_free_pages(self->pool) ? n : 0;
    uint32_t *pages = PyMem_Malloc(((size_t) room + 1) * sizeof(uint32_t));
    if (pages == NULL) return PyErr_NoMemory();
    ERR_RESET();
    kvs_status_t st = kvs_pool_alloc(self->pool, n, pages);
    PyObject *out = st == KVS_OK ? ranks_list(pages, n) : raise_status(st);
    PyMem_Free(pages);
    return out;
}

static int page_list(PyObject *seq, const char *what, uint32_t limit, uint32_t **pages_p,
                     uint32_t *n_p)
{
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of page ids");
    if (fast == NULL) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint32_t *pages = PyMem_Malloc(((size_t) n + 1) * sizeof(uint32_t));
    if (pages == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *idx = PyNumber_Index(item);
        unsigned long long v = idx ? PyLong_AsUnsignedLongLong(idx) : 0;
        Py_XDECREF(idx);
        if (PyErr_Occurred() || v >= limit) {
            PyErr_Clear();
            raise_invalid("%s[%zd]: page id out of range [0, %u)", what, i, limit);
            PyMem_Free(pages);
            Py_DECREF(fast);
            return 0;
        }
        pages[i] = (uint32_t) v;
    }
    Py_DECREF(fast);
    *pages_p = pages;
    *n_p = (uint32_t) n;
    return 1;
}

static PyObject *Pool_free(PoolObject *self, PyObject *arg)
{
    uint32_t *pages, n;
    if (!pool_ready(self) || !page_list(arg, "pages", UINT32_MAX, &pages, &n)) return NULL;
    ERR_RESET();
    kvs_status_t st = kvs_pool_free(self->pool, pages, n);
    PyMem_Free(pages);
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Pool_info(PoolObject *self, PyObject *unused)
{
    if (!pool_ready(self)) return NULL;
    const kvs_pool_config_t *c = kvs_pool_config(self->pool);
    return Py_BuildValue("{sIsIsIsIsIsisi}", "free_pages", kvs_pool_free_pages(self->pool),
                         "total_pages", kvs_pool_total_pages(self->pool), "heads",
                         kvs_pool_heads(self->pool), "page_size", c->page_size, "tp_rank",
                         c->tp.tp_rank, "device", c->mem == KVS_MEM_DEVICE ? c->device : -1, "hnd",
                         c->layout == KVS_POOL_HND);
}

static PyObject *Pool_region(PoolObject *self, PyObject *args)
{
    uint32_t layer, comp;
    if (!pool_ready(self) || !PyArg_ParseTuple(args, "II", &layer, &comp)) return NULL;
    ERR_RESET();
    const kvs_region_t *r = kvs_pool_region(self->pool, layer, comp);
    if (r == NULL) return raise_status(KVS_ERR_INVALID);
    return Py_BuildValue("(NKKKIII)", PyLong_FromVoidPtr(r->base),
                         (unsigned long long) r->page_stride, (unsigned long long) r->token_stride,
                         (unsigned long long) r->head_stride, r->heads, r->dim, r->elem_bytes);
}

static PyObject *Pool_page_allocated(PoolObject *self, PyObject *arg)
{
    uint32_t page;
    if (!pool_ready(self) || !to_u32(arg, &page, "page")) return NULL;
    return PyBool_FromLong(kvs_pool_page_allocated(self->pool, page));
}

static PyMethodDef Pool_methods[] = {
    {"alloc", (PyCFunction) Pool_alloc, METH_O, "alloc(n) -> n page ids, all or nothing"},
    {"free", (PyCFunction) Pool_free, METH_O, "free(pages): returns pages, all or nothing"},
    {"info", (PyCFunction) Pool_info, METH_NOARGS, "counts and configuration"},
    {"region", (PyCFunction) Pool_region, METH_VARARGS,
     "region(layer, component) -> (base, page_stride, token_stride, head_stride, heads, dim, "
     "elem_bytes)"},
    {"page_allocated", (PyCFunction) Pool_page_allocated, METH_O, NULL},
    {NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstage._kvstage.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc) Pool_init,
    .tp_dealloc = (destructor) Pool_dealloc,
    .tp_methods = Pool_methods,
};

/* ---- InprocNet ---- */

typedef struct {
    PyObject_HEAD kvs_inproc_net_t *net;
    kvs_clock_t clock;
    domain_t *dom;
} NetObject;

/* InprocNet(prefill_tp, decode_tp, seed, delay_max_ns, drop_permille, dup_permille,
 *           write_delay_max_ns) */
static int Net_init(NetObject *self, PyObject *args, PyObject *kw)
{
    uint32_t ptp, dtp;
    kvs_inproc_faults_t f;
    memset(&f, 0, sizeof(f));
    if (!PyArg_ParseTuple(args, "IIKKIIK", &ptp, &dtp, &f.seed, &f.delay_max_ns, &f.drop_permille,
                          &f.dup_permille, &f.write_delay_max_ns))
        return -1;
    if (self->net != NULL) {
        raise_status(KVS_ERR_STATE);
        return -1;
    }
    if ((self->dom = domain_new()) == NULL) return -1;
    self->clock = kvs_clock_monotonic();
    ERR_RESET();
    kvs_status_t st = kvs_inproc_net_create(ptp, dtp, &f, &self->clock, &self->net);
    if (st != KVS_OK) {
        raise_status(st);
        return -1;
    }
    return 0;
}

static void Net_dealloc(NetObject *self)
{
    kvs_inproc_net_destroy(self->net); /* its links hold references: none is left */
    domain_free(self->dom);
    Py_TYPE(self)->tp_free((PyObject *) self);
}

static PyObject *Net_stats(NetObject *self, PyObject *unused)
{
    kvs_inproc_stats_t s;
    if (self->net == NULL) return raise_invalid("InprocNet: not initialised");
    IN_DOMAIN(self->dom, kvs_inproc_net_stats(self->net, &s));
    return Py_BuildValue("{sKsKsKsKsKsK}", "sent", s.sent, "delivered", s.delivered, "dropped",
                         s.dropped, "duplicated", s.duplicated, "writes", s.writes, "write_bytes",
                         s.write_bytes);
}

static PyMethodDef Net_methods[] = {{"stats", (PyCFunction) Net_stats, METH_NOARGS, NULL}, {NULL}};

static PyTypeObject NetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstage._kvstage.InprocNet",
    .tp_basicsize = sizeof(NetObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc) Net_init,
    .tp_dealloc = (destructor) Net_dealloc,
    .tp_methods = Net_methods,
};

/* ---- Link ---- */

typedef struct {
    PyObject_HEAD kvs_link_t *link;
    PyObject *net; /* the InprocNet of an in-process link, else NULL */
    domain_t *dom; /* the net's, or this link's own (own_dom) */
    int own_dom;
    kvs_side_t side;
    uint32_t rank;
} LinkObject;

static PyTypeObject LinkType;

static void Link_dealloc(LinkObject *self)
{
    /* under the lock: other links of an in-process net may be progressing on other threads */
    if (self->link != NULL) IN_DOMAIN(self->dom, kvs_link_destroy(self->link));
    if (self->own_dom) domain_free(self->dom);
    Py_XDECREF(self->net);
    Py_TYPE(self)->tp_free((PyObject *) self);
}

static int parse_side(PyObject *o, kvs_side_t *side)
{
    uint32_t s;
    if (!to_u32(o, &s, "side")) return 0;
    if (s > 1) {
        raise_invalid("side: %u is neither prefill (0) nor decode (1)", s);
        return 0;
    }
    *side = (kvs_side_t) s;
    return 1;
}

/* inproc_link(net, side, rank) */
static PyObject *py_inproc_link(PyObject *mod, PyObject *args)
{
    NetObject *net;
    PyObject *side_o;
    uint32_t rank;
    kvs_side_t side;
    if (!PyArg_ParseTuple(args, "O!OI", &NetType, &net, &side_o, &rank) ||
        !parse_side(side_o, &side))
        return NULL;
    if (net->net == NULL) return raise_invalid("InprocNet: not initialised");
    LinkObject *self = PyObject_New(LinkObject, &LinkType);
    if (self == NULL) return NULL;
    self->link = NULL, self->own_dom = 0, self->dom = net->dom, self->side = side,
    self->rank = rank;
    Py_INCREF(net);
    self->net = (PyObject *) net;
    kvs_status_t st;
    IN_DOMAIN(self->dom, st = kvs_inproc_link_create(net->net, side, rank, &self->link));
    if (st != KVS_OK) {
        Py_DECREF(self);
        return raise_status(st);
    }
    return (PyObject *) self;
}

/* net_link(side, rank, peer_tp, bind, peers, data, net_device, registry, device, heartbeat_s,
 *          liveness_timeout_s, connect_timeout_s, write_timeout_s); device >= 0: the pool is on
 * that GPU (CUDA IPC data plane). */
static PyObject *py_net_link(PyObject *mod, PyObject *args)
{
    kvs_net_config_t c;
    PyObject *side_o, *peers;
    const char *net_device = NULL, *registry = NULL;
    uint32_t data;
    int device;
    double hb, live, conn, wr;
    memset(&c, 0, sizeof(c));
    if (!PyArg_ParseTuple(args, "OIIsO!IzzIdddd", &side_o, &c.rank, &c.peer_tp, &c.bind,
                          &PyList_Type, &peers, &data, &net_device, &registry, &device, &hb, &live,
                          &conn, &wr) ||
        !parse_side(side_o, &c.side))
        return NULL;
    if (PyList_GET_SIZE(peers) > KVS_MAX_TP)
        return raise_invalid("peers: %zd entries, at most %d", PyList_GET_SIZE(peers), KVS_MAX_TP);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(peers); i++) {
        PyObject *p = PyList_GET_ITEM(peers, i);
        if (p == Py_None) continue;
        if (!PyUnicode_Check(p)) return raise_invalid("peers[%zd]: expected a string or None", i);
        c.peers[i] = PyUnicode_AsUTF8(p);
    }
    if (data > KVS_NET_DATA_TCP) return raise_invalid("data: %u is not auto, shm or tcp", data);
    c.data = (kvs_net_data_t) data;
    c.net_device = net_device, c.registry = registry;
    c.mem = device >= 0 ? KVS_MEM_DEVICE : KVS_MEM_HOST;
    c.device = device >= 0 ? device : 0;
    if (!to_ns(hb, "heartbeat", 1, &c.heartbeat_ns) ||
        !to_ns(live, "liveness_timeout", 1, &c.liveness_timeout_ns) ||
        !to_ns(conn, "connect_timeout", 1, &c.connect_timeout_ns) ||
        !to_ns(wr, "write_timeout", 1, &c.write_timeout_ns))
        return NULL;
    LinkObject *self = PyObject_New(LinkObject, &LinkType);
    if (self == NULL) return NULL;
    self->link = NULL, self->net = NULL, self->own_dom = 1, self->side = c.side,
    self->rank = c.rank;
    if ((self->dom = domain_new()) == NULL) {
        self->own_dom = 0;
        Py_DECREF(self);
        return NULL;
    }
    kvs_status_t st;
    IN_DOMAIN(self->dom, st = kvs_net_link_create(&c, &self->link));
    if (st != KVS_OK) {
        Py_DECREF(self);
        return raise_status(st);
    }
    return (PyObject *) self;
}

static PyObject *Link_endpoint(LinkObject *self, PyObject *unused)
{
    const char *ep;
    IN_DOMAIN(self->dom, ep = kvs_net_link_endpoint(self->link));
    if (ep == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(ep);
}

static PyObject *Link_set_peer(LinkObject *self, PyObject *args)
{
    uint32_t rank;
    const char *ep;
    if (!PyArg_ParseTuple(args, "Is", &rank, &ep)) return NULL;
    kvs_status_t st;
    IN_DOMAIN(self->dom, st = kvs_net_link_set_peer(self->link, rank, ep));
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Link_progress(LinkObject *self, PyObject *unused)
{
    uint32_t n = 0;
    if (self->net == NULL) IN_DOMAIN_PROGRESS(self->dom, n = kvs_net_link_progress(self->link));
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Link_stats(LinkObject *self, PyObject *unused)
{
    kvs_net_stats_t s;
    kvs_status_t st;
    IN_DOMAIN(self->dom, st = kvs_net_link_stats(self->link, &s));
    if (st != KVS_OK) return raise_status(st);
    return Py_BuildValue("{sKsKsKsKsKsKsKsK}", "msgs_sent", s.msgs_sent, "msgs_received",
                         s.msgs_received, "heartbeats_sent", s.heartbeats_sent, "dead_peers",
                         s.dead_peers, "writes", s.writes, "write_bytes", s.write_bytes,
                         "writes_failed", s.writes_failed, "rejected", s.rejected);
}

static PyMethodDef Link_methods[] = {
    {"endpoint", (PyCFunction) Link_endpoint, METH_NOARGS,
     "the bound control endpoint of a net link (None for an in-process one)"},
    {"set_peer", (PyCFunction) Link_set_peer, METH_VARARGS, "set_peer(rank, endpoint)"},
    {"progress", (PyCFunction) Link_progress, METH_NOARGS, NULL},
    {"stats", (PyCFunction) Link_stats, METH_NOARGS, NULL},
    {NULL}};

static PyTypeObject LinkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstage._kvstage.Link",
    .tp_basicsize = sizeof(LinkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor) Link_dealloc,
    .tp_methods = Link_methods,
};

/* ---- Registry ---- */

typedef struct {
    PyObject_HEAD kvs_registry_t *reg;
    domain_t *dom;
    progress_thread_t thread;
} RegistryObject;

static int Registry_init(RegistryObject *self, PyObject *args, PyObject *kw)
{
    const char *bind;
    if (!PyArg_ParseTuple(args, "s", &bind)) return -1;
    if (self->reg != NULL) {
        raise_status(KVS_ERR_STATE);
        return -1;
    }
    if ((self->dom = domain_new()) == NULL) return -1;
    kvs_status_t st;
    IN_DOMAIN(self->dom, st = kvs_registry_create(bind, &self->reg));
    if (st != KVS_OK) {
        raise_status(st);
        return -1;
    }
    return 0;
}

static void Registry_dealloc(RegistryObject *self)
{
    progress_stop(&self->thread);
    kvs_registry_destroy(self->reg);
    domain_free(self->dom);
    Py_TYPE(self)->tp_free((PyObject *) self);
}

static int registry_ready(RegistryObject *self)
{
    if (self->reg == NULL) raise_invalid("Registry: not initialised");
    return self->reg != NULL;
}

static PyObject *Registry_endpoint(RegistryObject *self, PyObject *unused)
{
    if (!registry_ready(self)) return NULL;
    return PyUnicode_FromString(kvs_registry_endpoint(self->reg));
}

static PyObject *Registry_serve(RegistryObject *self, PyObject *arg)
{
    uint32_t ms, n;
    if (!registry_ready(self) || !to_u32(arg, &ms, "timeout_ms")) return NULL;
    IN_DOMAIN_PROGRESS(self->dom,
                       n = kvs_registry_serve(self->reg, (int) (ms > 60000 ? 60000 : ms)));
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Registry_count(RegistryObject *self, PyObject *unused)
{
    uint32_t n;
    if (!registry_ready(self)) return NULL;
    IN_DOMAIN(self->dom, n = kvs_registry_count(self->reg));
    return PyLong_FromUnsignedLong(n);
}

/* add(layout, rank, endpoint): registers a rank of this process. */
static PyObject *Registry_add(RegistryObject *self, PyObject *args)
{
    PyObject *geo_o;
    uint32_t rank;
    const char *ep;
    kvs_pd_geometry_t geo;
    kvs_msg_register_t reg;
    if (!registry_ready(self) || !PyArg_ParseTuple(args, "OIs", &geo_o, &rank, &ep) ||
        !parse_geo(geo_o, &geo))
        return NULL;
    if (strlen(ep) > KVS_MSG_ENDPOINT_MAX)
        return raise_invalid("endpoint: longer than %d bytes", KVS_MSG_ENDPOINT_MAX);
    kvs_registry_describe(&geo, rank, ep, &reg);
    kvs_status_t st;
    IN_DOMAIN(self->dom, st = kvs_registry_add(self->reg, &reg));
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static uint32_t registry_step(void *arg)
{
    return kvs_registry_serve(arg, 0);
}

static PyObject *Registry_start(RegistryObject *self, PyObject *args)
{
    double idle = 0.001;
    if (!registry_ready(self) || !PyArg_ParseTuple(args, "|d", &idle)) return NULL;
    return progress_start(&self->thread, self->dom, registry_step, self->reg, idle);
}

static PyObject *Registry_stop(RegistryObject *self, PyObject *unused)
{
    progress_stop(&self->thread);
    Py_RETURN_NONE;
}

static PyMethodDef Registry_methods[] = {
    {"endpoint", (PyCFunction) Registry_endpoint, METH_NOARGS, NULL},
    {"serve", (PyCFunction) Registry_serve, METH_O,
     "serve(timeout_ms) -> requests answered (GIL released)"},
    {"count", (PyCFunction) Registry_count, METH_NOARGS, NULL},
    {"add", (PyCFunction) Registry_add, METH_VARARGS, "add(layout, rank, endpoint)"},
    {"start_progress_thread", (PyCFunction) Registry_start, METH_VARARGS, NULL},
    {"stop_progress_thread", (PyCFunction) Registry_stop, METH_NOARGS, NULL},
    {NULL}};

static PyTypeObject RegistryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstage._kvstage.Registry",
    .tp_basicsize = sizeof(RegistryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc) Registry_init,
    .tp_dealloc = (destructor) Registry_dealloc,
    .tp_methods = Registry_methods,
};

/* registry_register(registry, layout, rank, endpoint, timeout_s): a prefill rank of another
 * process registers over the wire. */
static PyObject *py_registry_register(PyObject *mod, PyObject *args)
{
    const char *registry, *ep;
    PyObject *geo_o;
    uint32_t rank;
    double timeout;
    kvs_pd_geometry_t geo;
    kvs_msg_register_t reg;
    if (!PyArg_ParseTuple(args, "sOIsd", &registry, &geo_o, &rank, &ep, &timeout) ||
        !parse_geo(geo_o, &geo))
        return NULL;
    if (strlen(ep) > KVS_MSG_ENDPOINT_MAX)
        return raise_invalid("endpoint: longer than %d bytes", KVS_MSG_ENDPOINT_MAX);
    uint64_t ns;
    if (!to_ns(timeout, "timeout", 0, &ns)) return NULL;
    kvs_registry_describe(&geo, rank, ep, &reg);
    kvs_status_t st;
    Py_BEGIN_ALLOW_THREADS ERR_RESET();
    st = kvs_registry_register(registry, &reg, ns);
    Py_END_ALLOW_THREADS if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

/* registry_lookup(registry, layout, rank, timeout_s) -> endpoint: what a decode rank learns of
 * prefill rank `rank`, refused (IncompatibleError naming the mismatch) unless its registration
 * matches layout. */
static PyObject *py_registry_lookup(PyObject *mod, PyObject *args)
{
    const char *registry;
    PyObject *geo_o;
    uint32_t rank;
    double timeout;
    kvs_pd_geometry_t geo;
    kvs_msg_register_t reg;
    char why[256];
    if (!PyArg_ParseTuple(args, "sOId", &registry, &geo_o, &rank, &timeout) ||
        !parse_geo(geo_o, &geo))
        return NULL;
    uint64_t ns;
    if (!to_ns(timeout, "timeout", 0, &ns)) return NULL;
    kvs_status_t st;
    Py_BEGIN_ALLOW_THREADS ERR_RESET();
    st = kvs_registry_query(registry, rank, ns, &reg);
    if (st == KVS_OK) st = kvs_registry_check(&reg, &geo, why, sizeof(why));
    Py_END_ALLOW_THREADS if (st != KVS_OK) return raise_status(st);
    return PyUnicode_FromString(reg.endpoint);
}

/* ---- Sender and Receiver ---- */

typedef struct {
    PyObject_HEAD void *handle; /* kvs_sender_t or kvs_receiver_t; NULL once closed */
    PoolObject *pool;
    LinkObject *link;
    PyObject *tables; /* dict: room -> bytes, the page table libkvstage reads until release */
    uint32_t page_size, total_pages;
    progress_thread_t thread;
} PdObject;

static PyTypeObject SenderType, ReceiverType;

static int is_sender(PdObject *self)
{
    return Py_TYPE(self) == &SenderType || PyType_IsSubtype(Py_TYPE(self), &SenderType);
}

static uint32_t sender_step(void *arg)
{
    return kvs_sender_progress(arg);
}

static uint32_t receiver_step(void *arg)
{
    return kvs_receiver_progress(arg);
}

/* Destroys the handle (waiting for its writes), then drops what it read. */
static void pd_close(PdObject *self)
{
    progress_stop(&self->thread);
    if (self->handle != NULL) {
        void *h = self->handle;
        self->handle = NULL;
        if (is_sender(self))
            IN_DOMAIN(self->link->dom, kvs_sender_destroy(h));
        else
            IN_DOMAIN(self->link->dom, kvs_receiver_destroy(h));
    }
    Py_CLEAR(self->tables);
}

static void Pd_dealloc(PdObject *self)
{
    pd_close(self);
    Py_XDECREF(self->pool);
    Py_XDECREF(self->link);
    Py_TYPE(self)->tp_free((PyObject *) self);
}

/* Sender(layout, rank, pool, link, timeouts, window_chunks, staging_buffers, write_mode)
 * Receiver(layout, rank, pool, link, timeouts, ring_bytes) */
static int Pd_init(PdObject *self, PyObject *args, PyObject *kw)
{
    PyObject *geo_o, *timeouts_o;
    PoolObject *pool;
    LinkObject *link;
    uint32_t rank, window = 0, buffers = 0, mode = 0;
    unsigned long long ring = 0;
    kvs_pd_geometry_t geo;
    kvs_pd_timeouts_t t;
    int sender = is_sender(self);
    int ok = sender ? PyArg_ParseTuple(args, "OIO!O!OIII", &geo_o, &rank, &PoolType, &pool,
                                       &LinkType, &link, &timeouts_o, &window, &buffers, &mode)
                    : PyArg_ParseTuple(args, "OIO!O!OK", &geo_o, &rank, &PoolType, &pool, &LinkType,
                                       &link, &timeouts_o, &ring);
    if (!ok || !parse_geo(geo_o, &geo) || !parse_timeouts(timeouts_o, &t) || !pool_ready(pool))
        return -1;
    if (self->handle != NULL) {
        raise_status(KVS_ERR_STATE);
        return -1;
    }
    if (link->side != (sender ? KVS_SIDE_PREFILL : KVS_SIDE_DECODE) || link->rank != rank) {
        raise_invalid("link: it is %s rank %u's; this is %s rank %u", kvs_side_str(link->side),
                      link->rank, sender ? "prefill" : "decode", rank);
        return -1;
    }
    if (mode > KVS_WRITE_DIRECT) {
        raise_invalid("write_mode: %u is not auto (0), staged (1) or direct (2)", mode);
        return -1;
    }
    self->tables = PyDict_New();
    if (self->tables == NULL) return -1;
    kvs_clock_t clock = kvs_clock_monotonic();
    kvs_status_t st;
    if (sender) {
        kvs_sender_config_t c = {.geo = geo,
                                 .rank = rank,
                                 .timeouts = t,
                                 .window_chunks = window,
                                 .staging_buffers = buffers,
                                 .write_mode = (kvs_write_mode_t) mode};
        kvs_sender_t *tx = NULL;
        IN_DOMAIN(link->dom, st = kvs_sender_create(&c, pool->pool, link->link, &clock, &tx));
        self->handle = tx;
    } else {
        kvs_receiver_config_t c = {.geo = geo, .rank = rank, .timeouts = t, .ring_bytes = ring};
        kvs_receiver_t *rx = NULL;
        IN_DOMAIN(link->dom, st = kvs_receiver_create(&c, pool->pool, link->link, &clock, &rx));
        self->handle = rx;
    }
    if (st != KVS_OK) {
        raise_status(st);
        return -1;
    }
    Py_INCREF(pool), Py_INCREF(link);
    self->pool = pool, self->link = link;
    self->page_size = geo.page_size;
    self->total_pages = kvs_pool_total_pages(pool->pool);
    return 0;
}

static int pd_open(PdObject *self)
{
    if (self->handle == NULL) raise_status(KVS_ERR_STATE);
    return self->handle != NULL;
}

/* Keeps a copy of the page table for the room (libkvstage reads it until release). */
static PyObject *room_table(PdObject *self, unsigned long long room, PyObject *seq, uint64_t tokens,
                            const char *what)
{
    uint32_t *pages, n;
    if (!page_list(seq, what, self->total_pages, &pages, &n)) return NULL;
    uint64_t need = (tokens + self->page_size - 1) / self->page_size;
    if (n != need) {
        PyMem_Free(pages);
        return raise_invalid("%s: %u entries; %llu tokens at page size %u need %llu", what, n,
                             (unsigned long long) tokens, self->page_size,
                             (unsigned long long) need);
    }
    PyObject *b = PyBytes_FromStringAndSize((const char *) pages, (Py_ssize_t) n * 4);
    PyMem_Free(pages);
    return b;
}

static PyObject *pd_keep_table(PdObject *self, unsigned long long room, PyObject *table,
                               kvs_status_t st)
{
    if (st != KVS_OK) {
        Py_DECREF(table);
        return raise_status(st);
    }
    PyObject *key = PyLong_FromUnsignedLongLong(room);
    int r = key ? PyDict_SetItem(self->tables, key, table) : -1;
    Py_XDECREF(key);
    Py_DECREF(table);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static int pd_has_room(PdObject *self, unsigned long long room)
{
    PyObject *key = PyLong_FromUnsignedLongLong(room);
    int r = key ? PyDict_Contains(self->tables, key) : -1;
    Py_XDECREF(key);
    if (r == 1) raise_invalid("room %llu: already added (release it first)", room);
    return r != 0;
}

static PyObject *Sender_add_room(PdObject *self, PyObject *args)
{
    unsigned long long room, prompt;
    PyObject *seq;
    if (!pd_open(self) || !PyArg_ParseTuple(args, "KKO", &room, &prompt, &seq)) return NULL;
    if (pd_has_room(self, room)) return NULL;
    PyObject *table = room_table(self, room, seq, prompt, "page_table");
    if (table == NULL) return NULL;
    kvs_status_t st;
    const uint32_t *pages = (const uint32_t *) PyBytes_AS_STRING(table);
    IN_DOMAIN(self->link->dom, st = kvs_sender_add_room(self->handle, room, prompt, pages));
    return pd_keep_table(self, room, table, st);
}

static PyObject *Receiver_add_room(PdObject *self, PyObject *args)
{
    unsigned long long room, base, prompt;
    PyObject *seq;
    if (!pd_open(self) || !PyArg_ParseTuple(args, "KKKO", &room, &base, &prompt, &seq)) return NULL;
    if (pd_has_room(self, room)) return NULL;
    PyObject *table = room_table(self, room, seq, prompt > base ? prompt - base : 0, "delta_pages");
    if (table == NULL) return NULL;
    kvs_status_t st;
    const uint32_t *pages = (const uint32_t *) PyBytes_AS_STRING(table);
    IN_DOMAIN(self->link->dom, st = kvs_receiver_add_room(self->handle, room, base, prompt, pages));
    return pd_keep_table(self, room, table, st);
}

static PyObject *Sender_advance(PdObject *self, PyObject *args)
{
    unsigned long long room, computed, scheduled;
    if (!pd_open(self) || !PyArg_ParseTuple(args, "KKK", &room, &computed, &scheduled)) return NULL;
    kvs_status_t st;
    IN_DOMAIN(self->link->dom, st = kvs_sender_advance(self->handle, room, computed, scheduled));
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Sender_finish(PdObject *self, PyObject *args)
{
    unsigned long long room;
    Py_buffer meta;
    if (!pd_open(self) || !PyArg_ParseTuple(args, "Ky*", &room, &meta)) return NULL;
    if (meta.len > KVS_MSG_FINAL_MAX) {
        PyBuffer_Release(&meta);
        return raise_invalid("final: %zd bytes, at most %d", meta.len, KVS_MSG_FINAL_MAX);
    }
    kvs_status_t st;
    IN_DOMAIN(self->link->dom,
              st = kvs_sender_finish(self->handle, room, meta.buf, (uint32_t) meta.len));
    PyBuffer_Release(&meta);
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

/* A room id: any integer (numpy's too) in [0, 2^64). */
static int room_arg(PyObject *arg, unsigned long long *room)
{
    PyObject *idx = PyNumber_Index(arg);
    *room = idx ? PyLong_AsUnsignedLongLong(idx) : 0;
    Py_XDECREF(idx);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        raise_invalid("room: expected an integer in [0, 2^64)");
        return 0;
    }
    return 1;
}

static PyObject *Pd_abort(PdObject *self, PyObject *arg)
{
    unsigned long long room;
    if (!room_arg(arg, &room) || !pd_open(self)) return NULL;
    kvs_status_t st;
    if (is_sender(self))
        IN_DOMAIN(self->link->dom, st = kvs_sender_abort(self->handle, room));
    else
        IN_DOMAIN(self->link->dom, st = kvs_receiver_abort(self->handle, room));
    if (st != KVS_OK) return raise_status(st);
    Py_RETURN_NONE;
}

/* poll(room) -> (status, reason, quiescent, final bytes) */
static PyObject *Pd_poll(PdObject *self, PyObject *arg)
{
    unsigned long long room;
    if (!room_arg(arg, &room) || !pd_open(self)) return NULL;
    kvs_room_info_t info;
    kvs_status_t st;
    if (is_sender(self))
        IN_DOMAIN(self->link->dom, st = kvs_sender_poll(self->handle, room, &info));
    else
        IN_DOMAIN(self->link->dom, st = kvs_receiver_poll(self->handle, room, &info));
    if (st != KVS_OK) return raise_status(st);
    return Py_BuildValue("(iiNy#)", (int) info.status, (int) info.reason,
                         PyBool_FromLong(info.quiescent), (const char *) info.final,
                         (Py_ssize_t) (info.final_len <= KVS_MSG_FINAL_MAX ? info.final_len : 0));
}

static PyObject *Pd_release(PdObject *self, PyObject *arg)
{
    unsigned long long room;
    if (!room_arg(arg, &room) || !pd_open(self)) return NULL;
    kvs_status_t st;
    if (is_sender(self))
        IN_DOMAIN(self->link->dom, st = kvs_sender_release(self->handle, room));
    else
        IN_DOMAIN(self->link->dom, st = kvs_receiver_release(self->handle, room));
    if (st != KVS_OK) return raise_status(st);
    PyObject *key = PyLong_FromUnsignedLongLong(room);
    if (key == NULL || PyDict_DelItem(self->tables, key) < 0) PyErr_Clear();
    Py_XDECREF(key);
    Py_RETURN_NONE;
}

/* Never raises: failures surface as failed rooms. A closed object does nothing. */
static PyObject *Pd_progress(PdObject *self, PyObject *unused)
{
    uint32_t n = 0;
    if (self->handle == NULL) return PyLong_FromLong(0);
    if (is_sender(self))
        IN_DOMAIN_PROGRESS(self->link->dom, n = kvs_sender_progress(self->handle));
    else
        IN_DOMAIN_PROGRESS(self->link->dom, n = kvs_receiver_progress(self->handle));
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Pd_metrics(PdObject *self, PyObject *unused)
{
    if (!pd_open(self)) return NULL;
    kvs_pd_metrics_t m;
    if (is_sender(self))
        IN_DOMAIN(self->link->dom, kvs_sender_metrics(self->handle, &m));
    else
        IN_DOMAIN(self->link->dom, kvs_receiver_metrics(self->handle, &m));
    uint32_t n;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&n);
    PyObject *d = PyDict_New();
    for (uint32_t i = 0; d && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(kvs_pd_metrics_get(&m, &f[i]));
        if (v == NULL || PyDict_SetItemString(d, f[i].field, v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *Pd_start(PdObject *self, PyObject *args)
{
    double idle = 0.0001;
    if (!pd_open(self) || !PyArg_ParseTuple(args, "|d", &idle)) return NULL;
    return progress_start(&self->thread, self->link->dom,
                          is_sender(self) ? sender_step : receiver_step, self->handle, idle);
}

static PyObject *Pd_stop(PdObject *self, PyObject *unused)
{
    progress_stop(&self->thread);
    Py_RETURN_NONE;
}

static PyObject *Pd_close(PdObject *self, PyObject *unused)
{
    pd_close(self);
    Py_RETURN_NONE;
}

static PyObject *Pd_live(PdObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(self->tables ? PyDict_Size(self->tables) : 0);
}

#define PD_COMMON_METHODS                                                                          \
    {"abort", (PyCFunction) Pd_abort, METH_O, NULL},                                               \
        {"poll", (PyCFunction) Pd_poll, METH_O, NULL},                                             \
        {"release", (PyCFunction) Pd_release, METH_O, NULL},                                       \
        {"progress", (PyCFunction) Pd_progress, METH_NOARGS, NULL},                                \
        {"metrics", (PyCFunction) Pd_metrics, METH_NOARGS, NULL},                                  \
        {"start_progress_thread", (PyCFunction) Pd_start, METH_VARARGS, NULL},                     \
        {"stop_progress_thread", (PyCFunction) Pd_stop, METH_NOARGS, NULL},                        \
        {"close", (PyCFunction) Pd_close, METH_NOARGS, NULL},                                      \
        {"rooms_held", (PyCFunction) Pd_live, METH_NOARGS, NULL},

static PyMethodDef Sender_methods[] = {
    {"add_room", (PyCFunction) Sender_add_room, METH_VARARGS, NULL},
    {"advance", (PyCFunction) Sender_advance, METH_VARARGS, NULL},
    {"finish", (PyCFunction) Sender_finish, METH_VARARGS, NULL},
    PD_COMMON_METHODS{NULL}};

static PyMethodDef Receiver_methods[] = {
    {"add_room", (PyCFunction) Receiver_add_room, METH_VARARGS, NULL}, PD_COMMON_METHODS{NULL}};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstage._kvstage.Sender",
    .tp_basicsize = sizeof(PdObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc) Pd_init,
    .tp_dealloc = (destructor) Pd_dealloc,
    .tp_methods = Sender_methods,
};

static PyTypeObject ReceiverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstage._kvstage.Receiver",
    .tp_basicsize = sizeof(PdObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc) Pd_init,
    .tp_dealloc = (destructor) Pd_dealloc,
    .tp_methods = Receiver_methods,
};

/* ---- module ---- */

static PyObject *py_set_errors(PyObject *mod, PyObject *d)
{
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "expected a dict");
        return NULL;
    }
    Py_INCREF(d);
    Py_XSETREF(g_error_for, d);
    Py_RETURN_NONE;
}

static PyObject *py_status_str(PyObject *mod, PyObject *arg)
{
    long st = PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(kvs_status_str((kvs_status_t) st));
}

static PyObject *py_room_status_str(PyObject *mod, PyObject *arg)
{
    long st = PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(kvs_room_status_str((kvs_room_status_t) st));
}

static PyMethodDef module_methods[] = {
    {"validate_shape", py_validate_shape, METH_O, NULL},
    {"validate_geometry", py_validate_geometry, METH_O, NULL},
    {"validate_tp", py_validate_tp, METH_VARARGS, NULL},
    {"plan", py_plan, METH_VARARGS, NULL},
    {"inproc_link", py_inproc_link, METH_VARARGS, NULL},
    {"net_link", py_net_link, METH_VARARGS, NULL},
    {"registry_register", py_registry_register, METH_VARARGS, NULL},
    {"registry_lookup", py_registry_lookup, METH_VARARGS, NULL},
    {"set_errors", py_set_errors, METH_O, NULL},
    {"status_str", py_status_str, METH_O, NULL},
    {"room_status_str", py_room_status_str, METH_O, NULL},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_kvstage", NULL, -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__kvstage(void)
{
    PyTypeObject *types[] = {&PoolType,     &NetType,    &LinkType,
                             &RegistryType, &SenderType, &ReceiverType};
    const char *names[] = {"Pool", "InprocNet", "Link", "Registry", "Sender", "Receiver"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *) types[i]) < 0) return NULL;
    }
    PyModule_AddStringConstant(m, "VERSION", KVS_PY_VERSION);
    PyModule_AddIntConstant(m, "MAX_TP", KVS_MAX_TP);
    PyModule_AddIntConstant(m, "FINAL_MAX", KVS_MSG_FINAL_MAX);
    /* The C enums' names and values, for kvstage.Status and kvstage.RoomStatus. */
    static const struct {
        const char *name;
        int value;
    } statuses[] = {{"OK", KVS_OK},
                    {"INPROGRESS", KVS_INPROGRESS},
                    {"ERR_INVALID", KVS_ERR_INVALID},
                    {"ERR_NOMEM", KVS_ERR_NOMEM},
                    {"ERR_NOSPACE", KVS_ERR_NOSPACE},
                    {"ERR_NOT_FOUND", KVS_ERR_NOT_FOUND},
                    {"ERR_TIMEOUT", KVS_ERR_TIMEOUT},
                    {"ERR_PROTOCOL", KVS_ERR_PROTOCOL},
                    {"ERR_UNSUPPORTED", KVS_ERR_UNSUPPORTED},
                    {"ERR_IO", KVS_ERR_IO},
                    {"ERR_ABORTED", KVS_ERR_ABORTED},
                    {"ERR_INCOMPATIBLE", KVS_ERR_INCOMPATIBLE},
                    {"ERR_STATE", KVS_ERR_STATE},
                    {"ERR_CORRUPT", KVS_ERR_CORRUPT}},
      rooms[] = {{"FAILED", KVS_ROOM_FAILED},
                 {"BOOTSTRAPPING", KVS_ROOM_BOOTSTRAPPING},
                 {"WAITING", KVS_ROOM_WAITING},
                 {"TRANSFERRING", KVS_ROOM_TRANSFERRING},
                 {"SUCCESS", KVS_ROOM_SUCCESS}};
    PyObject *st_list = PyList_New(0), *room_list = PyList_New(0);
    if (st_list == NULL || room_list == NULL) return NULL;
    for (size_t i = 0; i < sizeof(statuses) / sizeof(statuses[0]); i++) {
        PyObject *t = Py_BuildValue("(si)", statuses[i].name, statuses[i].value);
        if (t == NULL || PyList_Append(st_list, t) < 0) return NULL;
        Py_DECREF(t);
    }
    for (size_t i = 0; i < sizeof(rooms) / sizeof(rooms[0]); i++) {
        PyObject *t = Py_BuildValue("(si)", rooms[i].name, rooms[i].value);
        if (t == NULL || PyList_Append(room_list, t) < 0) return NULL;
        Py_DECREF(t);
    }
    if (PyModule_AddObject(m, "STATUSES", st_list) < 0 ||
        PyModule_AddObject(m, "ROOM_STATUSES", room_list) < 0)
        return NULL;
    PyObject *logging = PyImport_ImportModule("logging");
    if (logging == NULL) return NULL;
    g_logger = PyObject_CallMethod(logging, "getLogger", "s", "kvstage");
    Py_DECREF(logging);
    if (g_logger == NULL) return NULL;
    kvs_log_set_sink(log_sink, NULL);
    return m;
}

/* The loops of the GPU analysis that touch every op, compiled: a device's sweep into busy time and idle gaps
 * (timeline._sweep), each gap's cause (the same rules as timeline._host_sync_flags and timeline._GapCauses, gap by
 * gap in the same order), the host ops inside the gaps (timeline.idle_inside_ops), the sort of host-activity times,
 * the compute and communication unions (kernels.compute_union_us, kernels.comm_overlap_us) and the kernel
 * statistics' sums (per name, graph replays, launch times). Each does what its Python does in the same order, so every
 * sum is the same to the last bit; the Python is the reference and the fallback without a compiler, and
 * tests/test_trace_gaps.py holds the two equal. On an 800 MB trace of 330,000 kernels the timelines and kernel
 * statistics took 1.6 s in Python, 0.8 s with these; a trace with many host syncs sends most gaps down the long path, which in Python cost 2 us a gap. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* timeline.py's constants (test_trace_gaps.py checks they agree) */
#define KERNEL_OVERHEAD_US 30.0
#define QUEUE_DRY_MIN_US 1000.0
#define HOST_BUSY_FRAC 0.2
#define SYNC_SLACK_US 2.0

enum { HOST, SYNC, PAGEABLE, QUEUE_DRY, KERNEL_OVERHEAD, STREAM_WAIT, N_CAUSES };
static const char *CAUSE_NAMES[N_CAUSES] = {"host", "sync", "pageable_memcpy", "queue_dry", "kernel_overhead",
                                            "stream_wait"};
static PyObject *CAUSES[N_CAUSES];

typedef struct {
    double *v;
    Py_ssize_t n;
} Doubles;

/* The columns a call reads, through the buffer protocol, released together. */
typedef struct {
    Py_buffer b[8];
    int held;
} Columns;

static void columns_release(Columns *cs) {
    for (int i = 0; i < cs->held; i++) PyBuffer_Release(&cs->b[i]);
    cs->held = 0;
}

/* obj's buffer as a column of items of this format, n of them (n < 0: any number): *buf and *len; -1 with an
 * exception set. */
static int column(Columns *cs, PyObject *obj, char format, Py_ssize_t itemsize, Py_ssize_t n, const void **buf,
                  Py_ssize_t *len) {
    if (cs->held == (int)(sizeof cs->b / sizeof cs->b[0])) {
        PyErr_SetString(PyExc_SystemError, "too many columns for one call");
        return -1;
    }
    Py_buffer *b = &cs->b[cs->held];
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    cs->held++;
    if (b->itemsize != itemsize || !b->format || b->format[0] != format || b->format[1]) {
        PyErr_Format(PyExc_TypeError, "expected an array of '%c' items", format);
        return -1;
    }
    if (n >= 0 && b->len / itemsize != n) {
        PyErr_Format(PyExc_TypeError, "expected %zd items, got %zd", n, b->len / itemsize);
        return -1;
    }
    *buf = b->buf;
    *len = b->len / itemsize;
    return 0;
}

/* A list (or any sequence) of numbers, or an array of doubles, as doubles; 0 on success. */
static int doubles(PyObject *seq, Doubles *out) {
    out->v = NULL;
    out->n = 0;
    if (PyObject_CheckBuffer(seq)) {
        Columns cs = {.held = 0};
        const void *buf;
        Py_ssize_t n;
        int bad = column(&cs, seq, 'd', sizeof(double), -1, &buf, &n);
        if (!bad) {
            out->v = PyMem_Malloc(sizeof(double) * (size_t)(n ? n : 1));
            if (out->v) {
                memcpy(out->v, buf, sizeof(double) * (size_t)n);
                out->n = n;
            } else {
                PyErr_NoMemory();
                bad = -1;
            }
        }
        columns_release(&cs);
        return bad;
    }
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of numbers");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    out->v = PyMem_Malloc(sizeof(double) * (size_t)(n ? n : 1));
    if (!out->v) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double x = PyFloat_AsDouble(items[i]);
        if (x == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            PyMem_Free(out->v);
            out->v = NULL;
            return -1;
        }
        out->v[i] = x;
    }
    out->n = n;
    Py_DECREF(fast);
    return 0;
}

/* bisect.bisect_right */
static Py_ssize_t bisect_right(const Doubles *a, double x) {
    Py_ssize_t lo = 0, hi = a->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (x < a->v[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* timeline._open_flags for one x: an interval (sorted starts, running max of ends) started by x and not ended
 * before x - slack. */
static int open_at(const Doubles *starts, const Doubles *ends_max, double x) {
    Py_ssize_t i = bisect_right(starts, x);
    return i > 0 && ends_max->v[i - 1] >= x - SYNC_SLACK_US;
}

typedef struct {
    PyObject *of_gpu; /* list: GPU op -> its launch call's index, or None */
    const int *g_name;
    Py_ssize_t n_gpu;
    const double *r_ts, *r_dur;
    Py_ssize_t n_rt;
    const unsigned char *pageable, *to_host; /* per name id: a pageable host-to-device copy; a copy to the host */
    Py_ssize_t n_names;
    PyObject *host_events; /* callable -> (sorted starts, sorted ends) of host activity, called on first need */
    Doubles h_starts, h_ends;
    int host_ready;
    double unattributed;
} Ctx;

/* The launch call of GPU op `op` (-1: none); -2 with an exception set. */
static Py_ssize_t launch_of(Ctx *c, Py_ssize_t op) {
    if (op < 0 || op >= PyList_GET_SIZE(c->of_gpu) || op >= c->n_gpu) {
        PyErr_SetString(PyExc_IndexError, "GPU op index out of range");
        return -2;
    }
    PyObject *o = PyList_GET_ITEM(c->of_gpu, op);
    if (o == Py_None) return -1;
    Py_ssize_t call = PyLong_AsSsize_t(o);
    if (call == -1 && PyErr_Occurred()) return -2;
    if (call < 0 || call >= c->n_rt) {
        PyErr_SetString(PyExc_IndexError, "launch call index out of range");
        return -2;
    }
    return call;
}

static int name_in(const unsigned char *mask, Ctx *c, Py_ssize_t op) {
    int nid = c->g_name[op];
    return nid >= 0 && nid < c->n_names && mask[nid];
}

/* _GapCauses._call_open; -1 with an exception set. */
static int call_open(Ctx *c, Py_ssize_t op, double x) {
    Py_ssize_t call = launch_of(c, op);
    if (call == -2) return -1;
    return call >= 0 && c->r_ts[call] + c->r_dur[call] >= x - SYNC_SLACK_US;
}

/* HostActivity.busy_at_least(a, b, HOST_BUSY_FRAC); -1 with an exception set. */
static int busy_at_least(Ctx *c, double a, double b) {
    if (b <= a) return 0;
    if (!c->host_ready) {
        PyObject *ev = PyObject_CallNoArgs(c->host_events);
        if (!ev) return -1;
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 2) {
            Py_DECREF(ev);
            PyErr_SetString(PyExc_TypeError, "host_events() must return (starts, ends)");
            return -1;
        }
        int bad = doubles(PyTuple_GET_ITEM(ev, 0), &c->h_starts) || doubles(PyTuple_GET_ITEM(ev, 1), &c->h_ends);
        Py_DECREF(ev);
        if (bad) return -1;
        c->host_ready = 1;
    }
    const Doubles *starts = &c->h_starts, *ends = &c->h_ends;
    double need = HOST_BUSY_FRAC * (b - a);
    Py_ssize_t i = bisect_right(starts, a), j = bisect_right(ends, a);
    Py_ssize_t open_now = i - j;
    double t = a, busy = 0.0;
    while (busy < need) {
        double ns = i < starts->n ? starts->v[i] : b;
        double ne = j < ends->n ? ends->v[j] : b;
        double nxt = ns < ne ? ns : ne;
        if (b < nxt) nxt = b;
        if (open_now > 0) busy += nxt - t;
        if (nxt >= b) break;
        t = nxt;
        if (ns <= ne) {
            open_now++;
            i++;
        } else {
            open_now--;
            j++;
        }
    }
    return busy >= need;
}

/* _GapCauses._pageable; -1 with an exception set. */
static int pageable(Ctx *c, double g0, double g1, Py_ssize_t nxt, Py_ssize_t prev, int sync_open) {
    if (prev >= 0 && name_in(c->pageable, c, prev)) {
        if (sync_open) return 1;
        int open = call_open(c, prev, g0);
        if (open) return open;
    }
    if (nxt >= 0 && name_in(c->pageable, c, nxt)) {
        Py_ssize_t call = launch_of(c, nxt);
        if (call == -2) return -1;
        return call >= 0 && c->r_ts[call] <= g0 + (g1 - g0) / 2;
    }
    return 0;
}

/* _GapCauses.cause; -1 with an exception set. */
static int cause(Ctx *c, double g0, double g1, Py_ssize_t nxt, Py_ssize_t prev, int sync_open) {
    int p = pageable(c, g0, g1, nxt, prev, sync_open);
    if (p) return p < 0 ? -1 : PAGEABLE;
    Py_ssize_t launch = nxt >= 0 ? launch_of(c, nxt) : -1;
    if (launch == -2) return -1;
    double queued_wait = 0.0;
    if (launch >= 0) {
        double ret = c->r_ts[launch] + c->r_dur[launch];
        queued_wait = g1 - (ret > g0 ? ret : g0);
    }
    if (sync_open && launch >= 0 && c->r_ts[launch] <= g0 && g1 - g0 > KERNEL_OVERHEAD_US &&
        queued_wait > KERNEL_OVERHEAD_US)
        return STREAM_WAIT;
    if (sync_open) return SYNC;
    if (prev >= 0 && name_in(c->to_host, c, prev)) {
        int open = call_open(c, prev, g0);
        if (open) return open < 0 ? -1 : SYNC;
    }
    if (launch >= 0 && c->r_ts[launch] <= g0) {
        if (g1 - g0 <= KERNEL_OVERHEAD_US) return KERNEL_OVERHEAD;
        return queued_wait <= KERNEL_OVERHEAD_US ? HOST : STREAM_WAIT;
    }
    if (launch < 0 && nxt >= 0) c->unattributed += g1 - g0;
    if (g1 - g0 < QUEUE_DRY_MIN_US) return HOST;
    int busy = busy_at_least(c, g0, g1);
    return busy < 0 ? -1 : busy ? HOST : QUEUE_DRY;
}

/* _GapCauses.classify for one gap (the plain gaps inline, the rest through cause); -1 with an exception set. */
static int classify(Ctx *c, double g0, double g1, Py_ssize_t nxt, Py_ssize_t prev, int sync_open) {
    Py_ssize_t launch = nxt >= 0 ? launch_of(c, nxt) : -1;
    if (launch == -2) return -1;
    if (sync_open || launch < 0 || name_in(c->pageable, c, nxt) || name_in(c->to_host, c, nxt) ||
        (prev >= 0 && (name_in(c->pageable, c, prev) || name_in(c->to_host, c, prev))))
        return cause(c, g0, g1, nxt, prev, sync_open);
    if (c->r_ts[launch] <= g0)
        return g1 - g0 <= KERNEL_OVERHEAD_US ? KERNEL_OVERHEAD : cause(c, g0, g1, nxt, prev, 0);
    return g1 - g0 < QUEUE_DRY_MIN_US ? HOST : cause(c, g0, g1, nxt, prev, 0);
}

/* An op index from a gap tuple: an int, or None (-1); -2 with an exception set. */
static Py_ssize_t op_index(PyObject *o) {
    if (o == Py_None) return -1;
    Py_ssize_t i = PyLong_AsSsize_t(o);
    if (i == -1 && PyErr_Occurred()) return -2;
    if (i < 0) {
        PyErr_SetString(PyExc_IndexError, "negative op index");
        return -2;
    }
    return i;
}

static PyObject *gap_causes(PyObject *self, PyObject *args) {
    PyObject *gaps, *sync_start_o, *sync_end_o, *gs_start_o, *gs_end_o, *of_gpu, *g_name_o, *r_ts_o, *r_dur_o,
        *pageable_o, *to_host_o, *host_events;
    if (!PyArg_ParseTuple(args, "O!OOOOO!OOOOOO:gap_causes", &PyList_Type, &gaps, &sync_start_o, &sync_end_o,
                          &gs_start_o, &gs_end_o, &PyList_Type, &of_gpu, &g_name_o, &r_ts_o, &r_dur_o, &pageable_o,
                          &to_host_o, &host_events))
        return NULL;
    Columns cs = {.held = 0};
    Ctx c = {.of_gpu = of_gpu, .host_events = host_events};
    Doubles ss = {0}, se = {0}, gs = {0}, ge = {0};
    PyObject *causes = NULL, *out = NULL;
    const void *g_name, *r_ts, *r_dur, *pageable, *to_host;
    if (column(&cs, g_name_o, 'i', sizeof(int), -1, &g_name, &c.n_gpu) ||
        column(&cs, r_ts_o, 'd', sizeof(double), -1, &r_ts, &c.n_rt) ||
        column(&cs, r_dur_o, 'd', sizeof(double), c.n_rt, &r_dur, &c.n_rt) ||
        column(&cs, pageable_o, 'B', 1, -1, &pageable, &c.n_names) ||
        column(&cs, to_host_o, 'B', 1, c.n_names, &to_host, &c.n_names))
        goto done;
    c.g_name = g_name;
    c.r_ts = r_ts;
    c.r_dur = r_dur;
    c.pageable = pageable;
    c.to_host = to_host;
    if (doubles(sync_start_o, &ss) || doubles(sync_end_o, &se) || doubles(gs_start_o, &gs) || doubles(gs_end_o, &ge))
        goto done;
    if (ss.n != se.n || gs.n != ge.n) {
        PyErr_SetString(PyExc_ValueError, "sync starts and ends of unequal length");
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(gaps);
    causes = PyList_New(n);
    if (!causes) goto done;
    double idle[N_CAUSES] = {0};
    Py_ssize_t counts[N_CAUSES] = {0};
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *g = PyList_GET_ITEM(gaps, k);
        if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != 4) {
            PyErr_SetString(PyExc_TypeError, "a gap is a tuple (start, end, next op, previous op)");
            goto fail;
        }
        double g0 = PyFloat_AsDouble(PyTuple_GET_ITEM(g, 0));
        if (g0 == -1.0 && PyErr_Occurred()) goto fail;
        double g1 = PyFloat_AsDouble(PyTuple_GET_ITEM(g, 1));
        if (g1 == -1.0 && PyErr_Occurred()) goto fail;
        Py_ssize_t nxt = op_index(PyTuple_GET_ITEM(g, 2)), prev = op_index(PyTuple_GET_ITEM(g, 3));
        if (nxt == -2 || prev == -2) goto fail;
        if ((nxt >= c.n_gpu) || (prev >= c.n_gpu)) {
            PyErr_SetString(PyExc_IndexError, "GPU op index out of range");
            goto fail;
        }
        /* _host_sync_flags */
        int sync_open = ss.n && open_at(&ss, &se, g0);
        if (!sync_open && ss.n) {
            Py_ssize_t i = bisect_right(&ss, (g0 + g1) / 2);
            sync_open = i > 0 && se.v[i - 1] >= g1 - SYNC_SLACK_US;
        }
        if (!sync_open && gs.n) sync_open = open_at(&gs, &ge, g0);
        int k_cause = classify(&c, g0, g1, nxt, prev, sync_open);
        if (k_cause < 0) goto fail;
        idle[k_cause] += g1 - g0;
        counts[k_cause]++;
        Py_INCREF(CAUSES[k_cause]);
        PyList_SET_ITEM(causes, k, CAUSES[k_cause]);
    }
    PyObject *idle_t = PyTuple_New(N_CAUSES), *count_t = PyTuple_New(N_CAUSES);
    if (!idle_t || !count_t) {
        Py_XDECREF(idle_t);
        Py_XDECREF(count_t);
        goto fail;
    }
    for (int i = 0; i < N_CAUSES; i++) {
        PyObject *x = PyFloat_FromDouble(idle[i]), *y = PyLong_FromSsize_t(counts[i]);
        if (!x || !y) {
            Py_XDECREF(x);
            Py_XDECREF(y);
            Py_DECREF(idle_t);
            Py_DECREF(count_t);
            goto fail;
        }
        PyTuple_SET_ITEM(idle_t, i, x);
        PyTuple_SET_ITEM(count_t, i, y);
    }
    out = Py_BuildValue("(NNNd)", causes, idle_t, count_t, c.unattributed);
    causes = NULL;
    goto done;
fail:
    Py_CLEAR(causes);
done:
    Py_XDECREF(causes);
    PyMem_Free(ss.v);
    PyMem_Free(se.v);
    PyMem_Free(gs.v);
    PyMem_Free(ge.v);
    PyMem_Free(c.h_starts.v);
    PyMem_Free(c.h_ends.v);
    columns_release(&cs);
    return out;
}

/* --- idle inside ops ------------------------------------------------------------------------------------------ */

/* timeline.idle_inside_ops' heap of the ops open at a gap: (end, op index), ordered as Python orders the tuples, and
 * kept as heapq keeps its list (the same pushes and pops, so the same order in the array: names enter the result in
 * the order Python's loop over the heap meets them). */
typedef struct {
    double end;
    Py_ssize_t k;
} Open;

static int open_lt(const Open *a, const Open *b) { return a->end < b->end || (a->end == b->end && a->k < b->k); }

static void sift_down(Open *h, Py_ssize_t start, Py_ssize_t pos) { /* heapq._siftdown */
    Open item = h[pos];
    while (pos > start) {
        Py_ssize_t parent = (pos - 1) >> 1;
        if (!open_lt(&item, &h[parent])) break;
        h[pos] = h[parent];
        pos = parent;
    }
    h[pos] = item;
}

static void sift_up(Open *h, Py_ssize_t n, Py_ssize_t pos) { /* heapq._siftup */
    Py_ssize_t start = pos;
    Open item = h[pos];
    Py_ssize_t child = 2 * pos + 1;
    while (child < n) {
        Py_ssize_t right = child + 1;
        if (right < n && !open_lt(&h[child], &h[right])) child = right;
        h[pos] = h[child];
        pos = child;
        child = 2 * pos + 1;
    }
    h[pos] = item;
    sift_down(h, start, pos);
}

typedef struct {
    double lo, hi;
} Part;

static int part_cmp(const void *a, const void *b) { /* (lo, hi) tuples' order */
    const Part *x = a, *y = b;
    if (x->lo != y->lo) return x->lo < y->lo ? -1 : 1;
    if (x->hi != y->hi) return x->hi < y->hi ? -1 : 1;
    return 0;
}

typedef struct {
    Py_ssize_t next; /* the same name's next span in this gap, or -1 */
    double lo, hi;
} Span;

static PyObject *idle_inside(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *g0_o, *g1_o, *name_o, *start_o, *end_o;
    int n_names;
    if (!PyArg_ParseTuple(args, "OOOOOi:idle_inside", &g0_o, &g1_o, &name_o, &start_o, &end_o, &n_names)) return NULL;
    Columns cs = {.held = 0};
    const void *g0_b, *g1_b, *name_b, *start_b, *end_b;
    Py_ssize_t n_gaps, n;
    if (column(&cs, g0_o, 'd', sizeof(double), -1, &g0_b, &n_gaps) ||
        column(&cs, g1_o, 'd', sizeof(double), n_gaps, &g1_b, &n_gaps) ||
        column(&cs, name_o, 'i', sizeof(int), -1, &name_b, &n) ||
        column(&cs, start_o, 'd', sizeof(double), n, &start_b, &n) ||
        column(&cs, end_o, 'd', sizeof(double), n, &end_b, &n)) {
        columns_release(&cs);
        return NULL;
    }
    const double *g0s = g0_b, *g1s = g1_b, *starts = start_b, *ends = end_b;
    const int *names = name_b;
    PyObject *out = NULL;
    Open *heap = PyMem_Malloc(sizeof(Open) * (size_t)(n ? n : 1));
    Span *spans = PyMem_Malloc(sizeof(Span) * (size_t)(n ? n : 1));
    Part *parts = PyMem_Malloc(sizeof(Part) * (size_t)(n ? n : 1));
    size_t nn = (size_t)(n_names > 0 ? n_names : 1);
    Py_ssize_t *slot = PyMem_Malloc(sizeof(Py_ssize_t) * nn);  /* per name: its first span in this gap, or -1 */
    Py_ssize_t *last = PyMem_Malloc(sizeof(Py_ssize_t) * nn);  /* per name: its last span in this gap */
    int *touched = PyMem_Malloc(sizeof(int) * nn);              /* the names of this gap, in order met */
    double *total = PyMem_Malloc(sizeof(double) * nn);
    int *order = PyMem_Malloc(sizeof(int) * nn); /* names in the order they enter the result */
    char *seen = PyMem_Calloc(nn, 1);
    if (!heap || !spans || !parts || !slot || !last || !touched || !total || !order || !seen) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (names[i] < 0 || names[i] >= n_names) {
            PyErr_SetString(PyExc_IndexError, "a name id out of range");
            goto done;
        }
    for (int i = 0; i < n_names; i++) slot[i] = -1;
    Py_ssize_t n_open = 0, k = 0;
    int n_order = 0;
    for (Py_ssize_t g = 0; g < n_gaps; g++) {
        double g0 = g0s[g], g1 = g1s[g];
        while (k < n && starts[k] < g1) {
            if (ends[k] > g0) { /* one that ended before this gap is in none of the later ones either */
                heap[n_open].end = ends[k];
                heap[n_open].k = k;
                sift_down(heap, 0, n_open);
                n_open++;
            }
            k++;
        }
        while (n_open && heap[0].end <= g0) { /* heapq.heappop */
            n_open--;
            if (n_open) {
                heap[0] = heap[n_open];
                sift_up(heap, n_open, 0);
            }
        }
        Py_ssize_t n_spans = 0;
        int n_touched = 0;
        for (Py_ssize_t i = 0; i < n_open; i++) {
            Py_ssize_t j = heap[i].k;
            double end = heap[i].end, start = starts[j];
            double lo = start > g0 ? start : g0, hi = end < g1 ? end : g1;
            if (hi > lo) {
                int name = names[j];
                if (slot[name] < 0) {
                    slot[name] = n_spans;
                    touched[n_touched++] = name;
                } else {
                    spans[last[name]].next = n_spans;
                }
                last[name] = n_spans;
                spans[n_spans].next = -1;
                spans[n_spans].lo = lo;
                spans[n_spans].hi = hi;
                n_spans++;
            }
        }
        for (int t = 0; t < n_touched; t++) {
            int name = touched[t];
            double covered;
            const Span *first = &spans[slot[name]];
            if (first->next < 0) {
                covered = first->hi - first->lo;
            } else { /* timeline._union */
                Py_ssize_t m = 0;
                for (Py_ssize_t i = slot[name]; i >= 0; i = spans[i].next) {
                    parts[m].lo = spans[i].lo;
                    parts[m].hi = spans[i].hi;
                    m++;
                }
                qsort(parts, (size_t)m, sizeof(Part), part_cmp);
                double reach = g0;
                covered = 0.0;
                for (Py_ssize_t i = 0; i < m; i++)
                    if (parts[i].hi > reach) {
                        covered += parts[i].hi - (reach > parts[i].lo ? reach : parts[i].lo);
                        reach = parts[i].hi;
                    }
            }
            if (!seen[name]) {
                seen[name] = 1;
                total[name] = 0.0;
                order[n_order++] = name;
            }
            total[name] += covered;
            slot[name] = -1;
        }
    }
    out = PyList_New(n_order);
    if (!out) goto done;
    for (int i = 0; i < n_order; i++) {
        PyObject *pair = Py_BuildValue("(id)", order[i], total[order[i]]);
        if (!pair) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, pair);
    }
done:
    PyMem_Free(heap);
    PyMem_Free(spans);
    PyMem_Free(parts);
    PyMem_Free(slot);
    PyMem_Free(last);
    PyMem_Free(touched);
    PyMem_Free(total);
    PyMem_Free(order);
    PyMem_Free(seen);
    columns_release(&cs);
    return out;
}

/* --- sorted times ---------------------------------------------------------------------------------------------- */

/* A double's bits as an unsigned key in the numbers' order (negative ones all bits flipped, the rest the sign bit). */
static uint64_t order_key(double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    return (u >> 63) ? ~u : (u | (UINT64_C(1) << 63));
}

static double from_key(uint64_t k) {
    uint64_t u = (k >> 63) ? (k & ~(UINT64_C(1) << 63)) : ~k;
    double x;
    memcpy(&x, &u, 8);
    return x;
}

/* An array of doubles, sorted, as the bytes of an array('d'): a radix sort of their bits, six digits of 11 bits (count
 * tables that stay in the L2 cache, all six counted in one pass over the keys), a digit all keys share skipped (times
 * of one trace share their top bits): host activity's million times, where Python's sort needs a float object for each
 * first. NaN is not a time here. */
#define DIGIT_BITS 11
#define DIGITS 6
#define BUCKETS (1 << DIGIT_BITS)
static PyObject *sorted_times(PyObject *self, PyObject *arg) {
    (void)self;
    Columns cs = {.held = 0};
    const void *buf;
    Py_ssize_t n;
    if (column(&cs, arg, 'd', sizeof(double), -1, &buf, &n)) {
        columns_release(&cs);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(double));
    uint64_t *keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    uint64_t *tmp = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (!out || !keys || !tmp) {
        Py_CLEAR(out);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    const double *v = buf;
    if ((uint64_t)n >= UINT32_MAX) { /* the counts are 32-bit */
        PyErr_SetString(PyExc_ValueError, "too many times to sort");
        Py_CLEAR(out);
        goto done;
    }
    uint32_t(*counts)[BUCKETS] = PyMem_Calloc(DIGITS, sizeof *counts);
    if (!counts) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = keys[i] = order_key(v[i]);
        for (int d = 0; d < DIGITS; d++) counts[d][(k >> (d * DIGIT_BITS)) & (BUCKETS - 1)]++;
    }
    for (int d = 0; d < DIGITS; d++) {
        int shift = d * DIGIT_BITS;
        uint32_t *count = counts[d];
        if (n && count[(keys[0] >> shift) & (BUCKETS - 1)] == (uint32_t)n) continue; /* every key has this digit */
        uint32_t sum = 0;
        for (size_t b = 0; b < BUCKETS; b++) {
            uint32_t c = count[b];
            count[b] = sum;
            sum += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) tmp[count[(keys[i] >> shift) & (BUCKETS - 1)]++] = keys[i];
        uint64_t *swap = keys;
        keys = tmp;
        tmp = swap;
    }
    PyMem_Free(counts);
    double *dst = (double *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = from_key(keys[i]);
done:
    PyMem_Free(keys);
    PyMem_Free(tmp);
    columns_release(&cs);
    return out;
}

/* --- the sweep, the unions and the kernel sums ---------------------------------------------------------------- */

/* A list of GPU op indices (order, selected, kernels), each checked against the columns' length n; NULL with an
 * exception set. */
static Py_ssize_t *indices(PyObject *list, Py_ssize_t n, Py_ssize_t *len) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "expected a list of GPU op indices");
        return NULL;
    }
    Py_ssize_t m = PyList_GET_SIZE(list);
    Py_ssize_t *out = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m ? m : 1));
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(list, k));
        if (i == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            return NULL;
        }
        if (i < 0 || i >= n) {
            PyMem_Free(out);
            PyErr_SetString(PyExc_IndexError, "GPU op index out of range");
            return NULL;
        }
        out[k] = i;
    }
    *len = m;
    return out;
}

/* Per stream, a sum in the order the streams first appear (a dict's order): an open-addressing table over the
 * stream ids, so a trace of many streams stays linear. */
typedef struct {
    long long *ids;
    double *sums;
    Py_ssize_t *slot; /* hash slot -> index into ids/sums, -1: empty */
    Py_ssize_t n, cap, mask;
} StreamSums;

static int streams_add(StreamSums *s, long long id, double us) {
    if (s->n * 2 >= s->mask + 1 || !s->slot) { /* grow (and first use): keep the table under half full */
        Py_ssize_t size = s->slot ? (s->mask + 1) * 2 : 64;
        Py_ssize_t *slot = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)size);
        long long *ids = PyMem_Realloc(s->ids, sizeof(long long) * (size_t)size);
        if (ids) s->ids = ids;
        double *sums = ids ? PyMem_Realloc(s->sums, sizeof(double) * (size_t)size) : NULL;
        if (sums) s->sums = sums;
        if (!slot || !ids || !sums) {
            PyMem_Free(slot);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t k = 0; k < size; k++) slot[k] = -1;
        for (Py_ssize_t k = 0; k < s->n; k++) {
            size_t h = (size_t)((unsigned long long)s->ids[k] * 0x9E3779B97F4A7C15ULL) & (size_t)(size - 1);
            while (slot[h] >= 0) h = (h + 1) & (size_t)(size - 1);
            slot[h] = k;
        }
        PyMem_Free(s->slot);
        s->slot = slot;
        s->mask = size - 1;
    }
    size_t h = (size_t)((unsigned long long)id * 0x9E3779B97F4A7C15ULL) & (size_t)s->mask;
    while (s->slot[h] >= 0) {
        Py_ssize_t k = s->slot[h];
        if (s->ids[k] == id) {
            s->sums[k] = s->sums[k] + us;
            return 0;
        }
        h = (h + 1) & (size_t)s->mask;
    }
    s->slot[h] = s->n;
    s->ids[s->n] = id;
    s->sums[s->n] = 0.0 + us; /* streams.get(st, 0.0) + (e - s) */
    s->n++;
    return 0;
}

static PyObject *op_or_none(Py_ssize_t i) {
    if (i < 0) Py_RETURN_NONE;
    return PyLong_FromSsize_t(i);
}

/* list.append(x) and d[k] = v, taking the new references given (NULL: a failed allocation); -1 with an exception. */
static int append_new(PyObject *list, PyObject *x) {
    int bad = !x || PyList_Append(list, x);
    Py_XDECREF(x);
    return bad ? -1 : 0;
}

static int set_new(PyObject *dict, PyObject *k, PyObject *v) {
    int bad = !k || !v || PyDict_SetItem(dict, k, v);
    Py_XDECREF(k);
    Py_XDECREF(v);
    return bad ? -1 : 0;
}

/* timeline._sweep */
static PyObject *sweep(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *order_o, *ts_o, *dur_o, *stream_o;
    double w0, w1;
    if (!PyArg_ParseTuple(args, "OOOOdd:sweep", &order_o, &ts_o, &dur_o, &stream_o, &w0, &w1)) return NULL;
    Columns cs = {.held = 0};
    const void *ts_b, *dur_b, *stream_b;
    Py_ssize_t n_gpu, m = 0;
    Py_ssize_t *order = NULL;
    StreamSums st = {0};
    PyObject *gaps = NULL, *streams = NULL, *out = NULL;
    if (column(&cs, ts_o, 'd', sizeof(double), -1, &ts_b, &n_gpu) ||
        column(&cs, dur_o, 'd', sizeof(double), n_gpu, &dur_b, &n_gpu) ||
        column(&cs, stream_o, 'q', sizeof(long long), n_gpu, &stream_b, &n_gpu))
        goto done;
    if (!(order = indices(order_o, n_gpu, &m))) goto done;
    const double *g_ts = ts_b, *g_dur = dur_b;
    const long long *g_stream = stream_b;
    if (!(gaps = PyList_New(0))) goto done;
    double busy = 0.0, cur_end = w0;
    Py_ssize_t prev_op = -1, n = 0;
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = order[k];
        double s = g_ts[i], e = s + g_dur[i];
        if (e <= w0 || s >= w1) continue;
        n++;
        if (s < w0) s = w0;
        if (e > w1) e = w1;
        if (streams_add(&st, g_stream[i], e - s)) goto done;
        if (s > cur_end) {
            if (append_new(gaps, Py_BuildValue("(ddNN)", cur_end, s, op_or_none(i), op_or_none(prev_op))))
                goto done;
            busy += e - s;
            cur_end = e;
            prev_op = i;
        } else if (e > cur_end) {
            busy += e - cur_end;
            cur_end = e;
            prev_op = i;
        }
    }
    if (cur_end < w1) {
        if (append_new(gaps, Py_BuildValue("(ddON)", cur_end, w1, Py_None, op_or_none(prev_op)))) goto done;
    }
    if (!(streams = PyDict_New())) goto done;
    for (Py_ssize_t k = 0; k < st.n; k++)
        if (set_new(streams, PyLong_FromLongLong(st.ids[k]), PyFloat_FromDouble(st.sums[k]))) goto done;
    out = Py_BuildValue("(OndO)", gaps, n, busy, streams);
done:
    Py_XDECREF(gaps);
    Py_XDECREF(streams);
    PyMem_Free(order);
    PyMem_Free(st.ids);
    PyMem_Free(st.sums);
    PyMem_Free(st.slot);
    columns_release(&cs);
    return out;
}

typedef struct {
    double *v; /* start, end pairs */
    Py_ssize_t n, cap;
} Runs;

/* kernels.comm_overlap_us' runs: a kernel that starts by the last run's end extends it, else starts a new one. */
static int runs_add(Runs *r, double s, double e) {
    if (r->n && s <= r->v[2 * r->n - 1]) {
        if (e > r->v[2 * r->n - 1]) r->v[2 * r->n - 1] = e;
        return 0;
    }
    if (r->n == r->cap) {
        Py_ssize_t cap = r->cap ? r->cap * 2 : 256;
        double *v = PyMem_Realloc(r->v, sizeof(double) * 2 * (size_t)cap);
        if (!v) {
            PyErr_NoMemory();
            return -1;
        }
        r->v = v;
        r->cap = cap;
    }
    r->v[2 * r->n] = s;
    r->v[2 * r->n + 1] = e;
    r->n++;
    return 0;
}

/* kernels.compute_union_us and kernels.comm_overlap_us in one pass: (compute, communication, communication
 * overlapped by compute). */
static PyObject *unions(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *order_o, *ts_o, *dur_o, *kind_o, *name_o, *comm_o;
    double w0, w1;
    int kernel_kind;
    if (!PyArg_ParseTuple(args, "OOOOOOddi:unions", &order_o, &ts_o, &dur_o, &kind_o, &name_o, &comm_o, &w0, &w1,
                          &kernel_kind))
        return NULL;
    Columns cs = {.held = 0};
    const void *ts_b, *dur_b, *kind_b, *name_b, *comm_b;
    Py_ssize_t n_gpu, n_names, m = 0;
    Py_ssize_t *order = NULL;
    Runs comm = {0}, comp = {0};
    PyObject *out = NULL;
    if (column(&cs, ts_o, 'd', sizeof(double), -1, &ts_b, &n_gpu) ||
        column(&cs, dur_o, 'd', sizeof(double), n_gpu, &dur_b, &n_gpu) ||
        column(&cs, kind_o, 'b', 1, n_gpu, &kind_b, &n_gpu) ||
        column(&cs, name_o, 'i', sizeof(int), n_gpu, &name_b, &n_gpu) ||
        column(&cs, comm_o, 'B', 1, -1, &comm_b, &n_names))
        goto done;
    if (!(order = indices(order_o, n_gpu, &m))) goto done;
    const double *g_ts = ts_b, *g_dur = dur_b;
    const signed char *g_kind = kind_b;
    const int *g_name = name_b;
    const unsigned char *is_comm = comm_b;
    double total = 0.0, cur_s = w0, cur_e = w0;
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = order[k];
        if (g_kind[i] != kernel_kind) continue;
        int nid = g_name[i];
        if (nid < 0 || nid >= n_names) {
            PyErr_SetString(PyExc_IndexError, "name id out of range");
            goto done;
        }
        double s = g_ts[i], e = s + g_dur[i];
        if (e <= w0 || s >= w1) continue;
        if (s < w0) s = w0;
        if (e > w1) e = w1;
        if (is_comm[nid]) {
            if (runs_add(&comm, s, e)) goto done;
            continue;
        }
        if (runs_add(&comp, s, e)) goto done;
        if (s > cur_e) { /* compute_union_us, as it adds */
            total += cur_e - cur_s;
            cur_s = s;
            cur_e = e;
        } else if (e > cur_e) {
            cur_e = e;
        }
    }
    double comm_total = 0.0, overlap = 0.0;
    Py_ssize_t j = 0;
    for (Py_ssize_t r = 0; r < comm.n; r++) comm_total += comm.v[2 * r + 1] - comm.v[2 * r];
    for (Py_ssize_t r = 0; r < comm.n; r++) {
        double s = comm.v[2 * r], e = comm.v[2 * r + 1];
        while (j < comp.n && comp.v[2 * j + 1] <= s) j++;
        for (Py_ssize_t q = j; q < comp.n && comp.v[2 * q] < e; q++) {
            double hi = e < comp.v[2 * q + 1] ? e : comp.v[2 * q + 1];
            double lo = s > comp.v[2 * q] ? s : comp.v[2 * q];
            overlap += hi - lo;
        }
    }
    out = Py_BuildValue("(ddd)", total + (cur_e - cur_s), comm_total, overlap);
done:
    PyMem_Free(order);
    PyMem_Free(comm.v);
    PyMem_Free(comp.v);
    columns_release(&cs);
    return out;
}

/* kernels.kernel_stats' sums per name: {name id: [µs, count, kind of its first op]} in the order the names first
 * appear, each name's time added in the ops' order (the same sums as the Python's loop). */
static PyObject *per_name(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *selected_o, *name_o, *dur_o, *kind_o;
    Py_ssize_t n_names;
    if (!PyArg_ParseTuple(args, "OOOOn:per_name", &selected_o, &name_o, &dur_o, &kind_o, &n_names)) return NULL;
    Columns cs = {.held = 0};
    const void *name_b, *dur_b, *kind_b;
    Py_ssize_t n_gpu, m = 0, seen = 0;
    Py_ssize_t *sel = NULL, *first = NULL, *count = NULL;
    double *us = NULL;
    signed char *kind = NULL;
    PyObject *out = NULL, *dict = NULL;
    if (column(&cs, name_o, 'i', sizeof(int), -1, &name_b, &n_gpu) ||
        column(&cs, dur_o, 'd', sizeof(double), n_gpu, &dur_b, &n_gpu) ||
        column(&cs, kind_o, 'b', 1, n_gpu, &kind_b, &n_gpu))
        goto done;
    if (n_names < 0) {
        PyErr_SetString(PyExc_ValueError, "negative number of names");
        goto done;
    }
    if (!(sel = indices(selected_o, n_gpu, &m))) goto done;
    const int *g_name = name_b;
    const double *g_dur = dur_b;
    const signed char *g_kind = kind_b;
    size_t size = (size_t)(n_names ? n_names : 1);
    first = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    count = PyMem_Calloc(size, sizeof(Py_ssize_t));
    us = PyMem_Malloc(sizeof(double) * size);
    kind = PyMem_Malloc(size);
    if (!first || !count || !us || !kind) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = sel[k];
        int nid = g_name[i];
        if (nid < 0 || nid >= n_names) {
            PyErr_SetString(PyExc_IndexError, "name id out of range");
            goto done;
        }
        if (count[nid]++ == 0) {
            first[seen++] = nid;
            us[nid] = g_dur[i];
            kind[nid] = g_kind[i];
        } else {
            us[nid] += g_dur[i];
        }
    }
    if (!(dict = PyDict_New())) goto done;
    for (Py_ssize_t k = 0; k < seen; k++) {
        Py_ssize_t nid = first[k];
        if (set_new(dict, PyLong_FromSsize_t(nid), Py_BuildValue("[dni]", us[nid], count[nid], (int)kind[nid])))
            goto done;
    }
    out = dict;
    dict = NULL;
done:
    Py_XDECREF(dict);
    PyMem_Free(sel);
    PyMem_Free(first);
    PyMem_Free(count);
    PyMem_Free(us);
    PyMem_Free(kind);
    columns_release(&cs);
    return out;
}

/* of_gpu[i] as an index into the runtime columns (-1: None); -2 with an exception set. */
static Py_ssize_t launch_index(PyObject *of_gpu, Py_ssize_t i, Py_ssize_t n_rt) {
    Py_ssize_t li = op_index(PyList_GET_ITEM(of_gpu, i));
    if (li >= n_rt) {
        PyErr_SetString(PyExc_IndexError, "launch call index out of range");
        return -2;
    }
    return li;
}

static int cmp_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* kernels._graph_kernels: the kernels (in their order) launched by a graph launch call, carrying a graph id, or
 * sharing a correlation id (>= 0) with another of these kernels. */
static PyObject *graph_kernels(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *kernels_o, *corr_o, *graph_o, *of_gpu, *r_kind_o;
    int graph_kind;
    if (!PyArg_ParseTuple(args, "OOOO!Oi:graph_kernels", &kernels_o, &corr_o, &graph_o, &PyList_Type, &of_gpu,
                          &r_kind_o, &graph_kind))
        return NULL;
    Columns cs = {.held = 0};
    const void *corr_b, *graph_b, *r_kind_b;
    Py_ssize_t n_gpu, n_rt, m = 0, n_shared = 0;
    Py_ssize_t *ks = NULL;
    long long *shared = NULL;
    PyObject *out = NULL, *list = NULL;
    if (column(&cs, corr_o, 'q', sizeof(long long), -1, &corr_b, &n_gpu) ||
        column(&cs, graph_o, 'q', sizeof(long long), n_gpu, &graph_b, &n_gpu) ||
        column(&cs, r_kind_o, 'b', 1, -1, &r_kind_b, &n_rt))
        goto done;
    if (PyList_GET_SIZE(of_gpu) != n_gpu) {
        PyErr_SetString(PyExc_ValueError, "of_gpu and the GPU columns differ in length");
        goto done;
    }
    if (!(ks = indices(kernels_o, n_gpu, &m))) goto done;
    const long long *g_corr = corr_b, *g_graph = graph_b;
    const signed char *r_kind = r_kind_b;
    /* the correlation ids that repeat: sorted, each kept once */
    if (!(shared = PyMem_Malloc(sizeof(long long) * (size_t)(m ? m : 1)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < m; k++) shared[k] = g_corr[ks[k]];
    qsort(shared, (size_t)m, sizeof(long long), cmp_ll);
    for (Py_ssize_t k = 0; k < m;) {
        Py_ssize_t e = k + 1;
        while (e < m && shared[e] == shared[k]) e++;
        if (e - k > 1 && shared[k] >= 0) shared[n_shared++] = shared[k];
        k = e;
    }
    if (!(list = PyList_New(0))) goto done;
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = ks[k];
        int in = g_graph[i] >= 0;
        if (!in && n_shared) {
            long long c = g_corr[i];
            Py_ssize_t lo = 0, hi = n_shared;
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (shared[mid] < c) lo = mid + 1;
                else hi = mid;
            }
            in = lo < n_shared && shared[lo] == c;
        }
        if (!in) {
            Py_ssize_t li = launch_index(of_gpu, i, n_rt);
            if (li == -2) goto done;
            in = li >= 0 && r_kind[li] == graph_kind;
        }
        if (in && append_new(list, PyLong_FromSsize_t(i))) goto done;
    }
    out = list;
    list = NULL;
done:
    Py_XDECREF(list);
    PyMem_Free(ks);
    PyMem_Free(shared);
    columns_release(&cs);
    return out;
}

/* kernels.kernel_stats' launch statistics: (ops without a launch call, each single launch's call time, its delay
 * from the call's return to the kernel's start (0 if none), kernels shorter than their call), over the kernels of
 * `selected` launched one by one (a kernel launch call, not in a graph replay). */
static PyObject *launch_stats(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *selected_o, *of_gpu, *kind_o, *in_graph_o, *r_kind_o, *ts_o, *dur_o, *r_ts_o, *r_dur_o;
    int kernel_kind, launch_kind;
    if (!PyArg_ParseTuple(args, "OO!OOOOOOOii:launch_stats", &selected_o, &PyList_Type, &of_gpu, &kind_o,
                          &in_graph_o, &r_kind_o, &ts_o, &dur_o, &r_ts_o, &r_dur_o, &kernel_kind, &launch_kind))
        return NULL;
    Columns cs = {.held = 0};
    const void *kind_b, *in_graph_b, *r_kind_b, *ts_b, *dur_b, *r_ts_b, *r_dur_b;
    Py_ssize_t n_gpu, n_rt, m = 0, unlaunched = 0, shorter = 0;
    Py_ssize_t *sel = NULL;
    PyObject *out = NULL, *calls = NULL, *delays = NULL;
    if (column(&cs, kind_o, 'b', 1, -1, &kind_b, &n_gpu) ||
        column(&cs, in_graph_o, 'B', 1, n_gpu, &in_graph_b, &n_gpu) ||
        column(&cs, ts_o, 'd', sizeof(double), n_gpu, &ts_b, &n_gpu) ||
        column(&cs, dur_o, 'd', sizeof(double), n_gpu, &dur_b, &n_gpu) ||
        column(&cs, r_kind_o, 'b', 1, -1, &r_kind_b, &n_rt) ||
        column(&cs, r_ts_o, 'd', sizeof(double), n_rt, &r_ts_b, &n_rt) ||
        column(&cs, r_dur_o, 'd', sizeof(double), n_rt, &r_dur_b, &n_rt))
        goto done;
    if (PyList_GET_SIZE(of_gpu) != n_gpu) {
        PyErr_SetString(PyExc_ValueError, "of_gpu and the GPU columns differ in length");
        goto done;
    }
    if (!(sel = indices(selected_o, n_gpu, &m))) goto done;
    const signed char *g_kind = kind_b, *r_kind = r_kind_b;
    const unsigned char *in_graph = in_graph_b;
    const double *g_ts = ts_b, *g_dur = dur_b, *r_ts = r_ts_b, *r_dur = r_dur_b;
    if (!(calls = PyList_New(0)) || !(delays = PyList_New(0))) goto done;
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = sel[k];
        Py_ssize_t li = launch_index(of_gpu, i, n_rt);
        if (li == -2) goto done;
        if (li < 0) {
            unlaunched++;
            continue;
        }
        if (g_kind[i] != kernel_kind || in_graph[i] || r_kind[li] != launch_kind) continue;
        double delay = g_ts[i] - r_ts[li] - r_dur[li];
        if (append_new(calls, PyFloat_FromDouble(r_dur[li]))
            || append_new(delays, PyFloat_FromDouble(delay > 0.0 ? delay : 0.0)))
            goto done;
        shorter += g_dur[i] < r_dur[li];
    }
    out = Py_BuildValue("(nOOn)", unlaunched, calls, delays, shorter);
done:
    Py_XDECREF(calls);
    Py_XDECREF(delays);
    PyMem_Free(sel);
    columns_release(&cs);
    return out;
}

static PyMethodDef METHODS[] = {
    {"gap_causes", gap_causes, METH_VARARGS,
     "gap_causes(gaps, sync_start, sync_end_max, gpu_sync_start, gpu_sync_end_max, of_gpu, g_name, r_ts, r_dur, "
     "pageable_htod, to_host, host_events) -> (causes, idle_us by cause, gaps by cause, unattributed_us): "
     "timeline._GapCauses over every gap of a device, with timeline._host_sync_flags."},
    {"idle_inside", idle_inside, METH_VARARGS,
     "idle_inside(gap_starts, gap_ends, op_names, op_starts, op_ends, n_names) -> [(name id, us), ...]: "
     "timeline.idle_inside_ops over ops sorted by start (their names as ids), in the order names enter its result."},
    {"sorted_times", sorted_times, METH_O,
     "sorted_times(times: array('d')) -> bytes: the times sorted, as an array('d')'s bytes."},
    {"sweep", sweep, METH_VARARGS,
     "sweep(order, g_ts, g_dur, g_stream, w0, w1) -> (gaps, ops, busy_us, busy_us_by_stream): timeline._sweep."},
    {"unions", unions, METH_VARARGS,
     "unions(order, g_ts, g_dur, g_kind, g_name, is_comm, w0, w1, kernel_kind) -> (compute_us, comm_us, "
     "overlapped_us): kernels.compute_union_us and kernels.comm_overlap_us in one pass."},
    {"per_name", per_name, METH_VARARGS,
     "per_name(selected, g_name, g_dur, g_kind, n_names) -> {name id: [us, count, kind]}: kernels.kernel_stats' "
     "sums per name, in the order names first appear."},
    {"graph_kernels", graph_kernels, METH_VARARGS,
     "graph_kernels(kernels, g_corr, g_graph, of_gpu, r_kind, graph_kind) -> [op, ...]: kernels._graph_kernels, "
     "in the kernels' order."},
    {"launch_stats", launch_stats, METH_VARARGS,
     "launch_stats(selected, of_gpu, g_kind, in_graph, r_kind, g_ts, g_dur, r_ts, r_dur, kernel_kind, "
     "launch_kind) -> (unlaunched, call_us, delay_us, short_kernels): kernels.kernel_stats' launch statistics."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_gaps", "The GPU analysis' loops over every op.", -1,
                                    METHODS};

PyMODINIT_FUNC PyInit__gaps(void) {
    PyObject *m = PyModule_Create(&MODULE);
    if (!m) return NULL;
    PyObject *names = PyTuple_New(N_CAUSES);
    if (!names) goto fail;
    for (int i = 0; i < N_CAUSES; i++) {
        CAUSES[i] = PyUnicode_InternFromString(CAUSE_NAMES[i]);
        if (!CAUSES[i]) {
            Py_DECREF(names);
            goto fail;
        }
        Py_INCREF(CAUSES[i]);
        PyTuple_SET_ITEM(names, i, CAUSES[i]);
    }
    if (PyModule_AddObject(m, "CAUSES", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    PyObject *consts = Py_BuildValue("{s:d,s:d,s:d,s:d}", "KERNEL_OVERHEAD_US", KERNEL_OVERHEAD_US,
                                     "QUEUE_DRY_MIN_US", QUEUE_DRY_MIN_US, "HOST_BUSY_FRAC", HOST_BUSY_FRAC,
                                     "SYNC_SLACK_US", SYNC_SLACK_US);
    if (!consts || PyModule_AddObject(m, "CONSTANTS", consts) < 0) {
        Py_XDECREF(consts);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

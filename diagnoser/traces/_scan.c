/* The fast reader of a chunk of Kineto trace events: one pass over the JSON text, straight into columns.
 *
 * Why: the typed decode (msgspec) builds an object per event and the columns are then made from those objects in
 * Python; on a trace of millions of events that was 2-3x the decode alone (benchmarks/TRACES.md). Here the bytes of
 * a chunk (a JSON list of whole events as decode.raw_chunks cuts them, or a range of a mapped file without the
 * brackets) are read once and the columns the analysis needs come out as packed arrays; the few events read for
 * more than columns (annotations, the profiler's span) come back as byte offsets for the typed decode.
 *
 * Exactness: this reader answers only for the plain case, and says "not plain" (returns None) for anything else, so
 * that the chunk is read by the typed decode instead (tables.py). Not plain: text that is not strict JSON; a field of
 * another type than decode.Event/decode.Args declare; a key written with an escape; a string with a byte that is
 * not UTF-8; a number that is not an int64 literal (or a string of one, which lax mode reads as the int) where an
 * int is declared; a negative, huge or null time; a thread id that is not an int, a phase other than "X" or a
 * missing time on a CPU op, runtime call or GPU activity; a complete cuda_sync record without its times; a launch
 * or wait without a correlation; a GPU activity without args holding an int device and stream; a name, sync kind or
 * collective with an escape; nesting past 64 levels; a declared key twice in one object. What the typed decode
 * would read the same way is read here; what it would read otherwise (another coercion of lax mode, a skipped
 * event, damage) is left to it. tests/test_trace_scan.py holds the columns of both readers equal on every public
 * trace and on random chunks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
/* The bit scans and SSE2: GCC and Clang spell them __builtin_ctz and __SSE2__; MSVC has _BitScanForward in <intrin.h>
 * and SSE2 on every x64 target (and on x86 built with /arch:SSE2, _M_IX86_FP >= 2) without defining __SSE2__. */
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static __forceinline int ctz32(unsigned x) {  /* x != 0 */
    unsigned long i;
    _BitScanForward(&i, x);
    return (int)i;
}
static __forceinline int ctz64(uint64_t x) {  /* x != 0 */
    unsigned long i;
#if defined(_M_X64) || defined(_M_ARM64)
    _BitScanForward64(&i, x);
    return (int)i;
#else
    if ((uint32_t)x) {
        _BitScanForward(&i, (uint32_t)x);
        return (int)i;
    }
    _BitScanForward(&i, (uint32_t)(x >> 32));
    return (int)i + 32;
#endif
}
#if defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#define SCAN_SSE2 1
#endif
#else
#define ctz32(x) __builtin_ctz(x)
#define ctz64(x) __builtin_ctzll(x)
#if defined(__SSE2__)
#define SCAN_SSE2 1
#endif
#endif
#if defined(SCAN_SSE2)
#include <emmintrin.h>
#endif

#define MAX_DEPTH 64

/* categories */
enum { C_DROP = 0, C_CPU, C_RT, C_GPU, C_SYNC, C_REST };

typedef struct {
    char *p;
    Py_ssize_t n, cap, size;
} Buf;

static int buf_grow(Buf *b) {
    Py_ssize_t cap = b->cap ? b->cap * 2 : 1024;
    if (cap > PY_SSIZE_T_MAX / b->size) {
        PyErr_NoMemory();
        return -1;
    }
    char *p = (char *)realloc(b->p, (size_t)(cap * b->size));
    if (!p) {
        PyErr_NoMemory();  /* a MemoryError, not a NULL without an exception (SystemError) */
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int buf_push(Buf *b, const void *v) {
    if (b->n == b->cap && buf_grow(b) < 0) return -1;
    char *dst = b->p + b->n * b->size;
    switch (b->size) {  /* a fixed-size copy each: a store, not a call */
    case 8: memcpy(dst, v, 8); break;
    case 4: memcpy(dst, v, 4); break;
    default: *dst = *(const char *)v; break;
    }
    b->n++;
    return 0;
}

static PyObject *buf_bytes(Buf *b) { return PyBytes_FromStringAndSize(b->p ? b->p : "", b->n * b->size); }

/* --- the chunk's names, interned by their raw bytes ------------------------------------------------------------ */

typedef struct {
    const char *key;
    Py_ssize_t len;
    uint64_t hash;
    int32_t idx;
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t mask, used;
    PyObject *names;   /* list of str, in order of first sight */
    Buf cpu_count;     /* int64 per name: CPU ops of that name */
    Buf rt_count;      /* int64 per name: runtime calls of that name */
    Buf rt_kind;       /* int8 per name: the runtime kind (-1: not looked up) */
    Buf interest;      /* int8 per name: the caller's interest in CPU ops of that name (-1: not asked yet) */
    Buf sync_cls;      /* int8 per name, as a cuda_sync kind: 2 a host wait, 1 a stream wait, 0 neither (-1: not looked up) */
    Buf seen;          /* int8 per name: first sight noted, a bit per order: 1 launches, 2 GPU, 4 CPU ops, 8 runtime */
} Names;

static uint64_t hash_bytes(const char *s, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, s + i, (size_t)(n - i));
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

static int names_grow(Names *t) {
    Py_ssize_t cap = (t->mask + 1) * 2;
    Slot *s = (Slot *)calloc((size_t)cap, sizeof(Slot));
    if (!s) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i <= t->mask; i++) {
        if (!t->slots[i].key) continue;
        Py_ssize_t j = (Py_ssize_t)(t->slots[i].hash & (uint64_t)(cap - 1));
        while (s[j].key) j = (j + 1) & (cap - 1);
        s[j] = t->slots[i];
    }
    free(t->slots);
    t->slots = s;
    t->mask = cap - 1;
    return 0;
}

/* The chunk-local index of a name given by its raw bytes (no escapes); -1 on error (not UTF-8, no memory): -2. */
static int32_t names_get(Names *t, const char *s, Py_ssize_t n) {
    uint64_t h = hash_bytes(s, n);
    Py_ssize_t j = (Py_ssize_t)(h & (uint64_t)t->mask);
    while (t->slots[j].key) {
        Slot *sl = &t->slots[j];
        if (sl->hash == h && sl->len == n && memcmp(sl->key, s, (size_t)n) == 0) return sl->idx;
        j = (j + 1) & t->mask;
    }
    PyObject *str = PyUnicode_DecodeUTF8(s, n, NULL);
    if (!str) {
        PyErr_Clear();
        return -1;
    }
    int32_t idx = (int32_t)PyList_GET_SIZE(t->names);
    int rc = PyList_Append(t->names, str);
    Py_DECREF(str);
    int64_t zero = 0;
    int8_t minus = -1, none = 0;
    if (rc < 0 || buf_push(&t->cpu_count, &zero) || buf_push(&t->rt_count, &zero) || buf_push(&t->rt_kind, &minus)
        || buf_push(&t->interest, &minus) || buf_push(&t->sync_cls, &minus) || buf_push(&t->seen, &none))
        return -2;
    t->slots[j].key = s;
    t->slots[j].len = n;
    t->slots[j].hash = h;
    t->slots[j].idx = idx;
    if (++t->used * 2 > t->mask + 1 && names_grow(t) < 0) return -2;
    return idx;
}

/* --- the JSON grammar -------------------------------------------------------------------------------------------- */

typedef struct {
    const char *p, *end;
    int bad;  /* set when the text is not plain: the caller answers None */
} Cur;

static inline void ws(Cur *c) {
    const char *p = c->p, *end = c->end;
    if (p < end && *p == ' ') p++; /* Kineto writes one space after each ':' and ',' */
    if (p < end && (unsigned char)*p > ' ') { /* and then no more: no whitespace is above the space */
        c->p = p;
        return;
    }
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    c->p = p;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

/* Whether one of 8 bytes is '"', '\\', a control character or non-ASCII (a false yes only after a true one). */
static inline uint64_t special8(uint64_t v) {
    uint64_t q = v ^ (ONES * '"'), b = v ^ (ONES * '\\');
    return (((q - ONES) & ~q) | ((b - ONES) & ~b) | (v - ONES * 0x20) | v) & HIGHS;
}

/* One UTF-8 sequence at s (non-ASCII lead byte): its length, 0 when it is not UTF-8. */
static int utf8_seq(const unsigned char *s, const unsigned char *e) {
    unsigned char b = *s;
    int n;
    uint32_t cp;
    if (b >= 0xC2 && b <= 0xDF) { n = 1; cp = b & 0x1F; }
    else if (b >= 0xE0 && b <= 0xEF) { n = 2; cp = b & 0x0F; }
    else if (b >= 0xF0 && b <= 0xF4) { n = 3; cp = b & 0x07; }
    else return 0;
    if (e - s <= n) return 0;
    for (int i = 1; i <= n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
        return 0;
    return n + 1;
}

#if defined(SCAN_SSE2)
/* Which of the 16 bytes at p are '"', '\\', or below 0x20 as a signed char (a control character, or non-ASCII): a bit
 * each, the first byte lowest. */
static inline int special16(const char *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')),
                                            _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                               _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));
    return _mm_movemask_epi8(hit);
}
#endif

/* A string at c->p ('"'): its raw content in [*s, *e), whether it holds an escape. Checks the grammar, control
 * characters and UTF-8; escaped surrogates are not plain. */
static int string(Cur *c, const char **s, const char **e, int *escaped) {
    const char *p = c->p + 1, *end = c->end;
    int esc = 0;
    *s = p;
    for (;;) {
#if defined(SCAN_SSE2)
        while (end - p >= 16) {  /* 16 bytes a step */
            int mask = special16(p);
            if (mask) {
                p += ctz32((unsigned)mask);
                goto found;  /* (not through the 8-byte loop below, which would find it again) */
            }
            p += 16;
        }
#endif
        while (end - p >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            uint64_t hit = special8(w);
            if (hit) {  /* the lowest flagged byte is a true one (little-endian: the first in the text) */
                p += ctz64(hit) >> 3;
                break;
            }
            p += 8;
        }
    found:
        if (p >= end) return c->bad = 1, -1;
        unsigned char ch = (unsigned char)*p;
        if (ch == '"') break;
        if (ch >= 0x80) {
            int n = utf8_seq((const unsigned char *)p, (const unsigned char *)end);
            if (!n) return c->bad = 1, -1;
            p += n;
            continue;
        }
        if (ch < 0x20) return c->bad = 1, -1;
        if (ch != '\\') { p++; continue; }
        /* an escape */
        esc = 1;
        if (p + 1 >= end) return c->bad = 1, -1;
        char k = p[1];
        if (k == 'u') {
            if (p + 6 > end) return c->bad = 1, -1;
            int v = 0;
            for (int i = 2; i < 6; i++) {
                int h = hexval(p[i]);
                if (h < 0) return c->bad = 1, -1;
                v = v * 16 + h;
            }
            if (v >= 0xD800 && v <= 0xDFFF) return c->bad = 1, -1;
            p += 6;
        } else if (k == '"' || k == '\\' || k == '/' || k == 'b' || k == 'f' || k == 'n' || k == 'r' || k == 't') {
            p += 2;
        } else {
            return c->bad = 1, -1;
        }
    }
    *e = p;
    *escaped = esc;
    c->p = p + 1;
    return 0;
}

/* A number token: its digits read once, as the grammar is checked. */
typedef struct {
    uint64_t m;  /* the significant digits (wrapped, and unused, past 19) */
    int digits;  /* significant digits (leading zeros left out) */
    int frac;    /* digits after the point */
    int is_int, neg, exp;
} Num;

/* A number token at c->p, in strict JSON grammar. */
static int number(Cur *c, const char **s, Num *num) {
    const char *p = c->p, *end = c->end;
    uint64_t m = 0;
    int digits = 0, frac = 0;
    *s = p;
    num->neg = 0;
    if (p < end && *p == '-') { num->neg = 1; p++; }
    if (p >= end) return c->bad = 1, -1;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') {
        unsigned d;
        while (p < end && (d = (unsigned char)*p - '0') < 10) { /* one test a digit: the readers use m only while */
            m = m * 10 + d;                                       /* digits <= 19 */
            digits++;
            p++;
        }
    } else return c->bad = 1, -1;
    num->is_int = 1;
    num->exp = 0;
    if (p < end && *p == '.') {
        num->is_int = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return c->bad = 1, -1;
        unsigned d;
        while (p < end && (d = (unsigned char)*p - '0') < 10) {
            frac++;
            if (digits || d) { /* leading zeros are not significant */
                m = m * 10 + d;
                digits++;
            }
            p++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        num->is_int = 0;
        num->exp = 1;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return c->bad = 1, -1;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    num->m = m;
    num->digits = digits;
    num->frac = frac;
    c->p = p;
    return 0;
}

static int literal(Cur *c, const char *word, Py_ssize_t n) {
    if (c->end - c->p < n || memcmp(c->p, word, (size_t)n) != 0) return c->bad = 1, -1;
    c->p += n;
    return 0;
}

static int skip_value(Cur *c, int depth);

static int skip_container(Cur *c, int depth, char close) {
    if (depth > MAX_DEPTH) return c->bad = 1, -1;
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == close) { c->p++; return 0; }
    for (;;) {
        if (close == '}') {
            const char *s, *e;
            int esc;
            if (c->p >= c->end || *c->p != '"' || string(c, &s, &e, &esc) < 0) return c->bad = 1, -1;
            ws(c);
            if (c->p >= c->end || *c->p != ':') return c->bad = 1, -1;
            c->p++;
            ws(c);
        }
        if (skip_value(c, depth + 1) < 0) return -1;
        ws(c);
        if (c->p >= c->end) return c->bad = 1, -1;
        if (*c->p == ',') { c->p++; ws(c); continue; }
        if (*c->p == close) { c->p++; return 0; }
        return c->bad = 1, -1;
    }
}

static int skip_value(Cur *c, int depth) {
    if (c->p >= c->end) return c->bad = 1, -1;
    const char *s, *e;
    int flag;
    Num num;
    switch (*c->p) {
    case '"': return string(c, &s, &e, &flag);
    case '{': return skip_container(c, depth, '}');
    case '[': return skip_container(c, depth, ']');
    case 't': return literal(c, "true", 4);
    case 'f': return literal(c, "false", 5);
    case 'n': return literal(c, "null", 4);
    default: return number(c, &s, &num);
    }
}

/* --- typed values ------------------------------------------------------------------------------------------------ */

enum { V_ABSENT = 0, V_NULL, V_INT, V_STR, V_OTHER };

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A non-negative time in microseconds; 0 when plain. Exact: a mantissa up to 2^53 and a power of ten up to 22 give a
 * correctly rounded quotient (Clinger's fast path); other tokens go through Python's own parser. */
static int time_value(Cur *c, double *out) {
    if (c->p >= c->end || *c->p == '-') return c->bad = 1, -1;
    const char *s;
    Num num;
    if (number(c, &s, &num) < 0) return -1;
    if (!num.exp && num.digits <= 19 && num.m <= (1ULL << 53) && num.frac <= 22) {
        double v = (double)num.m;
        *out = num.frac ? v / POW10[num.frac] : v;
        return 0;
    }
    const char *e = c->p;
    char tmp[64];
    if (e - s >= (Py_ssize_t)sizeof tmp) return c->bad = 1, -1;
    memcpy(tmp, s, (size_t)(e - s));
    tmp[e - s] = 0;
    double v = PyOS_string_to_double(tmp, NULL, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return c->bad = 1, -1;
    }
    if (!(v <= 1.7976931348623157e308)) return c->bad = 1, -1; /* inf: the typed decode refuses it */
    *out = v;
    return 0;
}

/* An integer literal of at most 18 digits in [s, e): its value; -1 when it is not one. */
static int int_literal(const char *s, const char *e, int64_t *out) {
    const char *p = s;
    int neg = 0;
    if (p < e && *p == '-') { neg = 1; p++; }
    if (p >= e || e - p > 18 || (*p == '0' && e - p > 1)) return -1;
    int64_t v = 0;
    for (; p < e; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

/* int | null (| str where the field declares it): the kind and an int's value. Where only int is declared, the
 * typed decode's lax mode reads a string holding an integer ("128", HIP's "bytes") as that integer: so does this. */
static int int_value(Cur *c, int64_t *out, int str_ok) {
    if (c->p >= c->end) return c->bad = 1, -1;
    if (*c->p == 'n') return literal(c, "null", 4) < 0 ? -1 : V_NULL;
    const char *s, *e;
    if (*c->p == '"') {
        int esc;
        if (string(c, &s, &e, &esc) < 0) return -1;
        if (str_ok) return V_STR;
        if (esc || int_literal(s, e, out) < 0) return c->bad = 1, -1;
        return V_INT;
    }
    Num num;
    if (number(c, &s, &num) < 0) return -1;
    if (!num.is_int || num.digits > 18) return c->bad = 1, -1;
    *out = num.neg ? -(int64_t)num.m : (int64_t)num.m;
    return V_INT;
}

/* str | null: the kind and, for a string without escapes, its raw span. */
static int str_value(Cur *c, const char **s, const char **e, int *esc) {
    if (c->p >= c->end) return c->bad = 1, -1;
    if (*c->p == 'n') return literal(c, "null", 4) < 0 ? -1 : V_NULL;
    if (*c->p != '"' || string(c, s, e, esc) < 0) return c->bad = 1, -1;
    return V_STR;
}

/* --- one event --------------------------------------------------------------------------------------------------- */

typedef struct {
    const char *ph, *ph_e, *cat, *cat_e, *name, *name_e, *coll, *coll_e, *sync, *sync_e;
    int has_ph, has_cat, has_name, name_esc, ts_set, dur_set, has_args;
    int tid_kind, dev_kind, stream_kind, corr_kind, ext_kind, bytes_kind, graph_kind, coll_kind, coll_esc, dims;
    int pid_kind, sync_kind, sync_esc;
    const char *shape[3], *shape_e[3];  /* Input Dims, Input type, Concrete Inputs: raw JSON, or NULL */
    int64_t pid, tid, dev, stream, corr, ext, nbytes, graph;
    double ts, dur;
} Ev;

#define KEY(lit) (klen == (Py_ssize_t)sizeof(lit) - 1 && memcmp(k, lit, sizeof(lit) - 1) == 0)

static int once(Cur *c, unsigned *seen, unsigned bit) {
    if (*seen & bit) return c->bad = 1, -1;
    *seen |= bit;
    return 0;
}

static int args_member(Cur *c, Ev *ev, const char *k, Py_ssize_t klen, unsigned *seen) {
    int64_t tmp;
    const char *s, *e;
    int esc, kind;
    if (KEY("stream")) {
        if (once(c, seen, 1) < 0 || (kind = int_value(c, &ev->stream, 1)) < 0) return -1;
        ev->stream_kind = kind;
    } else if (KEY("correlation")) {
        if (once(c, seen, 2) < 0 || (kind = int_value(c, &ev->corr, 0)) < 0) return -1;
        ev->corr_kind = kind;
    } else if (KEY("device")) {
        if (once(c, seen, 4) < 0 || (kind = int_value(c, &ev->dev, 0)) < 0) return -1;
        ev->dev_kind = kind;
    } else if (KEY("External id")) {
        if (once(c, seen, 8) < 0 || (kind = int_value(c, &ev->ext, 0)) < 0) return -1;
        ev->ext_kind = kind;
    } else if (KEY("bytes")) {
        if (once(c, seen, 16) < 0 || (kind = int_value(c, &ev->nbytes, 0)) < 0) return -1;
        ev->bytes_kind = kind;
    } else if (KEY("graph id")) {
        if (once(c, seen, 32) < 0 || (kind = int_value(c, &ev->graph, 0)) < 0) return -1;
        ev->graph_kind = kind;
    } else if (KEY("Collective name")) {
        if (once(c, seen, 64) < 0 || (kind = str_value(c, &ev->coll, &ev->coll_e, &ev->coll_esc)) < 0) return -1;
        ev->coll_kind = kind;
    } else if (KEY("wait_on_stream") || KEY("In msg nelems") || KEY("Out msg nelems") || KEY("Group size")) {
        if (once(c, seen, KEY("wait_on_stream") ? 128 : KEY("In msg nelems") ? 256 : KEY("Out msg nelems") ? 512
                 : 1024) < 0 || int_value(c, &tmp, 0) < 0) return -1;
    } else if (KEY("cuda_sync_kind")) {
        if (once(c, seen, 4096) < 0 || (kind = str_value(c, &ev->sync, &ev->sync_e, &ev->sync_esc)) < 0) return -1;
        ev->sync_kind = kind;
    } else if (KEY("dtype")) {
        if (once(c, seen, 2048) < 0 || str_value(c, &s, &e, &esc) < 0) return -1;
    } else if (KEY("Input Dims") || KEY("Input type") || KEY("Concrete Inputs")) {
        /* shapes: kept as the raw JSON of the value (decode.Args keeps them raw too) */
        int which = KEY("Input Dims") ? 0 : KEY("Input type") ? 1 : 2;
        const char *start = c->p;
        if (once(c, seen, 8192u << which) < 0 || skip_value(c, 2) < 0) return -1;
        ev->shape[which] = start;
        ev->shape_e[which] = c->p;
        if (which == 0) ev->dims = 1;
    } else {
        return skip_value(c, 2);
    }
    return 0;
}

typedef int (*Member)(Cur *c, Ev *ev, const char *key, Py_ssize_t klen, unsigned *seen);

/* A key at c->p ('"') of at most 15 plain ASCII bytes, read inline in one 16-byte step: nearly every key is one
 * ("ph", "ts", "args", "External id", ...), about 15 to an event. 0 when it is not, for string() to read. */
static inline int short_key(Cur *c, const char **k, const char **ke) {
#if defined(SCAN_SSE2)
    const char *p = c->p + 1;
    if (c->end - p < 16) return 0;
    int mask = special16(p);
    if (!mask) return 0;
    int i = ctz32((unsigned)mask);
    if (p[i] != '"') return 0; /* an escape, a control character or non-ASCII first: string() decides */
    *k = p;
    *ke = p + i;
    c->p = p + i + 1;
    return 1;
#else
    (void)c, (void)k, (void)ke;
    return 0;
#endif
}

/* The members of the object at c->p ('{'), each handed to `member` by its key (a key with an escape is not plain). */
static int members(Cur *c, Ev *ev, Member member) {
    unsigned seen = 0;
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == '}') { c->p++; return 0; }
    for (;;) {
        const char *k, *ke;
        int esc;
        if (c->p >= c->end || *c->p != '"') return c->bad = 1, -1;
        if (!short_key(c, &k, &ke) && (string(c, &k, &ke, &esc) < 0 || esc)) return c->bad = 1, -1;
        ws(c);
        if (c->p >= c->end || *c->p != ':') return c->bad = 1, -1;
        c->p++;
        ws(c);
        if (member(c, ev, k, ke - k, &seen) < 0) return -1;
        ws(c);
        if (c->p >= c->end) return c->bad = 1, -1;
        if (*c->p == ',') { c->p++; ws(c); continue; }
        if (*c->p == '}') { c->p++; return 0; }
        return c->bad = 1, -1;
    }
}

static int args_object(Cur *c, Ev *ev) {
    if (*c->p == 'n') return literal(c, "null", 4);
    if (*c->p != '{') return c->bad = 1, -1;
    ev->has_args = 1;
    return members(c, ev, args_member);
}

/* pid / tid: int | str | null */
static int id_value(Cur *c, int64_t *out, int *kind) {
    if (c->p >= c->end) return c->bad = 1, -1;
    if (*c->p == '"') {
        const char *s, *e;
        int esc;
        if (string(c, &s, &e, &esc) < 0) return -1;
        *kind = V_STR;
        return 0;
    }
    int k = int_value(c, out, 0);
    if (k < 0) return -1;
    *kind = k;
    return 0;
}

static int event_member(Cur *c, Ev *ev, const char *k, Py_ssize_t klen, unsigned *seen) {
    int esc;
    if (KEY("ph")) {
        if (once(c, seen, 1) < 0 || c->p >= c->end || *c->p != '"' || string(c, &ev->ph, &ev->ph_e, &esc) < 0)
            return c->bad = 1, -1;
        ev->has_ph = 1 + esc;
    } else if (KEY("cat")) {
        if (once(c, seen, 2) < 0 || c->p >= c->end || *c->p != '"' || string(c, &ev->cat, &ev->cat_e, &esc) < 0
            || esc)
            return c->bad = 1, -1;
        ev->has_cat = 1;
    } else if (KEY("name")) {
        if (once(c, seen, 4) < 0 || c->p >= c->end || *c->p != '"'
            || string(c, &ev->name, &ev->name_e, &ev->name_esc) < 0)
            return c->bad = 1, -1;
        ev->has_name = 1;
    } else if (KEY("pid")) {
        if (once(c, seen, 8) < 0 || id_value(c, &ev->pid, &ev->pid_kind) < 0) return -1;
    } else if (KEY("tid")) {
        if (once(c, seen, 16) < 0 || id_value(c, &ev->tid, &ev->tid_kind) < 0) return -1;
    } else if (KEY("ts")) {
        if (once(c, seen, 32) < 0) return -1;
        if (c->p < c->end && *c->p == 'n') return c->bad = 1, -1; /* null: a missing time, the typed path's case */
        if (time_value(c, &ev->ts) < 0) return -1;
        ev->ts_set = 1;
    } else if (KEY("dur")) {
        if (once(c, seen, 64) < 0) return -1;
        if (c->p < c->end && *c->p == 'n') return c->bad = 1, -1;
        if (time_value(c, &ev->dur) < 0) return -1;
        ev->dur_set = 1;
    } else if (KEY("args")) {
        if (once(c, seen, 128) < 0 || c->p >= c->end || args_object(c, ev) < 0) return c->bad = 1, -1;
    } else {
        return skip_value(c, 1);
    }
    return 0;
}

static int event(Cur *c, Ev *ev) {
    memset(ev, 0, sizeof *ev);
    if (c->p >= c->end || *c->p != '{') return c->bad = 1, -1;
    return members(c, ev, event_member);
}

#undef KEY

/* The category of a cat string (decode.Cat's values): where its events go, and a GPU activity's kind. */
static int category(const Ev *ev, int8_t *gpu_kind) {
    if (!ev->has_cat) return C_DROP;
    const char *s = ev->cat;
    Py_ssize_t n = ev->cat_e - ev->cat;
#define IS(lit) (n == (Py_ssize_t)sizeof(lit) - 1 && memcmp(s, lit, sizeof(lit) - 1) == 0)
    if (IS("cpu_op")) return C_CPU;
    if (IS("cuda_runtime") || IS("cuda_driver") || IS("Runtime") || IS("Driver")) return C_RT;
    if (IS("kernel") || IS("Kernel")) { *gpu_kind = 0; return C_GPU; }
    if (IS("gpu_memcpy") || IS("Memcpy")) { *gpu_kind = 1; return C_GPU; }
    if (IS("gpu_memset") || IS("Memset")) { *gpu_kind = 2; return C_GPU; }
    if (IS("python_function") || IS("operator") || IS("Operator") || IS("user_annotation")
        || IS("gpu_user_annotation") || IS("Trace"))
        return C_REST;
    if (IS("cuda_sync")) return C_SYNC;
#undef IS
    return C_DROP;
}

/* --- the chunk --------------------------------------------------------------------------------------------------- */

enum {
    CPU_TID, CPU_TS, CPU_DUR, CPU_END, CPU_NAME, CPU_EXT,
    RT_TID, RT_TS, RT_DUR, RT_END, RT_NAME,
    L_KIND, L_TS, L_DUR, L_TID, L_CORR, L_NAME,
    G_KIND, G_DEV, G_STREAM, G_TS, G_DUR, G_NAME, G_CORR, G_BYTES, G_GRAPH,
    REST_OFF, L_ORDER, G_ORDER, C_ORDER, R_ORDER, PICK_IDX, PICK_FLAG, S_DEV, S_HOST, S_TS, S_DUR, N_BUFS
};

static const Py_ssize_t SIZES[N_BUFS] = {
    8, 8, 8, 8, 4, 8,
    8, 8, 8, 8, 4,
    1, 8, 8, 8, 8, 4,
    1, 4, 8, 8, 8, 4, 8, 8, 8,
    8, 4, 4, 4, 4, 4, 1, 4, 1, 8, 8,
};

typedef struct {
    Buf b[N_BUFS];
    Names names;
    PyObject *cpu_long, *rt_long, *colls, *cpu_colls, *costed, *kinds, *interest, *syncs;
    Py_ssize_t n_events;
    int shapes, n_cpu;
} Chunk;

static int push(Chunk *ch, int which, const void *v) { return buf_push(&ch->b[which], v); }

/* A runtime call's kind from the caller's table (name -> kind), once per name. */
static int rt_kind(Chunk *ch, int32_t idx) {
    int8_t *kinds = (int8_t *)ch->names.rt_kind.p;
    if (kinds[idx] < 0) {
        PyObject *v = PyDict_GetItemWithError(ch->kinds, PyList_GET_ITEM(ch->names.names, idx));
        long k = 0;
        if (v) {
            k = PyLong_AsLong(v);
            if (k == -1 && PyErr_Occurred()) return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
        kinds[idx] = (int8_t)(k != 0 ? (k > 0 && k < 127 ? k : 127) : 0);
    }
    return kinds[idx];
}

/* A collective's CPU op: its "Collective name" (a str, or None), in the order of the ops picked for it. */
static int cpu_collective(Chunk *ch, const Ev *ev) {
    PyObject *v;
    if (ev->coll_kind == V_STR) {
        v = PyUnicode_DecodeUTF8(ev->coll, ev->coll_e - ev->coll, NULL);
        if (!v) return -1;
    } else {
        v = Py_None;
        Py_INCREF(v);
    }
    int rc = PyList_Append(ch->cpu_colls, v);
    Py_DECREF(v);
    return rc;
}

/* An op whose FLOPs can be derived, with its shapes (tables.CostedOp's): (its place among the chunk's CPU ops, its
 * External id or None, Input Dims, Input type, Concrete Inputs as raw JSON bytes, b"" when absent). */
static int cpu_costed(Chunk *ch, const Ev *ev, int32_t k) {
    PyObject *ext = ev->ext_kind == V_INT ? PyLong_FromLongLong(ev->ext) : (Py_INCREF(Py_None), Py_None);
    if (!ext) return -1;
    PyObject *item = Py_BuildValue(
        "(iNy#y#y#)", k, ext, ev->shape[0], (Py_ssize_t)(ev->shape[0] ? ev->shape_e[0] - ev->shape[0] : 0),
        ev->shape[1] ? ev->shape[1] : "", (Py_ssize_t)(ev->shape[1] ? ev->shape_e[1] - ev->shape[1] : 0),
        ev->shape[2] ? ev->shape[2] : "", (Py_ssize_t)(ev->shape[2] ? ev->shape_e[2] - ev->shape[2] : 0));
    if (!item) return -1;
    int rc = PyList_Append(ch->costed, item);
    Py_DECREF(item);
    return rc;
}

/* The caller's interest in CPU ops of a name (interest(name) -> flags), once per name. */
static int cpu_interest(Chunk *ch, int32_t idx) {
    int8_t *flags = (int8_t *)ch->names.interest.p;
    if (flags[idx] < 0) {
        PyObject *v = PyObject_CallOneArg(ch->interest, PyList_GET_ITEM(ch->names.names, idx));
        if (!v) return -1;
        long f = PyLong_AsLong(v);
        Py_DECREF(v);
        if (f == -1 && PyErr_Occurred()) return -1;
        flags[idx] = (int8_t)(f & 0x7F);
    }
    return flags[idx];
}

static int first_sight(Chunk *ch, int32_t idx, int8_t bit, int order) {
    int8_t *seen = (int8_t *)ch->names.seen.p;
    if (seen[idx] & bit) return 0;
    seen[idx] |= bit;
    return push(ch, order, &idx);
}

static int long_op(PyObject *list, Chunk *ch, int32_t idx, double ts, double end) {
    PyObject *t = Py_BuildValue("(Odd)", PyList_GET_ITEM(ch->names.names, idx), ts, end);
    if (!t) return -1;
    int rc = PyList_Append(list, t);
    Py_DECREF(t);
    return rc;
}

/* A cuda_sync record (tables._other's case): kept on the GPU's row when its kind is a host wait or a stream wait. */
static int take_sync(Chunk *ch, const Ev *ev) {
    if (ev->has_ph != 1) return ev->has_ph ? 1 : 0;  /* no phase: not complete, not read; an escaped one: unknown */
    if (ev->ph_e - ev->ph != 1 || *ev->ph != 'X') return 0;
    if (!ev->ts_set || !ev->dur_set || ev->name_esc || ev->sync_esc) return 1;
    const char *k = ev->name, *ke = ev->name_e;
    if (ev->sync_kind == V_STR && ev->sync_e > ev->sync) k = ev->sync, ke = ev->sync_e;
    else if (!ev->has_name) k = ke = "";
    int32_t idx = names_get(&ch->names, k, ke - k);
    if (idx == -1) return 1;
    if (idx == -2) return -1;
    int8_t *cls = (int8_t *)ch->names.sync_cls.p;
    if (cls[idx] < 0) {
        PyObject *v = PyDict_GetItemWithError(ch->syncs, PyList_GET_ITEM(ch->names.names, idx));
        long c = 0;
        if (v) {
            c = PyLong_AsLong(v);
            if (c == -1 && PyErr_Occurred()) return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
        cls[idx] = (int8_t)(c == 1 || c == 2 ? c : 0);
    }
    if (!cls[idx]) return 0;
    int64_t dev = ev->dev_kind == V_INT ? ev->dev : ev->pid_kind == V_INT ? ev->pid : 0;
    if (dev < INT32_MIN || dev > INT32_MAX) return 1;
    int32_t d = (int32_t)dev;
    int8_t host = cls[idx] == 2;
    return push(ch, S_DEV, &d) || push(ch, S_HOST, &host) || push(ch, S_TS, &ev->ts) || push(ch, S_DUR, &ev->dur) ? -1
                                                                                                             : 0;
}

/* 0: taken; 1: not plain; -1: a Python error. */
static int take(Chunk *ch, const Ev *ev, int cat, int8_t gpu_kind, int64_t start, int64_t stop, double long_us) {
    if (cat == C_SYNC) return take_sync(ch, ev);
    if (cat == C_REST) {
        int64_t off[2] = {start, stop};
        return push(ch, REST_OFF, &off[0]) || push(ch, REST_OFF, &off[1]) ? -1 : 0;
    }
    /* a CPU op, runtime call or GPU activity: the typed path's fast case only */
    if (ev->has_ph != 1 || ev->ph_e - ev->ph != 1 || *ev->ph != 'X' || !ev->ts_set || !ev->dur_set || ev->name_esc)
        return 1;
    int32_t idx = ev->has_name ? names_get(&ch->names, ev->name, ev->name_e - ev->name) : names_get(&ch->names, "", 0);
    if (idx == -1) return 1;
    if (idx == -2) return -1;
    double end = ev->ts + ev->dur;
    if (cat == C_GPU) {
        if (!ev->has_args || ev->dev_kind != V_INT || ev->stream_kind != V_INT || ev->dev < INT32_MIN
            || ev->dev > INT32_MAX || ev->coll_esc)
            return 1;
        int32_t dev = (int32_t)ev->dev;
        int64_t none = -1;
        int64_t corr = ev->corr_kind == V_INT ? ev->corr : none;
        if (ev->coll_kind == V_STR && ev->coll_e > ev->coll) {
            PyObject *item = Py_BuildValue("(ns#)", ch->b[G_TS].n, ev->coll, (Py_ssize_t)(ev->coll_e - ev->coll));
            if (!item) { PyErr_Clear(); return 1; }
            int rc = PyList_Append(ch->colls, item);
            Py_DECREF(item);
            if (rc < 0) return -1;
        }
        if (push(ch, G_KIND, &gpu_kind) || push(ch, G_DEV, &dev) || push(ch, G_STREAM, &ev->stream)
            || push(ch, G_TS, &ev->ts) || push(ch, G_DUR, &ev->dur) || push(ch, G_NAME, &idx) || push(ch, G_CORR, &corr)
            || push(ch, G_BYTES, ev->bytes_kind == V_INT ? &ev->nbytes : &none)
            || push(ch, G_GRAPH, ev->graph_kind == V_INT ? &ev->graph : &none) || first_sight(ch, idx, 2, G_ORDER))
            return -1;
        return 0;
    }
    if (ev->tid_kind != V_INT) return 1;
    if (cat == C_CPU) {
        if (push(ch, CPU_TID, &ev->tid) || push(ch, CPU_TS, &ev->ts) || push(ch, CPU_DUR, &ev->dur)
            || push(ch, CPU_END, &end) || push(ch, CPU_NAME, &idx)
            || (ev->ext_kind == V_INT && push(ch, CPU_EXT, &ev->ext)))
            return -1;
        if (first_sight(ch, idx, 4, C_ORDER) < 0) return -1;
        int flags = cpu_interest(ch, idx);
        if (flags < 0) return -1;
        if (flags) {  /* an op read for more than columns: where it is among the chunk's CPU ops, and why */
            int32_t k = (int32_t)(ch->b[CPU_TS].n - 1);
            int8_t f = (int8_t)flags;
            if (push(ch, PICK_IDX, &k) || push(ch, PICK_FLAG, &f)) return -1;
            if ((flags & 1) && ev->coll_esc) return 1;
            if ((flags & 1) && cpu_collective(ch, ev) < 0) return -1;
            if ((flags & 4) && ev->dims && cpu_costed(ch, ev, k) < 0) return -1;
        }
        ((int64_t *)ch->names.cpu_count.p)[idx]++;
        if (ch->n_cpu++ < 64 && ev->dims) ch->shapes = 1;
        if (ev->dur >= long_us && long_op(ch->cpu_long, ch, idx, ev->ts, end) < 0) return -1;
        return 0;
    }
    /* a runtime call */
    if (push(ch, RT_TID, &ev->tid) || push(ch, RT_TS, &ev->ts) || push(ch, RT_DUR, &ev->dur) || push(ch, RT_END, &end)
        || push(ch, RT_NAME, &idx))
        return -1;
    if (first_sight(ch, idx, 8, R_ORDER) < 0) return -1;
    ((int64_t *)ch->names.rt_count.p)[idx]++;
    if (ev->dur >= long_us && long_op(ch->rt_long, ch, idx, ev->ts, end) < 0) return -1;
    int kind = rt_kind(ch, idx);
    if (kind < 0) return -1;
    if (kind) {
        /* without a correlation the typed path numbers the threads of every call in the batch (Tables.tid) */
        if (ev->corr_kind != V_INT) return 1;
        int8_t k = (int8_t)kind;
        int64_t corr = ev->corr_kind == V_INT ? ev->corr : -1;
        if (push(ch, L_KIND, &k) || push(ch, L_TS, &ev->ts) || push(ch, L_DUR, &ev->dur) || push(ch, L_TID, &ev->tid)
            || push(ch, L_CORR, &corr) || push(ch, L_NAME, &idx) || first_sight(ch, idx, 1, L_ORDER))
            return -1;
    }
    return 0;
}

/* 0: read; 1: not plain; -1: a Python error. A listed chunk is '[' events ']'; a bare one, the events alone. */
static int read_chunk(Chunk *ch, const char *data, Py_ssize_t n, double long_us, int bare) {
    Cur c = {data, data + n, 0};
    char close = bare ? 0 : ']';
    ws(&c);
    if (!bare) {
        if (c.p >= c.end || *c.p != '[') return 1;
        c.p++;
        ws(&c);
    }
    if (c.p >= c.end || *c.p == close) {
        if (!bare) { if (c.p >= c.end) return 1; c.p++; }
    } else {
        for (;;) {
            Ev ev;
            const char *start = c.p;
            if (event(&c, &ev) < 0) return PyErr_Occurred() ? -1 : 1;
            ch->n_events++;
            int8_t gpu_kind = 0;
            int cat = category(&ev, &gpu_kind);
            if (cat != C_DROP) {
                int rc = take(ch, &ev, cat, gpu_kind, start - data, c.p - data, long_us);
                if (rc) return rc;
            }
            ws(&c);
            if (c.p >= c.end) {
                if (bare) break;
                return 1;
            }
            if (*c.p == ',') { c.p++; ws(&c); continue; }
            if (*c.p == close) { c.p++; break; }
            return 1;
        }
    }
    ws(&c);
    return c.p == c.end ? 0 : 1;
}

/* The column buffers are kept from one chunk to the next (a chunk's columns are a few MB): growing them anew for
 * every chunk cost a copy and fresh pages each time. Kept only by the one call that holds them (a callback may let
 * another thread in), and not when one grew past KEEP_MAX. */
#define KEEP_MAX (16 << 20)
static Buf KEPT[N_BUFS];
static int kept_busy = 0;

static int take_kept(Chunk *ch) {
    if (kept_busy) return 0;
    kept_busy = 1;
    for (int i = 0; i < N_BUFS; i++) {
        ch->b[i] = KEPT[i];
        ch->b[i].n = 0;
    }
    return 1;
}

static void chunk_free(Chunk *ch, int kept) {
    for (int i = 0; i < N_BUFS; i++) {
        if (kept && ch->b[i].cap * ch->b[i].size <= KEEP_MAX) {
            KEPT[i] = ch->b[i];
        } else {
            free(ch->b[i].p);
            if (kept) memset(&KEPT[i], 0, sizeof KEPT[i]);
        }
    }
    if (kept) kept_busy = 0;
    free(ch->names.slots);
    free(ch->names.cpu_count.p);
    free(ch->names.rt_count.p);
    free(ch->names.rt_kind.p);
    free(ch->names.interest.p);
    free(ch->names.sync_cls.p);
    free(ch->names.seen.p);
    Py_XDECREF(ch->names.names);
    Py_XDECREF(ch->cpu_long);
    Py_XDECREF(ch->rt_long);
    Py_XDECREF(ch->colls);
    Py_XDECREF(ch->cpu_colls);
    Py_XDECREF(ch->costed);
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *kinds, *interest, *syncs;
    double long_us;
    int bare = 0;
    if (!PyArg_ParseTuple(args, "y*O!OO!d|p", &view, &PyDict_Type, &kinds, &interest, &PyDict_Type, &syncs, &long_us,
                          &bare))
        return NULL;
    Chunk ch;
    memset(&ch, 0, sizeof ch);
    int kept = take_kept(&ch);
    for (int i = 0; i < N_BUFS; i++) ch.b[i].size = SIZES[i];
    ch.names.cpu_count.size = ch.names.rt_count.size = 8;
    ch.names.rt_kind.size = ch.names.interest.size = ch.names.sync_cls.size = ch.names.seen.size = 1;
    ch.kinds = kinds;
    ch.interest = interest;
    ch.syncs = syncs;
    ch.names.mask = 255;
    ch.names.slots = (Slot *)calloc(256, sizeof(Slot));
    ch.names.names = PyList_New(0);
    ch.cpu_long = PyList_New(0);
    ch.rt_long = PyList_New(0);
    ch.colls = PyList_New(0);
    ch.cpu_colls = PyList_New(0);
    ch.costed = PyList_New(0);
    PyObject *out = NULL;
    if (!ch.names.slots || !ch.names.names || !ch.cpu_long || !ch.rt_long || !ch.colls || !ch.cpu_colls
        || !ch.costed) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    int rc = read_chunk(&ch, (const char *)view.buf, view.len, long_us, bare);
    if (rc < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();  /* (every failure sets its exception; never NULL without one) */
        goto done;
    }
    if (rc > 0) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    out = PyTuple_New(N_BUFS + 10);
    if (!out) goto done;
    for (int i = 0; i < N_BUFS; i++) {
        PyObject *b = buf_bytes(&ch.b[i]);
        if (!b) { Py_CLEAR(out); goto done; }
        PyTuple_SET_ITEM(out, i, b);
    }
    PyObject *extra[10] = {
        PyLong_FromSsize_t(ch.n_events), ch.names.names, buf_bytes(&ch.names.cpu_count),
        buf_bytes(&ch.names.rt_count), ch.cpu_long, ch.rt_long, ch.colls, ch.cpu_colls, ch.costed,
        PyBool_FromLong(ch.shapes),
    };
    Py_INCREF(ch.names.names);
    Py_INCREF(ch.cpu_long);
    Py_INCREF(ch.rt_long);
    Py_INCREF(ch.colls);
    Py_INCREF(ch.cpu_colls);
    Py_INCREF(ch.costed);
    for (int i = 0; i < 10; i++) {
        if (!extra[i]) {
            for (int j = i; j < 10; j++) Py_XDECREF(extra[j]);
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(out, N_BUFS + i, extra[i]);
    }
done:
    chunk_free(&ch, kept);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef METHODS[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, runtime_kinds, interest, sync_kinds, long_us, bare=False) -> tuple | None: the columns of a chunk of events (a JSON list, "
     "or with `bare` the comma-separated events alone), or None when the chunk is not plain and the typed decode must "
     "read it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_scan", "The fast reader of plain trace chunks.", -1,
                                    METHODS};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&MODULE); }

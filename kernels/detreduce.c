/*
 * hpc_elastic._detreduce: CPU hot loops of the deterministic allreduce and of the D2 Linear kernel.
 *
 * Method (EasyScale, SC'23, §3.3 "communication mechanism" and "D1: elastic determinism"): the sum of
 * the N EST gradients must not depend on how the ESTs are spread over processes nor on the order in
 * which a backend adds the messages.  We make the sum *exact*: every fp32 gradient value is turned
 * into an integer on a window of fixed-point bins shared by all ESTs of a chunk, and integers add
 * associatively.  See hpc_elastic/est/detsum.py for the full description, the proofs of
 * order-independence and the NumPy reference these loops are tested against bit for bit.
 *
 * Notation, for one chunk of CHUNK consecutive gradient elements:
 *   u(x)  = biased fp32 exponent of x + 1, in [1, 255); |x| < 2^(u - 127).  Non-finite -> NONFINITE.
 *   t     = max over the chunk of floor(u / W): the chunk's top bin (bins are W bits wide and aligned on
 *           absolute exponents, ReproBLAS style, so that bins of different processes line up).
 *   L     = (t - 1) * W - 127: weight of the lowest kept bit; the window keeps bins t and t-1.
 *   T(x)  = trunc(x * 2^-L), an integer with |T| < 2^(2W); split T = hi * 2^W + lo with
 *           hi = trunc(T / 2^W), lo = T - hi * 2^W (both |.| < 2^W).
 * Truncation toward zero nests: trunc(trunc(a) / 2^W) = trunc(a / 2^W).  So when the top bin of a
 * process's accumulator rises by one, the hi bin becomes the lo bin and the old lo bin is dropped, and
 * what remains is exactly what depositing every value on the new window would have given.  The result
 * depends only on the final (global) top bin of each chunk, never on the order of deposits.
 *
 * Floating point: compiled with -ffp-contract=off; every operation below is an exact IEEE operation or
 * a single correctly rounded conversion, so the CUDA twin (kernels/detreduce_cuda.cu) gives the same
 * bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pybuffer.h"

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#else
#define THREAD_ID 0
#endif

#define NONFINITE_TOP 255
#define EXP_BIAS 127
#define DOT_LANES 8

/* The hot loops are compiled for AVX-512 (x86-64-v4), AVX2 and baseline x86-64, picked at load time by the CPU
   (GCC target_clones).  They run the same C expressions, all exactly defined (integer arithmetic, exact
   products, single correctly rounded or truncating conversions), so every clone gives the same bits;
   tests/unit/kernels/test_clones.py builds the file once per instruction set with DETREDUCE_NO_CLONES and
   checks it. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(DETREDUCE_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* ---------------------------------------------------------------- buffer helpers: pybuffer.h */

static Py_ssize_t count(const buf_t *b) { return b->view.len / b->view.itemsize; }

static int check_geometry(Py_ssize_t chunk, int width) {
    if (chunk < 1) {
        PyErr_Format(PyExc_ValueError, "chunk must be >= 1, got %zd", chunk);
        return -1;
    }
    if (width < 8 || width > 31) {
        PyErr_Format(PyExc_ValueError, "width must be in [8, 31], got %d", width);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- scalar building blocks */

static inline int top_of(const float *x, Py_ssize_t len, int width) {
    /* bin(x) = (biased_exponent + 1) / width is monotonic in the exponent: take the largest exponent
       first (a vectorisable max over the exponent bits), divide once */
    uint32_t emax = 0;
    for (Py_ssize_t i = 0; i < len; ++i) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        uint32_t e = bits & 0x7f800000u;
        emax = e > emax ? e : emax;
    }
    int e = (int)(emax >> 23);
    return e == 0xff ? NONFINITE_TOP : (e + 1) / width;
}

/* 2^k as a double, built from its fields (|k| < 1023 here: the windows' scales lie between 2^-129 and 2^158). */
static inline double pow2(int k) {
    uint64_t bits = (uint64_t)(k + 1023) << 52;
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* T = trunc(x * 2^-low) in integer arithmetic: x = +-m * 2^(e - 150) with its 24-bit significand m (the implicit
   bit set for normal numbers, e = 1 for subnormals), so |T| = m shifted by e - 150 - low (left, or right with the
   bits below 2^low truncated), then T's sign.  The definition's integer exactly, for any finite x on a window where
   |T| < 2^63 (the windows of the top bins keep |T| < 2^(2W) <= 2^62).  The same integer as the exact double product
   x * 2^-low converted to int64 (C truncates toward zero), which fold_chunk and owner_chunk use.  In the deposit,
   which splits |T| into two bins, the shifts measured 3.5x faster than the conversion on an AVX2 machine (variable
   64-bit shifts vectorise there, vpsllvq/vpsrlvq; a packed double-to-int64 conversion needs AVX-512); in the loops
   that only add T, the conversion measured 1.4-2x faster. */
static inline int64_t trunc_scaled(float x, int low) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint64_t e = (bits >> 23) & 0xffu;
    uint64_t m = (bits & 0x7fffffu) | (e ? 0x800000u : 0u);
    int64_t s = (int64_t)(e ? e : 1) - 150 - low;
    uint64_t left = (uint64_t)(s > 0 ? s : 0);
    uint64_t right = (uint64_t)(s < 0 ? -s : 0);
    uint64_t mag = right > 63 ? 0 : ((m << left) >> right);
    int64_t neg = -(int64_t)(bits >> 31); /* 0 or -1 */
    return ((int64_t)mag ^ neg) - neg;
}

/* Deposit one chunk on the window whose lowest kept bit weighs 2^low.  The hi/lo split works on the magnitude, so
   both parts carry T's sign. */
CLONES
static void deposit_chunk(const float *restrict x, int64_t *restrict hi, int64_t *restrict lo, Py_ssize_t len, int low,
                          int width, int first) {
    const uint64_t mask = ((uint64_t)1 << width) - 1;
    for (Py_ssize_t i = 0; i < len; ++i) {
        int64_t t = trunc_scaled(x[i], low);
        int64_t neg = -(int64_t)(t < 0); /* 0 or -1 */
        uint64_t mag = (uint64_t)((t ^ neg) - neg);
        int64_t q = (int64_t)(mag >> width);
        int64_t r = (int64_t)(mag & mask);
        q = (q ^ neg) - neg;
        r = (r ^ neg) - neg;
        if (first) {
            hi[i] = q;
            lo[i] = r;
        } else {
            hi[i] += q;
            lo[i] += r;
        }
    }
}

/* ---------------------------------------------------------------- deposit */

static const char deposit_doc[] =
    "deposit(grad, hi, lo, tops, chunk, width, first, clear)\n"
    "Add one EST's float32 gradient into the process accumulators (hi, lo: int64; tops: uint8 per chunk).\n"
    "first=True starts a new sum; clear=True zeroes grad after reading it.";

static PyObject *py_deposit(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *oh, *ol, *ot;
    Py_ssize_t chunk;
    int width, first, clear;
    if (!PyArg_ParseTuple(args, "OOOOnipp", &og, &oh, &ol, &ot, &chunk, &width, &first, &clear)) {
        return NULL;
    }
    if (check_geometry(chunk, width) != 0) {
        return NULL;
    }
    buf_t g, h, l, t;
    if (acquire(og, &g, 'f', clear, "grad") != 0) return NULL;
    if (acquire(oh, &h, 'q', 1, "hi") != 0) { release(&g); return NULL; }
    if (acquire(ol, &l, 'q', 1, "lo") != 0) { release(&g); release(&h); return NULL; }
    if (acquire(ot, &t, 'B', 1, "tops") != 0) { release(&g); release(&h); release(&l); return NULL; }
    Py_ssize_t n = count(&g);
    Py_ssize_t nchunks = (n + chunk - 1) / chunk;
    if (count(&h) != n || count(&l) != n || count(&t) != nchunks) {
        PyErr_Format(PyExc_ValueError,
                     "size mismatch: grad has %zd elements, hi %zd, lo %zd, tops %zd (expected %zd chunks)", n,
                     count(&h), count(&l), count(&t), nchunks);
        release(&g); release(&h); release(&l); release(&t);
        return NULL;
    }
    float *gp = (float *)g.view.buf;
    int64_t *hp = (int64_t *)h.view.buf;
    int64_t *lp = (int64_t *)l.view.buf;
    uint8_t *tp = (uint8_t *)t.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < nchunks; ++c) {
        Py_ssize_t s = c * chunk;
        Py_ssize_t len = (s + chunk <= n) ? chunk : n - s;
        float *x = gp + s;
        int64_t *hi = hp + s;
        int64_t *lo = lp + s;
        int tn = top_of(x, len, width);
        int ta;
        if (first) {
            ta = tn;
            if (ta == NONFINITE_TOP) {
                memset(hi, 0, (size_t)len * sizeof *hi);
                memset(lo, 0, (size_t)len * sizeof *lo);
            }
        } else {
            ta = tp[c];
            if (ta != NONFINITE_TOP && tn == NONFINITE_TOP) {
                ta = NONFINITE_TOP;
            } else if (ta != NONFINITE_TOP && tn > ta) {
                /* the window moves up: bin ta becomes the low bin, the old low bin falls out */
                if (tn - ta == 1) {
                    for (Py_ssize_t i = 0; i < len; ++i) {
                        lo[i] = hi[i];
                        hi[i] = 0;
                    }
                } else {
                    memset(hi, 0, (size_t)len * sizeof *hi);
                    memset(lo, 0, (size_t)len * sizeof *lo);
                }
                ta = tn;
            }
        }
        tp[c] = (uint8_t)ta;
        if (ta != NONFINITE_TOP) {
            deposit_chunk(x, hi, lo, len, (ta - 1) * width - EXP_BIAS, width, first);
        }
        if (clear) {
            memset(x, 0, (size_t)len * sizeof *x);
        }
    }
    Py_END_ALLOW_THREADS

    release(&g); release(&h); release(&l); release(&t);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- combine */

static const char combine_doc[] =
    "combine(hi, lo, local_tops, global_tops, chunk, width)\n"
    "Rewrite the process accumulators as one int64 per element on the global window (in hi), ready for\n"
    "an integer SUM allreduce.";

static PyObject *py_combine(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oh, *ol, *olt, *ogt;
    Py_ssize_t chunk;
    int width;
    if (!PyArg_ParseTuple(args, "OOOOni", &oh, &ol, &olt, &ogt, &chunk, &width)) {
        return NULL;
    }
    if (check_geometry(chunk, width) != 0) {
        return NULL;
    }
    buf_t h, l, lt, gt;
    if (acquire(oh, &h, 'q', 1, "hi") != 0) return NULL;
    if (acquire(ol, &l, 'q', 0, "lo") != 0) { release(&h); return NULL; }
    if (acquire(olt, &lt, 'B', 0, "local_tops") != 0) { release(&h); release(&l); return NULL; }
    if (acquire(ogt, &gt, 'B', 0, "global_tops") != 0) { release(&h); release(&l); release(&lt); return NULL; }
    Py_ssize_t n = count(&h);
    Py_ssize_t nchunks = (n + chunk - 1) / chunk;
    if (count(&l) != n || count(&lt) != nchunks || count(&gt) != nchunks) {
        PyErr_Format(PyExc_ValueError, "size mismatch: hi has %zd elements, lo %zd, tops %zd/%zd (expected %zd)",
                     n, count(&l), count(&lt), count(&gt), nchunks);
        release(&h); release(&l); release(&lt); release(&gt);
        return NULL;
    }
    int64_t *hp = (int64_t *)h.view.buf;
    const int64_t *lp = (const int64_t *)l.view.buf;
    const uint8_t *ltp = (const uint8_t *)lt.view.buf;
    const uint8_t *gtp = (const uint8_t *)gt.view.buf;
    Py_ssize_t bad = -1;
    for (Py_ssize_t c = 0; c < nchunks; ++c) {
        if (gtp[c] != NONFINITE_TOP && ltp[c] > gtp[c]) {
            bad = c;
            break;
        }
    }
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "global top bin %d of chunk %zd is below the local one %d: not a MAX", gtp[bad],
                     bad, ltp[bad]);
        release(&h); release(&l); release(&lt); release(&gt);
        return NULL;
    }
    const int64_t base = (int64_t)1 << width;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < nchunks; ++c) {
        Py_ssize_t s = c * chunk;
        Py_ssize_t len = (s + chunk <= n) ? chunk : n - s;
        int g = gtp[c], lt_ = ltp[c];
        int64_t *hi = hp + s;
        const int64_t *lo = lp + s;
        if (g == NONFINITE_TOP || g - lt_ >= 2) {
            memset(hi, 0, (size_t)len * sizeof *hi);
        } else if (g == lt_) {
            for (Py_ssize_t i = 0; i < len; ++i) {
                hi[i] = hi[i] * base + lo[i];
            }
        } /* g == lt_ + 1: the local high bin is the global low bin, the local low bin falls out */
    }
    Py_END_ALLOW_THREADS
    release(&h); release(&l); release(&lt); release(&gt);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- tops, fold
 *
 * A process's last EST need not be deposited: its gradient stays in the buffer until reduce(), which takes the
 * chunks' top bins of it (tops), merges them with the bins' and agrees on the global ones (MAX allreduce), then
 * folds it in: V = the bins' sum on the global window (combine's rule) + trunc(x * 2^-L) of the last gradient,
 * one pass that reads the gradient once and writes V once, where a deposit then a combine wrote and re-read both
 * bins.  The same integers, so the same bits. */

static const char tops_doc[] =
    "tops(grad, tops, chunk, width)\n"
    "tops = the top bin of every chunk of grad (255 where it holds a NaN or an infinity).";

static PyObject *py_tops(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *ot;
    Py_ssize_t chunk;
    int width;
    if (!PyArg_ParseTuple(args, "OOni", &og, &ot, &chunk, &width)) {
        return NULL;
    }
    if (check_geometry(chunk, width) != 0) {
        return NULL;
    }
    buf_t g, t;
    if (acquire(og, &g, 'f', 0, "grad") != 0) return NULL;
    if (acquire(ot, &t, 'B', 1, "tops") != 0) { release(&g); return NULL; }
    Py_ssize_t n = count(&g);
    Py_ssize_t nchunks = (n + chunk - 1) / chunk;
    if (count(&t) != nchunks) {
        PyErr_Format(PyExc_ValueError, "size mismatch: grad has %zd elements, tops %zd (expected %zd chunks)", n,
                     count(&t), nchunks);
        release(&g); release(&t);
        return NULL;
    }
    const float *gp = (const float *)g.view.buf;
    uint8_t *tp = (uint8_t *)t.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < nchunks; ++c) {
        Py_ssize_t s = c * chunk;
        tp[c] = (uint8_t)top_of(gp + s, (s + chunk <= n) ? chunk : n - s, width);
    }
    Py_END_ALLOW_THREADS
    release(&g); release(&t);
    Py_RETURN_NONE;
}

/* v = base + trunc(x * 2^-low) for one chunk; base: 0 (mode 0), hi * 2^width + lo (mode 1: the bins on the global
   window), hi (mode 2: the window rose by one bin).  T is formed as owner_chunk forms it (an exact double product,
   a truncating conversion): here, where nothing splits T, measured 1.4x faster than trunc_scaled's shifts. */
CLONES
static void fold_chunk(const float *restrict x, int64_t *restrict hi, const int64_t *restrict lo, Py_ssize_t len,
                       int low, int width, int mode) {
    const int64_t base = (int64_t)1 << width;
    const double scale = pow2(-low);
    if (mode == 1) {
        for (Py_ssize_t i = 0; i < len; ++i) hi[i] = hi[i] * base + lo[i] + (int64_t)((double)x[i] * scale);
    } else if (mode == 2) {
        for (Py_ssize_t i = 0; i < len; ++i) hi[i] = hi[i] + (int64_t)((double)x[i] * scale);
    } else {
        for (Py_ssize_t i = 0; i < len; ++i) hi[i] = (int64_t)((double)x[i] * scale);
    }
}

static const char fold_doc[] =
    "fold(grad, hi, lo, bin_tops, global_tops, chunk, width, have_bins)\n"
    "hi = one int64 per element on the global window: the bins' sum (when have_bins; their top bins in bin_tops)\n"
    "plus trunc(grad * 2^-L) -- combine() of a deposit of grad, in one pass.";

static PyObject *py_fold(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *oh, *ol, *obt, *ogt;
    Py_ssize_t chunk;
    int width, have_bins;
    if (!PyArg_ParseTuple(args, "OOOOOnip", &og, &oh, &ol, &obt, &ogt, &chunk, &width, &have_bins)) {
        return NULL;
    }
    if (check_geometry(chunk, width) != 0) {
        return NULL;
    }
    buf_t g, h, l, bt, gt;
    if (acquire(og, &g, 'f', 0, "grad") != 0) return NULL;
    if (acquire(oh, &h, 'q', 1, "hi") != 0) { release(&g); return NULL; }
    if (acquire(ol, &l, 'q', 0, "lo") != 0) { release(&g); release(&h); return NULL; }
    if (acquire(obt, &bt, 'B', 0, "bin_tops") != 0) { release(&g); release(&h); release(&l); return NULL; }
    if (acquire(ogt, &gt, 'B', 0, "global_tops") != 0) {
        release(&g); release(&h); release(&l); release(&bt);
        return NULL;
    }
    Py_ssize_t n = count(&g);
    Py_ssize_t nchunks = (n + chunk - 1) / chunk;
    if (count(&h) != n || count(&l) != n || count(&bt) != nchunks || count(&gt) != nchunks) {
        PyErr_Format(PyExc_ValueError,
                     "size mismatch: grad has %zd elements, hi %zd, lo %zd, tops %zd/%zd (expected %zd chunks)", n,
                     count(&h), count(&l), count(&bt), count(&gt), nchunks);
        release(&g); release(&h); release(&l); release(&bt); release(&gt);
        return NULL;
    }
    const float *gp = (const float *)g.view.buf;
    int64_t *hp = (int64_t *)h.view.buf;
    const int64_t *lp = (const int64_t *)l.view.buf;
    const uint8_t *btp = (const uint8_t *)bt.view.buf;
    const uint8_t *gtp = (const uint8_t *)gt.view.buf;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < nchunks; ++c) {
        Py_ssize_t s = c * chunk;
        Py_ssize_t len = (s + chunk <= n) ? chunk : n - s;
        int top = gtp[c];
        if (top != NONFINITE_TOP && (top_of(gp + s, len, width) > top || (have_bins && btp[c] > top))) {
            bad = c; /* not a MAX over this process's bins and gradient: the window would not hold them */
            break;
        }
        if (top == NONFINITE_TOP) {
            memset(hp + s, 0, (size_t)len * sizeof *hp);
            continue;
        }
        int mode = 0;
        if (have_bins) {
            int rise = top - (int)btp[c];
            mode = rise == 0 ? 1 : (rise == 1 ? 2 : 0);
        }
        fold_chunk(gp + s, hp + s, lp + s, len, (top - 1) * width - EXP_BIAS, width, mode);
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "global top bin %d of chunk %zd is below this process's: not a MAX", gtp[bad],
                     bad);
    }
    release(&g); release(&h); release(&l); release(&bt); release(&gt);
    if (bad >= 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- finalize */

/* out = RN(v) * s1 * s2 / divisor for one chunk (divisor 1: no division).  (float)v is one correctly rounded
   conversion in every clone (AVX-512 has it packed), the scalings by powers of two are exact while the result
   stays normal, and the division is IEEE's: every clone gives the same bits. */
CLONES
static void finalize_chunk(const int64_t *restrict v, float *restrict out, Py_ssize_t len, float s1, float s2,
                           float divisor) {
    if (divisor == 1.0f) {
        for (Py_ssize_t i = 0; i < len; ++i) out[i] = ((float)v[i] * s1) * s2;
    } else {
        for (Py_ssize_t i = 0; i < len; ++i) out[i] = (((float)v[i] * s1) * s2) / divisor;
    }
}

static const char finalize_doc[] =
    "finalize(v, global_tops, out, chunk, width, divisor)\n"
    "Turn the reduced int64 values into float32: out = RN(v * 2^L) / divisor; NaN for non-finite chunks.";

static PyObject *py_finalize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ov, *ogt, *oo;
    Py_ssize_t chunk;
    int width;
    float divisor;
    if (!PyArg_ParseTuple(args, "OOOnif", &ov, &ogt, &oo, &chunk, &width, &divisor)) {
        return NULL;
    }
    if (check_geometry(chunk, width) != 0) {
        return NULL;
    }
    if (!(divisor > 0.0f) || isinf(divisor)) {
        char *text = PyOS_double_to_string((double)divisor, 'r', 0, 0, NULL);
        PyErr_Format(PyExc_ValueError, "divisor must be a positive finite number, got %s", text ? text : "?");
        PyMem_Free(text);
        return NULL;
    }
    buf_t v, gt, o;
    if (acquire(ov, &v, 'q', 0, "v") != 0) return NULL;
    if (acquire(ogt, &gt, 'B', 0, "global_tops") != 0) { release(&v); return NULL; }
    if (acquire(oo, &o, 'f', 1, "out") != 0) { release(&v); release(&gt); return NULL; }
    Py_ssize_t n = count(&v);
    Py_ssize_t nchunks = (n + chunk - 1) / chunk;
    if (count(&o) != n || count(&gt) != nchunks) {
        PyErr_Format(PyExc_ValueError, "size mismatch: v has %zd elements, out %zd, tops %zd (expected %zd)", n,
                     count(&o), count(&gt), nchunks);
        release(&v); release(&gt); release(&o);
        return NULL;
    }
    const int64_t *vp = (const int64_t *)v.view.buf;
    const uint8_t *gtp = (const uint8_t *)gt.view.buf;
    float *op = (float *)o.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < nchunks; ++c) {
        Py_ssize_t s = c * chunk;
        Py_ssize_t len = (s + chunk <= n) ? chunk : n - s;
        int g = gtp[c];
        float *out = op + s;
        const int64_t *vv = vp + s;
        if (g == NONFINITE_TOP) {
            for (Py_ssize_t i = 0; i < len; ++i) out[i] = NAN;
            continue;
        }
        int L = (g - 1) * width - EXP_BIAS;
        /* (float)v is one correctly rounded conversion; the scalings by powers of two are exact while
           the result stays normal (two steps keep every factor a normal float). */
        float s1, s2;
        if (L >= -126) {
            s1 = ldexpf(1.0f, L);
            s2 = 1.0f;
        } else {
            s1 = 0x1p-64f;
            s2 = ldexpf(1.0f, L + 64);
        }
        finalize_chunk(vv, out, len, s1, s2, divisor);
    }
    Py_END_ALLOW_THREADS
    release(&v); release(&gt); release(&o);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- one EST per process: owner_sum
 *
 * When every process hosts at most one EST, its contribution is its gradient itself, and trunc(x * 2^-L)
 * can be formed where the sum is made: the processes send raw float32 of each range to the range's owner (4
 * bytes per element, as a float32 allreduce does) instead of int64 partial sums, and the owner, holding all N
 * contributions of its range, finds each chunk's top bin over them (no MAX allreduce) and adds the N integers
 * exactly.  V = sum_i trunc(x_i * 2^-L) is the same integer as the binned path computes, so the result has
 * the same bits (hpc_elastic/est/reducer.py). */

/* One chunk of the owner's range: top bin over its `rows` copies (`stride` floats apart), then acc = the sum over
   them of trunc(x * 2^-low), deposit_chunk's integer arithmetic without the hi/lo split (|T| < 2^(2W) <= 2^62 on
   the window of the chunk's top bin).  Returns the top bin.  One function per chunk, so that top_of and the integer
   loop are compiled for the clone's instruction set together (integer arithmetic only: every clone gives the same
   bits). */
static inline int owner_chunk(const float *restrict x, Py_ssize_t stride, Py_ssize_t rows, int64_t *restrict acc,
                              Py_ssize_t len, int width) {
    int top = 0;
    for (Py_ssize_t r = 0; r < rows; ++r) {
        int tr = top_of(x + r * stride, len, width);
        top = tr > top ? tr : top;
    }
    if (top == NONFINITE_TOP) {
        memset(acc, 0, (size_t)len * sizeof *acc);
        return top;
    }
    /* trunc(x * 2^-low): the double product is exact (24-bit significand, scale 2^-low within double's range)
       and C's conversion truncates toward zero: trunc_scaled's integer (measured 2x faster than its shifts here,
       on an AVX2 machine) */
    const double scale = pow2(EXP_BIAS + width - top * width);
    for (Py_ssize_t r = 0; r < rows; ++r) {
        const float *xr = x + r * stride;
        for (Py_ssize_t i = 0; i < len; ++i) {
            int64_t v = (int64_t)((double)xr[i] * scale);
            acc[i] = r == 0 ? v : acc[i] + v;
        }
    }
    return top;
}

/* owner_chunk over every chunk of a range of n elements: the loop is inside the clone, so each chunk costs no
   indirect call. */
CLONES
static void owner_range(const float *x, Py_ssize_t n, Py_ssize_t rows, int64_t *acc, uint8_t *tops, Py_ssize_t chunk,
                        int width) {
    for (Py_ssize_t s = 0, c = 0; s < n; s += chunk, ++c) {
        tops[c] = (uint8_t)owner_chunk(x + s, n, rows, acc + s, (s + chunk <= n) ? chunk : n - s, width);
    }
}

static const char owner_sum_doc[] =
    "owner_sum(rows, acc, tops, chunk, width)\n"
    "All N contributions of a range, as rows of acc's length: tops = each chunk's top bin over every row (255 where\n"
    "one holds a NaN or an infinity), acc = sum over the rows of trunc(x * 2^-L) on that window (0 in non-finite\n"
    "chunks: finalize makes them NaN).";

static PyObject *py_owner_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *oa, *ot;
    Py_ssize_t chunk;
    int width;
    if (!PyArg_ParseTuple(args, "OOOni", &og, &oa, &ot, &chunk, &width)) {
        return NULL;
    }
    if (check_geometry(chunk, width) != 0) {
        return NULL;
    }
    buf_t g, a, t;
    if (acquire(og, &g, 'f', 0, "rows") != 0) return NULL;
    if (acquire(oa, &a, 'q', 1, "acc") != 0) { release(&g); return NULL; }
    if (acquire(ot, &t, 'B', 1, "tops") != 0) { release(&g); release(&a); return NULL; }
    Py_ssize_t n = count(&a);
    Py_ssize_t nchunks = (n + chunk - 1) / chunk;
    Py_ssize_t rows = n ? count(&g) / n : 0;
    if ((n ? count(&g) % n != 0 || rows < 1 : count(&g) != 0) || count(&t) != nchunks) {
        PyErr_Format(PyExc_ValueError,
                     "size mismatch: rows has %zd elements (rows of acc's %zd expected), tops %zd (expected %zd)",
                     count(&g), n, count(&t), nchunks);
        release(&g); release(&a); release(&t);
        return NULL;
    }
    const float *gp = (const float *)g.view.buf;
    int64_t *ap = (int64_t *)a.view.buf;
    uint8_t *tp = (uint8_t *)t.view.buf;
    Py_BEGIN_ALLOW_THREADS
    /* chunk by chunk: the chunk of every row is read twice while it sits in L1 (top bin, then integers), acc
       is written once */
    owner_range(gp, n, rows, ap, tp, chunk, width);
    Py_END_ALLOW_THREADS
    release(&g); release(&a); release(&t);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- D2: deterministic matmul */

/* Eight float32 lanes as a GCC/Clang vector: + acts lane by lane, each a separately rounded IEEE addition (no
   contraction: -ffp-contract=off). */
typedef float lanes_t __attribute__((vector_size(DOT_LANES * sizeof(float))));
typedef int lane_index_t __attribute__((vector_size(DOT_LANES * sizeof(int))));

/* unaligned load and store (macros: a vector-valued function would change the ABI between the clones) */
#define LOAD_LANES(dst, p) memcpy(&(dst), (p), sizeof(lanes_t))
#define STORE_LANES(p, src) memcpy((p), &(src), sizeof(lanes_t))

/* acc = fma(x, y, acc) lane by lane.  fmaf is one correctly rounded operation (the exact x * y + acc, rounded once),
   as exactly defined as a multiply or an add.  Two builds of the product: one for CPUs with AVX2 and FMA (the vector
   FMA instruction, through its intrinsic: the compiler's vectoriser does not reliably turn eight fmaf calls into it
   inside the blocked loop), one for every other CPU (the C library's fmaf, which glibc rounds correctly; slow
   without an FMA unit, the same bits).  Written out, never left to the compiler's contraction (-ffp-contract=off).
   Arguments by address: a vector passed by value would change the ABI between the builds. */
#define FMA_LANES(acc, x, y)                                                                                          \
    do {                                                                                                              \
        for (int v_ = 0; v_ < DOT_LANES; ++v_) (acc)[v_] = __builtin_fmaf((x)[v_], (y)[v_], (acc)[v_]);              \
    } while (0)

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86_FMA 1
static inline __attribute__((target("avx2,fma"))) void fma_vector(lanes_t *acc, const lanes_t *x, const lanes_t *y) {
    *acc = (lanes_t)_mm256_fmadd_ps((__m256)*x, (__m256)*y, (__m256)*acc);
}
#define FMA_STEP(acc, x, y)                                                                                           \
    do {                                                                                                              \
        if (use_fma) {                                                                                                \
            fma_vector(&(acc), &(x), &(y));                                                                           \
        } else {                                                                                                      \
            FMA_LANES(acc, x, y);                                                                                     \
        }                                                                                                             \
    } while (0)
#else
#define FMA_STEP(acc, x, y) FMA_LANES(acc, x, y)
#endif

/* The lanes of four outputs A, B, C, D reduced by the definition's tree, all four at once: pairs (l0+l1, l2+l3,
   ...) of A and B in one vector, of C and D in another, then the pairs' pairs of all four, then the halves:
   res[v] = ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) of output v, every element one IEEE addition of the definition's two
   operands (an addition commutes, so the shuffles' operand order does not matter). */
#if defined(__clang__)
#define EVEN_LANES(x, y) __builtin_shufflevector((x), (y), 0, 2, 8, 10, 4, 6, 12, 14)
#define ODD_LANES(x, y) __builtin_shufflevector((x), (y), 1, 3, 9, 11, 5, 7, 13, 15)
#else
#define EVEN_LANES(x, y) __builtin_shuffle((x), (y), (lane_index_t){0, 2, 8, 10, 4, 6, 12, 14})
#define ODD_LANES(x, y) __builtin_shuffle((x), (y), (lane_index_t){1, 3, 9, 11, 5, 7, 13, 15})
#endif
static inline __attribute__((always_inline)) void finish4(const lanes_t *acc, float *res) {
    const lanes_t ab = EVEN_LANES(acc[0], acc[1]) + ODD_LANES(acc[0], acc[1]);
    const lanes_t cd = EVEN_LANES(acc[2], acc[3]) + ODD_LANES(acc[2], acc[3]);
    const lanes_t r = EVEN_LANES(ab, cd) + ODD_LANES(ab, cd);
    for (int v = 0; v < 4; ++v) res[v] = r[v] + r[v + 4];
}

/* A block of MR x NR outputs per inner step: MR rows of a against NR rows of b, each output one vector whose lane l
   holds the definition's lane l (k mod 8 = l), so a step of eight k is one vector FMA per output, with MR + NR
   loads for MR * NR FMAs (3 x 4: 12 accumulators and 3 operands in the 16 vector registers of AVX2). */
#define MR 3
#define NR 4
/* k is walked in chunks of K_CHUNK (the lanes' state kept between chunks), and the rows of b in panels of N_PANEL,
   so that a panel's chunk stays in L2 while every row of a passes it, the rows' chunks in L1. */
#define K_CHUNK 512
#define N_PANEL 64

/* A matrix operand of the product, [rows, k], read in place: element (r, c) lies at base[offset + sum_d idx_d *
   stride_d], r decomposed row-major over the row dimensions and c over the column dimensions (at most MAX_DIMS
   each).  A convolution's patch rows are such a view of its padded image: the product reads them from the image,
   chunk by chunk, instead of a gathered [rows, k] copy.  Dense: one row dimension and one column dimension of
   stride 1, read directly (ld = its row stride); any other operand is packed, a tile of rows times a chunk of k,
   into a small buffer that stays in cache, and the blocks read the buffer.  Packing moves values, so every output
   still sees exactly the operations of the definition. */
#define MAX_DIMS 6
typedef struct {
    const float *base;
    Py_ssize_t offset;
    int nr, nc;
    Py_ssize_t rsize[MAX_DIMS], rstride[MAX_DIMS], csize[MAX_DIMS], cstride[MAX_DIMS];
    int dense;
    /* not dense, but its columns are runs of a multiple of 8 contiguous values (a patch row's kw * C, a window
       row's Wo): the AVX-512 path reads it in place, eight k at a time, from each row's start plus the offset of
       every step of eight k (runs), where the other paths pack it */
    int runs;
} operand_t;

/* Drops dimensions of size 1 and merges neighbours that walk memory as one (stride[d] = size[d+1] * stride[d+1]),
   so that a patch row's runs are as long as the image allows. */
static int coalesce(Py_ssize_t *size, Py_ssize_t *stride, int nd) {
    int out = 0;
    for (int d = 0; d < nd; ++d) {
        if (size[d] == 1) continue;
        if (out > 0 && stride[out - 1] == size[d] * stride[d]) {
            size[out - 1] *= size[d];
            stride[out - 1] = stride[d];
        } else {
            size[out] = size[d];
            stride[out] = stride[d];
            ++out;
        }
    }
    if (out == 0) {
        size[0] = 1;
        stride[0] = 1;
        out = 1;
    }
    return out;
}

static void operand_finish(operand_t *o) {
    o->nr = coalesce(o->rsize, o->rstride, o->nr);
    o->nc = coalesce(o->csize, o->cstride, o->nc);
    o->dense = o->nr == 1 && o->nc == 1 && o->cstride[0] == 1;
    o->runs = !o->dense && o->cstride[o->nc - 1] == 1 && o->csize[o->nc - 1] % DOT_LANES == 0;
}

/* rows[i] = the start of row r0 + i, i < count, walked like an odometer (no division per row) */
static void row_starts(const operand_t *o, Py_ssize_t r0, Py_ssize_t count, const float **rows) {
    Py_ssize_t idx[MAX_DIMS], rem = r0, off = o->offset;
    for (int d = o->nr - 1; d >= 0; --d) {
        idx[d] = rem % o->rsize[d];
        rem /= o->rsize[d];
        off += idx[d] * o->rstride[d];
    }
    for (Py_ssize_t i = 0; i < count; ++i) {
        rows[i] = o->base + off;
        int d = o->nr - 1;
        ++idx[d];
        off += o->rstride[d];
        while (d > 0 && idx[d] == o->rsize[d]) {
            off -= idx[d] * o->rstride[d];
            idx[d] = 0;
            --d;
            ++idx[d];
            off += o->rstride[d];
        }
    }
}

/* steps[g] = the offset from a row's start of column k0 + 8 g, g < (k1 - k0) / 8 (k0 and k1 - k0 multiples of 8,
   the runs a multiple of 8 long: each step of eight k lies in one run) */
static void step_offsets(const operand_t *o, Py_ssize_t k0, Py_ssize_t k1, Py_ssize_t *steps) {
    for (Py_ssize_t g = 0, kk = k0; kk < k1; ++g, kk += DOT_LANES) {
        Py_ssize_t rem = kk, off = 0;
        for (int d = o->nc - 1; d >= 0; --d) {
            off += (rem % o->csize[d]) * o->cstride[d];
            rem /= o->csize[d];
        }
        steps[g] = off;
    }
}

/* the offset of row r */
static inline Py_ssize_t row_offset(const operand_t *o, Py_ssize_t r) {
    Py_ssize_t off = o->offset;
    for (int d = o->nr - 1; d >= 0; --d) {
        off += (r % o->rsize[d]) * o->rstride[d];
        r /= o->rsize[d];
    }
    return off;
}

/* dst[0 .. k1 - k0) = row r's columns [k0, k1), run by run along the last column dimension */
static void pack_row(const operand_t *o, Py_ssize_t r, Py_ssize_t k0, Py_ssize_t k1, float *restrict dst) {
    const float *src = o->base + row_offset(o, r);
    const int last = o->nc - 1;
    Py_ssize_t idx[MAX_DIMS];
    Py_ssize_t rem = k0;
    for (int d = last; d >= 0; --d) {
        idx[d] = rem % o->csize[d];
        rem /= o->csize[d];
    }
    const Py_ssize_t step = o->cstride[last];
    for (Py_ssize_t kk = k0; kk < k1;) {
        Py_ssize_t off = 0;
        for (int d = 0; d < o->nc; ++d) off += idx[d] * o->cstride[d];
        Py_ssize_t run = o->csize[last] - idx[last];
        if (run > k1 - kk) run = k1 - kk;
        const float *s = src + off;
        if (step == 1) {
            memcpy(dst, s, (size_t)run * sizeof(float));
        } else {
            for (Py_ssize_t t = 0; t < run; ++t) dst[t] = s[t * step];
        }
        dst += run;
        kk += run;
        idx[last] += run;
        for (int d = last; d > 0 && idx[d] == o->csize[d]; --d) {
            idx[d] = 0;
            ++idx[d - 1];
        }
    }
}

#ifdef HAVE_X86_FMA
/* dst[x * ldd + c] = src[c * lds + x] for c, x < 8: an 8 x 8 block transposed by AVX shuffles (copies only) */
__attribute__((target("avx2"))) static void transpose8_avx(const float *src, Py_ssize_t lds, float *dst,
                                                            Py_ssize_t ldd) {
    const __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds), r2 = _mm256_loadu_ps(src + 2 * lds),
                 r3 = _mm256_loadu_ps(src + 3 * lds), r4 = _mm256_loadu_ps(src + 4 * lds),
                 r5 = _mm256_loadu_ps(src + 5 * lds), r6 = _mm256_loadu_ps(src + 6 * lds),
                 r7 = _mm256_loadu_ps(src + 7 * lds);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)),
                 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
                 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)),
                 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)),
                 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)),
                 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2)),
                 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)),
                 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

/* Rows [r0, r1) and columns [k0, k1) of an operand: a pointer to row r0's column k0 and the distance between rows,
   in place for a dense operand, else packed into buf (ld = k1 - k0). */
static const float *tile_of(const operand_t *o, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t k0, Py_ssize_t k1,
                            float *buf, Py_ssize_t *ld, int avx) {
    if (o->dense) {
        *ld = o->rstride[0];
        return o->base + o->offset + r0 * o->rstride[0] + k0;
    }
    *ld = k1 - k0;
    if (o->nr == 1 && o->nc == 1 && o->rstride[0] == 1) {
        /* a transposed matrix (consecutive rows adjacent in memory): transposed in blocks of 8 rows x 8 k, so that
           a block's 8 source lines and 8 destination lines stay in L1 (a whole column of the tile at once would
           write one line per row, 4 bytes each, and the packed rows lie K_CHUNK floats apart: few cache sets) */
        const float *src = o->base + o->offset + r0;
        const Py_ssize_t step = o->cstride[0], rows = r1 - r0, kc = k1 - k0;
        for (Py_ssize_t rb = 0; rb < rows; rb += 8) {
            const Py_ssize_t rn = rows - rb < 8 ? rows - rb : 8;
            for (Py_ssize_t kb = 0; kb < kc; kb += 8) {
                const Py_ssize_t kn = kc - kb < 8 ? kc - kb : 8;
                if (rn == 8 && kn == 8) {
#ifdef HAVE_X86_FMA
                    if (avx) {
                        transpose8_avx(src + (k0 + kb) * step + rb, step, buf + rb * kc + kb, kc);
                        continue;
                    }
#else
                    (void)avx;
#endif
                    for (int kk = 0; kk < 8; ++kk) {
                        const float *s = src + (k0 + kb + kk) * step + rb;
                        for (int r = 0; r < 8; ++r) buf[(rb + r) * kc + kb + kk] = s[r];
                    }
                } else {
                    for (Py_ssize_t kk = 0; kk < kn; ++kk) {
                        const float *s = src + (k0 + kb + kk) * step + rb;
                        for (Py_ssize_t r = 0; r < rn; ++r) buf[(rb + r) * kc + kb + kk] = s[r];
                    }
                }
            }
        }
        return buf;
    }
    for (Py_ssize_t r = r0; r < r1; ++r) pack_row(o, r, k0, k1, buf + (r - r0) * (k1 - k0));
    return buf;
}

/* R x C outputs (R <= MR, C <= NR) over kc values of k from a chunk's start (a multiple of 8 in k): rows of a lda
   apart, of b ldb apart.  Their lanes start at +0 (first) or from state, accumulate a[r, k] * b[c, k] in increasing
   k, and end reduced into out (last) or back in state.  The inner step always runs MR x NR (a block at the edge
   repeats its first row or column, whose extra results are dropped), so the accumulators stay in registers.  Each
   output sees exactly the operations of the definition, whatever the block, the chunks, the panels or where the
   operands were read from.  The tail kc - kb < 8 takes one more vector step on copies padded with a = +0 and
   b = -0: the padded lanes add the exact product -0, and x + (-0) = x for every x (also -0, which a lane holds after
   an underflowing product), so they keep their bits. */
static inline __attribute__((always_inline)) void block_kernel(const float *a, Py_ssize_t lda, const float *b,
                                                               Py_ssize_t ldb, Py_ssize_t kc, int R, int C,
                                                               lanes_t *state, Py_ssize_t n, int first, int last,
                                                               float *out, Py_ssize_t ldo, const int use_fma) {
    (void)use_fma;
    const float *ar[MR], *bc[NR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) ar[r] = a + (r < R ? r : 0) * lda;
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) bc[c] = b + (c < C ? c : 0) * ldb;
    lanes_t acc[MR][NR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < NR; ++c) {
            acc[r][c] = (lanes_t){0};
            if (!first && r < R && c < C) acc[r][c] = state[r * n + c];
        }
    }
    const Py_ssize_t kb = kc / DOT_LANES * DOT_LANES;
    for (Py_ssize_t kk = 0; kk < kb; kk += DOT_LANES) {
        lanes_t x[MR];
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) LOAD_LANES(x[r], ar[r] + kk);
#pragma GCC unroll 4
        for (int c = 0; c < NR; ++c) {
            lanes_t y;
            LOAD_LANES(y, bc[c] + kk);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) FMA_STEP(acc[r][c], x[r], y);
        }
    }
    if (kb < kc) {
        float xt[MR][DOT_LANES], yt[NR][DOT_LANES];
        for (int r = 0; r < MR; ++r) {
            for (Py_ssize_t v = 0; v < DOT_LANES; ++v) xt[r][v] = kb + v < kc ? ar[r][kb + v] : 0.0f;
        }
        for (int c = 0; c < NR; ++c) {
            for (Py_ssize_t v = 0; v < DOT_LANES; ++v) yt[c][v] = kb + v < kc ? bc[c][kb + v] : -0.0f;
        }
        lanes_t x[MR];
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) LOAD_LANES(x[r], xt[r]);
#pragma GCC unroll 4
        for (int c = 0; c < NR; ++c) {
            lanes_t y;
            LOAD_LANES(y, yt[c]);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) FMA_STEP(acc[r][c], x[r], y);
        }
    }
    if (last) {
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
            float res[NR];
            finish4(acc[r], res);
            if (r < R) {
                for (int c = 0; c < C; ++c) out[r * ldo + c] = res[c];
            }
        }
    } else {
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
            for (int c = 0; c < NR; ++c) {
                if (r < R && c < C) state[r * n + c] = acc[r][c];
            }
        }
    }
}

/* The same product on AVX-512: one 512-bit vector holds the eight lanes of TWO outputs, (i, j) in its low half and
   (i, j + 1) in its high half, so one 512-bit FMA advances both outputs' lanes by one step of eight k, each lane
   exactly the definition's fma(a[i, k], b[j, k], acc) (a 512-bit FMA is sixteen single-rounded fused multiply-adds:
   the same operations as the 256-bit one).  The 32 vector registers of AVX-512 hold a block of MR5 x NR5 = 8 x 6
   outputs: 24 accumulators, a row of a broadcast to both halves (one load) and three pairs of b's rows (a load and
   an insert each), so 11 loads and 3 inserts for 24 FMAs (the 3 x 4 AVX2 block: 7 loads for 12).  Edges, chunks,
   state and the k tail are those of block_kernel; the eight lanes of each output are reduced by finish16, sixteen
   outputs at once. */
#define MR5 8
#define NR5 6
/* rows of b per panel in this path: ten blocks of NR5 (at most N_PANEL, the packed panel's size) */
#define N_PANEL5 60

#ifdef HAVE_X86_FMA

/* two 8-lane vectors as one 512-bit vector: lo in the low half */
#define PAIR512(lo, hi)                                                                                               \
    _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1))

/* Sixteen float32 lanes (two outputs' eight lanes) and the tree of finish4 for sixteen outputs at once: z[0..7]
   hold outputs (A|B), (C|D), ... in order; pairs of adjacent lanes are added three times (the lanes' pairs, the
   pairs' pairs, the halves), the even elements of two vectors against their odd elements, so that
   res[i] = ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) of output i (z[i / 2]'s low half for even i, high half for odd i),
   every element one IEEE addition of the definition's two operands. */
typedef float lanes16_t __attribute__((vector_size(2 * DOT_LANES * sizeof(float))));
typedef int lane_index16_t __attribute__((vector_size(2 * DOT_LANES * sizeof(int))));
#if defined(__clang__)
#define EVEN16(x, y) __builtin_shufflevector((x), (y), 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
#define ODD16(x, y) __builtin_shufflevector((x), (y), 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)
#else
#define EVEN16(x, y) \
    __builtin_shuffle((x), (y), (lane_index16_t){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30})
#define ODD16(x, y) \
    __builtin_shuffle((x), (y), (lane_index16_t){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31})
#endif
#define PAIRS16(x, y) (EVEN16((x), (y)) + ODD16((x), (y)))
static inline __attribute__((always_inline, target("avx512f"))) void finish16(const lanes16_t *z, lanes16_t *res) {
    const lanes16_t p0 = PAIRS16(z[0], z[1]), p1 = PAIRS16(z[2], z[3]), p2 = PAIRS16(z[4], z[5]),
                    p3 = PAIRS16(z[6], z[7]);
    *res = PAIRS16(PAIRS16(p0, p1), PAIRS16(p2, p3));
}

static inline __attribute__((target("avx512f,avx2,fma"))) void block_kernel512(
    const float *const *arow, const Py_ssize_t *asteps, const float *const *brow, const Py_ssize_t *bsteps,
    Py_ssize_t kc, int R, int C, lanes_t *state, Py_ssize_t n, int first, int last, float *out, Py_ssize_t ldo) {
    /* row r of a starts at arow[r], its step g of eight k at arow[r] + asteps[g] (likewise b): 8 g for a packed or
       dense operand, the runs' offsets for one read in place (whose kc is then a multiple of 8: no tail) */
    const float *ar[MR5], *bc[NR5];
#pragma GCC unroll 8
    for (int r = 0; r < MR5; ++r) ar[r] = arow[r < R ? r : 0];
#pragma GCC unroll 8
    for (int c = 0; c < NR5; ++c) bc[c] = brow[c < C ? c : 0];
    __m512 acc[MR5][NR5 / 2];
#pragma GCC unroll 8
    for (int r = 0; r < MR5; ++r) {
#pragma GCC unroll 4
        for (int q = 0; q < NR5 / 2; ++q) {
            acc[r][q] = _mm512_setzero_ps();
            if (!first && r < R) {
                const int c0 = 2 * q, c1 = 2 * q + 1;
                const __m256 lo = c0 < C ? (__m256)state[r * n + c0] : _mm256_setzero_ps();
                const __m256 hi = c1 < C ? (__m256)state[r * n + c1] : _mm256_setzero_ps();
                acc[r][q] = PAIR512(lo, hi);
            }
        }
    }
    const Py_ssize_t kb = kc / DOT_LANES * DOT_LANES;
    for (Py_ssize_t g = 0; g < kb / DOT_LANES; ++g) {
        const Py_ssize_t ka = asteps[g], kb8 = bsteps[g];
        __m512 y[NR5 / 2];
#pragma GCC unroll 4
        for (int q = 0; q < NR5 / 2; ++q) {
            y[q] = PAIR512(_mm256_loadu_ps(bc[2 * q] + kb8), _mm256_loadu_ps(bc[2 * q + 1] + kb8));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR5; ++r) {
            const __m512 x = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(ar[r] + ka))));
#pragma GCC unroll 4
            for (int q = 0; q < NR5 / 2; ++q) acc[r][q] = _mm512_fmadd_ps(x, y[q], acc[r][q]);
        }
    }
    if (kb < kc) {
        /* the tail's values by masked loads (the lanes past kc are not read): a padded with +0, b with -0 */
        const __mmask16 tail = (__mmask16)((1u << (kc - kb)) - 1u);
        const __m512 minus0 = _mm512_set1_ps(-0.0f);
        __m512 y[NR5 / 2];
#pragma GCC unroll 4
        for (int q = 0; q < NR5 / 2; ++q) {
            const __m512 lo = _mm512_mask_loadu_ps(minus0, tail, bc[2 * q] + kb);
            const __m512 hi = _mm512_mask_loadu_ps(minus0, tail, bc[2 * q + 1] + kb);
            y[q] = PAIR512(_mm512_castps512_ps256(lo), _mm512_castps512_ps256(hi));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR5; ++r) {
            const __m512 xr = _mm512_maskz_loadu_ps(tail, ar[r] + kb);
            const __m512 x = _mm512_shuffle_f32x4(xr, xr, 0x44);  /* the low eight lanes in both halves */
#pragma GCC unroll 4
            for (int q = 0; q < NR5 / 2; ++q) acc[r][q] = _mm512_fmadd_ps(x, y[q], acc[r][q]);
        }
    }
    if (last) {
        /* 24 vectors, acc[r][q] holding outputs (r, 2q) and (r, 2q + 1), reduced in three groups of eight: res[g]
           holds the block's outputs row by row, (r, c) at element 6 r + c of res[0] | res[1] | res[2] */
        lanes16_t res[3];
#pragma GCC unroll 4
        for (int g = 0; g < 3; ++g) {
            lanes16_t z[8];
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) z[i] = (lanes16_t)acc[(8 * g + i) / 3][(8 * g + i) % 3];
            finish16(z, &res[g]);
        }
        if (C == NR5) {
            /* row r's six outputs gathered from the two results that hold them (a permutation) and stored at once
               (a masked store: the six lanes only) */
#pragma GCC unroll 8
            for (int r = 0; r < MR5; ++r) {
                if (r >= R) break;
                const int at = NR5 * r, g = at / 16, o = at % 16;
                const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(o),
                                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                       14, 15));
                const __m512 row = _mm512_permutex2var_ps((__m512)res[g], idx, (__m512)res[g < 2 ? g + 1 : g]);
                _mm512_mask_storeu_ps(out + r * ldo, (__mmask16)0x3f, row);
            }
        } else {
#pragma GCC unroll 3
            for (int g = 0; g < 3; ++g) {
#pragma GCC unroll 16
                for (int i = 0; i < 16; ++i) {
                    const int zi = 8 * g + i / 2, r = zi / 3, c = 2 * (zi % 3) + i % 2;
                    if (r < R && c < C) out[r * ldo + c] = res[g][i];
                }
            }
        }
    } else {
#pragma GCC unroll 8
        for (int r = 0; r < MR5; ++r) {
#pragma GCC unroll 4
            for (int q = 0; q < NR5 / 2; ++q) {
                const int c0 = 2 * q, c1 = 2 * q + 1;
                if (r < R && c0 < C) state[r * n + c0] = (lanes_t)_mm512_castps512_ps256(acc[r][q]);
                if (r < R && c1 < C) {
                    state[r * n + c1] =
                        (lanes_t)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][q]), 1));
                }
            }
        }
    }
}
#endif

/* Rows of a in tiles of M_TILE (a packed tile of M_TILE x K_CHUNK floats stays in L2 next to b's panel). */
#define M_TILE 48

/* A non-dense a whose rows times a chunk hold at most A_WHOLE floats is packed whole once per chunk, not tile by
   tile for every panel of b (a linear layer's weight gradient [2048 x 32] x [1024 x 32]: 16 panels). */
#define A_WHOLE (1 << 20)

/* The working memory of one product: b's packed panel, a's packed tile (or all its rows: a_whole), and the lanes'
   state between chunks. */
typedef struct {
    float *apack, *bpack;
    lanes_t *state;
    int a_whole;
    /* the AVX-512 path with an operand read in place (runs): every row's start, a's rows [r0, r1) and b's all */
    const float **arows, **brows;
    int path;  /* the product's path, chosen once per call */
    int transpose_avx;  /* transposed operands packed by AVX shuffles, 8 x 8 blocks at a time */
    /* where output (i, j) goes: op + i * ldo + (j / seg) * seg_stride + j % seg (a plain [m, n] matrix: ldo = seg
       = n); the columns in segments of seg let a convolution write whole NCHW planes, [O, N, Ho * Wo] */
    Py_ssize_t ldo, seg, seg_stride;
} scratch_t;

/* 8 g: the steps of a packed or dense operand */
static const Py_ssize_t dense_steps[K_CHUNK / DOT_LANES] = {
#define S8(g) (g) * 8, (g) * 8 + 8, (g) * 8 + 16, (g) * 8 + 24, (g) * 8 + 32, (g) * 8 + 40, (g) * 8 + 48, (g) * 8 + 56
    S8(0), S8(8), S8(16), S8(24), S8(32), S8(40), S8(48), S8(56)
#undef S8
};

/* The builds of the product's step: fmaf lane by lane, the AVX2 FMA on 8-lane vectors (3 x 4 blocks), the
   AVX-512 FMA on two outputs' lanes per vector (8 x 6 blocks).  All three give the same bits. */
enum { PATH_SCALAR, PATH_AVX2, PATH_AVX512, N_PATHS };
static const char *const path_names[N_PATHS] = {"scalar", "avx2", "avx512"};

/* out [r1 - r0, n] = the products of rows [r0, r1) of a with the n rows of b over k; scratch.state holds
   (r1 - r0) * n lane vectors when k > K_CHUNK.  Loops: chunks of k, panels of b (packed once per chunk when b is not
   dense), tiles of a's rows (packed likewise), blocks of the path's shape. */
static inline __attribute__((always_inline)) void matmul_blocked(const operand_t *A, const operand_t *B, float *op,
                                                                 Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n,
                                                                 Py_ssize_t k, const scratch_t *sc, const int path) {
    const Py_ssize_t m = r1 - r0;
#ifdef HAVE_X86_FMA
    const int wide = path == PATH_AVX512;
#else
    const int wide = 0;
#endif
    const int use_fma = path == PATH_AVX2, mr = wide ? MR5 : MR, nr = wide ? NR5 : NR;
    const Py_ssize_t panel = wide ? N_PANEL5 : N_PANEL, ldo = sc->ldo;
    /* the AVX-512 path: the rows' starts and the steps' offsets of both operands (read in place when sc->arows /
       sc->brows are set, else the packed tile's or dense rows with steps of 8) */
    Py_ssize_t asteps[K_CHUNK / DOT_LANES], bsteps[K_CHUNK / DOT_LANES];
    const float *arow_tile[M_TILE], *brow_panel[N_PANEL];
    for (Py_ssize_t k0 = 0; k0 < k; k0 += K_CHUNK) {
        const Py_ssize_t k1 = k - k0 < K_CHUNK ? k : k0 + K_CHUNK;
        const int first = k0 == 0, last = k1 == k;
        if (wide && sc->arows) step_offsets(A, k0, k1, asteps);
        if (wide && sc->brows) step_offsets(B, k0, k1, bsteps);
        Py_ssize_t lda_whole = 0;
        const float *a_whole = sc->a_whole ? tile_of(A, r0, r1, k0, k1, sc->apack, &lda_whole, sc->transpose_avx) : NULL;
        for (Py_ssize_t p0 = 0, p1; p0 < n; p0 = p1) {
            /* a panel lies in one segment of the output's columns */
            const Py_ssize_t seg_end = (p0 / sc->seg + 1) * sc->seg;
            p1 = p0 + panel;
            if (p1 > seg_end) p1 = seg_end;
            if (p1 > n) p1 = n;
            Py_ssize_t ldb = 0;
            const float *bp = NULL;
            const float *const *brow = NULL;
            if (wide && sc->brows) {
                brow = sc->brows + p0;
            } else {
                bp = tile_of(B, p0, p1, k0, k1, sc->bpack, &ldb, sc->transpose_avx);
                if (wide) {
                    for (Py_ssize_t j = 0; j < p1 - p0; ++j) brow_panel[j] = bp + j * ldb;
                    brow = brow_panel;
                }
            }
            for (Py_ssize_t t0 = 0; t0 < m; t0 += M_TILE) {
                const Py_ssize_t t1 = m - t0 < M_TILE ? m : t0 + M_TILE;
                Py_ssize_t lda = lda_whole;
                const float *ap = NULL;
                const float *const *arow = NULL;
                if (wide && sc->arows) {
                    arow = sc->arows + t0;
                } else {
                    ap = a_whole ? a_whole + t0 * lda_whole : tile_of(A, r0 + t0, r0 + t1, k0, k1, sc->apack, &lda,
                                                                      sc->transpose_avx);
                    if (wide) {
                        for (Py_ssize_t i = 0; i < t1 - t0; ++i) arow_tile[i] = ap + i * lda;
                        arow = arow_tile;
                    }
                }
                for (Py_ssize_t i0 = t0; i0 < t1; i0 += mr) {
                    const int R = t1 - i0 < mr ? (int)(t1 - i0) : mr;
                    for (Py_ssize_t j0 = p0; j0 < p1; j0 += nr) {
                        const int C = p1 - j0 < nr ? (int)(p1 - j0) : nr;
                        float *o = op + i0 * ldo + (j0 / sc->seg) * sc->seg_stride + j0 % sc->seg;
                        lanes_t *st = sc->state ? sc->state + i0 * n + j0 : NULL;
#ifdef HAVE_X86_FMA
                        if (wide) {
                            const float *const *ai = arow + (i0 - t0), *const *bj = brow + (j0 - p0);
                            const Py_ssize_t *as = sc->arows ? asteps : dense_steps;
                            const Py_ssize_t *bs = sc->brows ? bsteps : dense_steps;
                            if (R == MR5 && C == NR5 && first && last) {
                                block_kernel512(ai, as, bj, bs, k1 - k0, MR5, NR5, NULL, n, 1, 1, o, ldo);
                            } else {
                                block_kernel512(ai, as, bj, bs, k1 - k0, R, C, st, n, first, last, o, ldo);
                            }
                            continue;
                        }
#endif
                        const float *a = ap + (i0 - t0) * lda, *b = bp + (j0 - p0) * ldb;
                        if (R == MR && C == NR && first && last) {
                            /* the common case with every flag a constant */
                            block_kernel(a, lda, b, ldb, k1 - k0, MR, NR, NULL, n, 1, 1, o, ldo, use_fma);
                        } else {
                            block_kernel(a, lda, b, ldb, k1 - k0, R, C, st, n, first, last, o, ldo, use_fma);
                        }
                    }
                }
            }
        }
    }
}

static void matmul_scalar(const operand_t *A, const operand_t *B, float *op, Py_ssize_t r0, Py_ssize_t r1,
                          Py_ssize_t n, Py_ssize_t k, const scratch_t *sc) {
    matmul_blocked(A, B, op, r0, r1, n, k, sc, PATH_SCALAR);
}

#ifdef HAVE_X86_FMA
__attribute__((target("avx2,fma"))) static void matmul_avx2(const operand_t *A, const operand_t *B, float *op,
                                                              Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n, Py_ssize_t k,
                                                              const scratch_t *sc) {
    matmul_blocked(A, B, op, r0, r1, n, k, sc, PATH_AVX2);
}

__attribute__((target("avx512f,avx2,fma"))) static void matmul_avx512(const operand_t *A, const operand_t *B,
                                                                        float *op, Py_ssize_t r0, Py_ssize_t r1,
                                                                        Py_ssize_t n, Py_ssize_t k,
                                                                        const scratch_t *sc) {
    matmul_blocked(A, B, op, r0, r1, n, k, sc, PATH_AVX512);
}
#endif

/* Whether this CPU runs a path: asked of the CPU at run time (as the loader does for the clones), or, in a build
   with the clones off (tests/unit/kernels/test_clones.py), the paths the build's instruction set has. */
static int path_available(int path) {
    switch (path) {
    case PATH_SCALAR:
        return 1;
#if defined(HAVE_X86_FMA) && defined(DETREDUCE_NO_CLONES)
    case PATH_AVX2:
#if defined(__FMA__) && defined(__AVX2__)
        return 1;
#else
        return 0;
#endif
    case PATH_AVX512:
#if defined(__FMA__) && defined(__AVX2__) && defined(__AVX512F__)
        return 1;
#else
        return 0;
#endif
#elif defined(HAVE_X86_FMA)
    case PATH_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case PATH_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    default:
        return 0;
    }
}

/* whether whole 8 x 8 blocks of a transposed operand are packed by AVX shuffles (the CPU has AVX2; else and in the
   paths that must run without it, element by element: the same values either way) */
static int transpose_avx_ok(int path) {
#ifdef HAVE_X86_FMA
    return path != PATH_SCALAR && path_available(PATH_AVX2);
#else
    (void)path;
    return 0;
#endif
}

/* The path set by _matmul_path (tests), or -1: the widest the CPU runs. */
static int forced_path = -1;

static int matmul_path(void) {
    if (forced_path >= 0) return forced_path;
    for (int p = N_PATHS - 1; p > PATH_SCALAR; --p) {
        if (path_available(p)) return p;
    }
    return PATH_SCALAR;
}

/* The widest path this CPU runs, or the one a test forced: all give the same bits. */
static void matmul_dispatch(const operand_t *A, const operand_t *B, float *op, Py_ssize_t r0, Py_ssize_t r1,
                            Py_ssize_t n, Py_ssize_t k, const scratch_t *sc) {
    switch (sc->path) {
#ifdef HAVE_X86_FMA
    case PATH_AVX512:
        matmul_avx512(A, B, op, r0, r1, n, k, sc);
        return;
    case PATH_AVX2:
        matmul_avx2(A, B, op, r0, r1, n, k, sc);
        return;
#endif
    default:
        matmul_scalar(A, B, op, r0, r1, n, k, sc);
    }
}

static const char matmul_paths_doc[] =
    "_matmul_paths()\n"
    "The builds of the product's step this CPU runs, widest first: 'avx512', 'avx2', 'scalar' (for tests).";

static PyObject *py_matmul_paths(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (int p = N_PATHS - 1; p >= 0; --p) {
        if (!path_available(p)) continue;
        PyObject *name = PyUnicode_FromString(path_names[p]);
        if (name == NULL || PyList_Append(out, name) != 0) {
            Py_XDECREF(name);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *tuple = PyList_AsTuple(out);
    Py_DECREF(out);
    return tuple;
}

static const char matmul_path_doc[] =
    "_matmul_path(name=None)\n"
    "The build of the product's step in use; with a name ('avx512', 'avx2', 'scalar', or 'auto': the widest this\n"
    "CPU runs) it sets it first, for every thread (for tests: all give the same bits).  ValueError for a name this\n"
    "CPU does not run.";

static PyObject *py_matmul_path(PyObject *self, PyObject *args) {
    (void)self;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name != NULL) {
        int path = -2;
        if (strcmp(name, "auto") == 0) path = -1;
        for (int p = 0; p < N_PATHS; ++p) {
            if (strcmp(name, path_names[p]) == 0) path = p;
        }
        if (path == -2 || (path >= 0 && !path_available(path))) {
            PyObject *paths = py_matmul_paths(NULL, NULL);
            if (paths != NULL) {
                PyErr_Format(PyExc_ValueError, "matmul path %R: this CPU runs %S and 'auto'",
                             PyTuple_GET_ITEM(args, 0), paths);
                Py_DECREF(paths);
            }
            return NULL;
        }
        forced_path = path;
    }
    return PyUnicode_FromString(path_names[matmul_path()]);
}

/* The working memory of the product of a's rows [r0, r1) and b (held with the GIL: -1 and MemoryError when it
   cannot be had, nothing left allocated). */
static int scratch_init(scratch_t *sc, const operand_t *A, const operand_t *B, Py_ssize_t r0, Py_ssize_t r1,
                        Py_ssize_t n, Py_ssize_t k, Py_ssize_t ldo, Py_ssize_t seg, Py_ssize_t seg_stride) {
    const Py_ssize_t m = r1 - r0;
    const scratch_t empty = {NULL, NULL, NULL, 0, NULL, NULL, matmul_path(), 0, ldo, seg > 0 ? seg : 1, seg_stride};
    *sc = empty;
    sc->transpose_avx = transpose_avx_ok(sc->path);
    int failed = 0;
    if (m > 0 && n > 0 && k > 0) {
        const Py_ssize_t kc = k < K_CHUNK ? k : K_CHUNK;
        /* the AVX-512 path reads an operand of runs in place: only the rows' starts are stored */
        const int wide = sc->path == PATH_AVX512;
        const int a_direct = wide && A->runs, b_direct = wide && B->runs;
        if (a_direct) {
            failed |= (sc->arows = (const float **)malloc((size_t)m * sizeof(float *))) == NULL;
            if (!failed) row_starts(A, r0, m, sc->arows);
        }
        if (b_direct) {
            failed |= (sc->brows = (const float **)malloc((size_t)n * sizeof(float *))) == NULL;
            if (!failed) row_starts(B, 0, n, sc->brows);
        }
        sc->a_whole = !A->dense && !a_direct && n > N_PANEL && m * kc <= A_WHOLE;
        if (!A->dense && !a_direct) {
            const Py_ssize_t rows = sc->a_whole ? m : M_TILE;
            failed |= (sc->apack = (float *)malloc((size_t)(rows * kc) * sizeof(float))) == NULL;
        }
        if (!B->dense && !b_direct) {
            failed |= (sc->bpack = (float *)malloc((size_t)(N_PANEL * kc) * sizeof(float))) == NULL;
        }
        if (k > K_CHUNK) {
            sc->state = (lanes_t *)aligned_alloc(sizeof(lanes_t), (size_t)(m * n) * sizeof(lanes_t));
            failed |= sc->state == NULL;
        }
    }
    if (failed) {
        free(sc->apack); free(sc->bpack); free(sc->state); free(sc->arows); free(sc->brows);
        *sc = empty;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void scratch_free(scratch_t *sc) {
    free(sc->apack); free(sc->bpack); free(sc->state); free(sc->arows); free(sc->brows);
}

/* The product itself, without the GIL (an empty range writes nothing).
   op: row r0's output; output (i, j) of the call at op + (i - r0) * ldo + (j / seg) * seg_stride + j % seg */
static void matmul_run(const operand_t *A, const operand_t *B, float *op, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n,
                       Py_ssize_t k, const scratch_t *sc) {
    if (r1 <= r0 || n == 0) return;  /* no output (an empty part) */
    if (k > 0) {
        matmul_dispatch(A, B, op, r0, r1, n, k, sc);
        return;
    }
    for (Py_ssize_t i = 0; i < r1 - r0; ++i) {  /* k = 0: empty sums */
        for (Py_ssize_t j = 0; j < n; ++j) op[i * sc->ldo + (j / sc->seg) * sc->seg_stride + j % sc->seg] = 0.0f;
    }
}

/* Runs the product of rows [r0, r1) of A with B into op (released GIL), with its scratch; 0, or -1 with a Python
   error set. */
static int run_matmul(const operand_t *A, const operand_t *B, float *op, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n,
                      Py_ssize_t k, Py_ssize_t ldo, Py_ssize_t seg, Py_ssize_t seg_stride) {
    scratch_t sc;
    if (scratch_init(&sc, A, B, r0, r1, n, k, ldo, seg, seg_stride) != 0) return -1;
    Py_BEGIN_ALLOW_THREADS
    matmul_run(A, B, op, r0, r1, n, k, &sc);
    Py_END_ALLOW_THREADS
    scratch_free(&sc);
    return 0;
}

static const char matmul_doc[] =
    "matmul_nt(a, b, out, m, n, k)\n"
    "out[i, j] = sum_k a[i, k] * b[j, k] in float32 with a fixed order: lane l = k mod 8 accumulates its\n"
    "terms in increasing k, each step one fused multiply-add acc = fma(a[i, k], b[j, k], acc) (one rounding),\n"
    "then the lanes are added as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).  Same bits on any IEEE-754 machine and in\n"
    "the CUDA twin.";

static PyObject *py_matmul_nt(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oa, *ob, *oo;
    Py_ssize_t m, n, k;
    if (!PyArg_ParseTuple(args, "OOOnnn", &oa, &ob, &oo, &m, &n, &k)) {
        return NULL;
    }
    if (m < 0 || n < 0 || k < 0) {
        PyErr_Format(PyExc_ValueError, "matrix sizes must be >= 0, got m=%zd n=%zd k=%zd", m, n, k);
        return NULL;
    }
    buf_t a, b, o;
    if (acquire(oa, &a, 'f', 0, "a") != 0) return NULL;
    if (acquire(ob, &b, 'f', 0, "b") != 0) { release(&a); return NULL; }
    if (acquire(oo, &o, 'f', 1, "out") != 0) { release(&a); release(&b); return NULL; }
    if (count(&a) != m * k || count(&b) != n * k || count(&o) != m * n) {
        PyErr_Format(PyExc_ValueError, "size mismatch: a has %zd elements (m*k=%zd), b %zd (n*k=%zd), out %zd (m*n=%zd)",
                     count(&a), m * k, count(&b), n * k, count(&o), m * n);
        release(&a); release(&b); release(&o);
        return NULL;
    }
    const operand_t A = {(const float *)a.view.buf, 0, 1, 1, {m}, {k}, {k}, {1}, 1};
    const operand_t B = {(const float *)b.view.buf, 0, 1, 1, {n}, {k}, {k}, {1}, 1};
    int rc = run_matmul(&A, &B, (float *)o.view.buf, 0, m, n, k, n, n, 0);
    release(&a); release(&b); release(&o);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* Reads an operand's geometry from d[0, len) = [offset, row dims, column dims, sizes..., strides...] (rows' dimensions
   first, then the columns'), checking that every element it names lies inside the buffer; its row and column counts
   go to *rows and *cols.  0, or -1 with ValueError. */
static int parse_geometry(const buf_t *data, const int64_t *d, Py_ssize_t len, const char *name, operand_t *o,
                          Py_ssize_t *rows, Py_ssize_t *cols) {
    if (len < 3 || d[1] < 1 || d[2] < 1 || d[1] > MAX_DIMS || d[2] > MAX_DIMS || len != 3 + 2 * (d[1] + d[2])) {
        PyErr_Format(PyExc_ValueError, "%s: bad geometry (%zd values; 1 to %d row and column dimensions)", name, len,
                     MAX_DIMS);
        return -1;
    }
    o->base = (const float *)data->view.buf;
    o->offset = (Py_ssize_t)d[0];
    o->nr = (int)d[1];
    o->nc = (int)d[2];
    const int nd = o->nr + o->nc;
    Py_ssize_t reach = o->offset, elems = 1;
    *rows = 1;
    *cols = 1;
    for (int i = 0; i < nd; ++i) {
        const Py_ssize_t size = (Py_ssize_t)d[3 + i], stride = (Py_ssize_t)d[3 + nd + i];
        if (size < 0 || stride < 0) {
            PyErr_Format(PyExc_ValueError, "%s: sizes and strides must be >= 0", name);
            return -1;
        }
        if (i < o->nr) {
            o->rsize[i] = size;
            o->rstride[i] = stride;
            *rows *= size;
        } else {
            o->csize[i - o->nr] = size;
            o->cstride[i - o->nr] = stride;
            *cols *= size;
        }
        elems *= size;
        reach += size > 0 ? (size - 1) * stride : 0;
    }
    if (o->offset < 0 || (elems > 0 && reach >= count(data))) {
        PyErr_Format(PyExc_ValueError, "%s: the view reaches element %zd of a buffer of %zd", name, reach, count(data));
        return -1;
    }
    operand_finish(o);
    return 0;
}

/* parse_geometry of the int64 array desc. */
static int parse_operand(const buf_t *data, const buf_t *desc, const char *name, operand_t *o, Py_ssize_t *rows,
                         Py_ssize_t *cols) {
    return parse_geometry(data, (const int64_t *)desc->view.buf, count(desc), name, o, rows, cols);
}

static const char matmul_view_doc[] =
    "matmul_nt_view(a, a_geometry, b, b_geometry, out, r0, r1[, out_geometry])\n"
    "matmul_nt of two strided views, read in place: rows [r0, r1) of a against every row of b into out\n"
    "[r1 - r0, n].  A geometry is an int64 array [offset, row dims, column dims, sizes..., strides...] (row\n"
    "dimensions first, row-major) into a flat float32 buffer; the same operations per output as matmul_nt.\n"
    "With out_geometry [offset, ldo, seg, seg_stride] (int64), out is a flat buffer and output (i, j),\n"
    "r0 <= i < r1, goes to offset + i * ldo + (j / seg) * seg_stride + j % seg (n a multiple of seg): whole\n"
    "NCHW planes of a convolution from an [O, N * Ho * Wo] product.";

/* The place of the last output of rows [r0, r1) of n columns in an out geometry (every stride >= 0, n a multiple
   of seg): the product stays inside an out of count elements when this is below count; 0 for no output. */
static Py_ssize_t out_reach(Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n, Py_ssize_t out_at, Py_ssize_t ldo,
                            Py_ssize_t seg, Py_ssize_t seg_stride) {
    return r1 == r0 || n == 0 || seg < 1 ? 0 : out_at + (r1 - 1) * ldo + (n / seg - 1) * seg_stride + seg - 1;
}

static PyObject *py_matmul_nt_view(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oa, *oga, *ob, *ogb, *oo, *ogo = Py_None;
    Py_ssize_t r0, r1;
    if (!PyArg_ParseTuple(args, "OOOOOnn|O", &oa, &oga, &ob, &ogb, &oo, &r0, &r1, &ogo)) {
        return NULL;
    }
    Py_ssize_t out_at = 0, ldo = -1, seg = -1, seg_stride = 0;  /* ldo < 0: a plain [r1 - r0, n] out */
    if (ogo != Py_None) {
        buf_t go;
        if (acquire(ogo, &go, 'q', 0, "out_geometry") != 0) return NULL;
        const int64_t *g = (const int64_t *)go.view.buf;
        const int ok = count(&go) == 4;
        if (ok) {
            out_at = (Py_ssize_t)g[0];
            ldo = (Py_ssize_t)g[1];
            seg = (Py_ssize_t)g[2];
            seg_stride = (Py_ssize_t)g[3];
        }
        release(&go);
        if (!ok || out_at < 0 || ldo < 0 || seg < 1 || seg_stride < 0) {
            PyErr_SetString(PyExc_ValueError, "out_geometry: offset, ldo, seg, seg_stride (>= 0, seg >= 1)");
            return NULL;
        }
    }
    buf_t a, ga, b, gb, o;
    if (acquire(oa, &a, 'f', 0, "a") != 0) return NULL;
    if (acquire(oga, &ga, 'q', 0, "a_geometry") != 0) { release(&a); return NULL; }
    if (acquire(ob, &b, 'f', 0, "b") != 0) { release(&a); release(&ga); return NULL; }
    if (acquire(ogb, &gb, 'q', 0, "b_geometry") != 0) { release(&a); release(&ga); release(&b); return NULL; }
    if (acquire(oo, &o, 'f', 1, "out") != 0) { release(&a); release(&ga); release(&b); release(&gb); return NULL; }
    operand_t A, B;
    Py_ssize_t m, ka, n, kb;
    int rc = -1;
    if (parse_operand(&a, &ga, "a", &A, &m, &ka) == 0 && parse_operand(&b, &gb, "b", &B, &n, &kb) == 0) {
        const int plain = ldo < 0;
        const Py_ssize_t reach = plain ? 0 : out_reach(r0, r1, n, out_at, ldo, seg, seg_stride);
        if (ka != kb || r0 < 0 || r1 < r0 || r1 > m || (plain && count(&o) != (r1 - r0) * n) ||
            (!plain && (n % seg != 0 || reach >= count(&o)))) {
            PyErr_Format(PyExc_ValueError,
                         "size mismatch: a [%zd, %zd], b [%zd, %zd], rows [%zd, %zd), out %zd elements%s", m, ka, n,
                         kb, r0, r1, count(&o), plain ? "" : " (out_geometry: n a multiple of seg, inside out)");
        } else if (plain) {
            rc = run_matmul(&A, &B, (float *)o.view.buf, r0, r1, n, ka, n, n, 0);
        } else {
            rc = run_matmul(&A, &B, (float *)o.view.buf + out_at + r0 * ldo, r0, r1, n, ka, ldo, seg, seg_stride);
        }
    }
    release(&a); release(&ga); release(&b); release(&gb); release(&o);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

#define PART_VALUES 9

static const char matmul_parts_doc[] =
    "matmul_nt_parts(a, a_geometry, b, b_geometry, out, parts, threads)\n"
    "Several matmul_nt_view products at once, on up to `threads` threads of the OpenMP runtime (torch's own team\n"
    "when torch is loaded: no second pool competing with it for the cores).  parts: int64 [P, 9], each row one\n"
    "product: a's offset, b's offset, the size of b's first row dimension, r0, r1, and the out_geometry offset,\n"
    "ldo, seg, seg_stride into the flat out; the geometries' other values are a_geometry's and b_geometry's.  Each\n"
    "output is formed whole by one part with the operations of matmul_nt, so the bits do not depend on the parts\n"
    "or the threads.";

static PyObject *py_matmul_nt_parts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oa, *oga, *ob, *ogb, *oo, *op;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOi", &oa, &oga, &ob, &ogb, &oo, &op, &threads)) return NULL;
    buf_t a, ga, b, gb, o, pt;
    if (acquire(oa, &a, 'f', 0, "a") != 0) return NULL;
    if (acquire(oga, &ga, 'q', 0, "a_geometry") != 0) { release(&a); return NULL; }
    if (acquire(ob, &b, 'f', 0, "b") != 0) { release(&a); release(&ga); return NULL; }
    if (acquire(ogb, &gb, 'q', 0, "b_geometry") != 0) { release(&a); release(&ga); release(&b); return NULL; }
    if (acquire(oo, &o, 'f', 1, "out") != 0) { release(&a); release(&ga); release(&b); release(&gb); return NULL; }
    if (acquire(op, &pt, 'q', 0, "parts") != 0) {
        release(&a); release(&ga); release(&b); release(&gb); release(&o);
        return NULL;
    }
    const Py_ssize_t n_parts = count(&pt) / PART_VALUES, la = count(&ga), lb = count(&gb);
    const int64_t *pv = (const int64_t *)pt.view.buf;
    int64_t da[3 + 4 * MAX_DIMS], db[3 + 4 * MAX_DIMS];
    operand_t *As = NULL, *Bs = NULL;
    scratch_t *scs = NULL;
    Py_ssize_t *ns = NULL, k = 0, ready = 0;
    int rc = -1;
    if (count(&pt) % PART_VALUES != 0 || threads < 1 || la > 3 + 4 * MAX_DIMS || lb > 3 + 4 * MAX_DIMS || la < 4 ||
        lb < 4) {
        PyErr_SetString(PyExc_ValueError, "matmul_nt_parts: parts [P, 9], threads >= 1, geometries of 1 to 6 dims");
        goto done;
    }
    As = (operand_t *)calloc((size_t)(n_parts + 1), sizeof(operand_t));
    Bs = (operand_t *)calloc((size_t)(n_parts + 1), sizeof(operand_t));
    scs = (scratch_t *)calloc((size_t)(n_parts + 1), sizeof(scratch_t));
    ns = (Py_ssize_t *)calloc((size_t)(n_parts + 1), sizeof(Py_ssize_t));
    if (As == NULL || Bs == NULL || scs == NULL || ns == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(da, ga.view.buf, (size_t)la * sizeof(int64_t));
    memcpy(db, gb.view.buf, (size_t)lb * sizeof(int64_t));
    for (Py_ssize_t p = 0; p < n_parts; ++p) {
        const int64_t *v = pv + p * PART_VALUES;
        Py_ssize_t m, ka, kb;
        da[0] = v[0];
        db[0] = v[1];
        db[3] = v[2];
        if (parse_geometry(&a, da, la, "a", &As[p], &m, &ka) != 0 || parse_geometry(&b, db, lb, "b", &Bs[p], &ns[p], &kb) != 0) {
            goto done;
        }
        const Py_ssize_t r0 = (Py_ssize_t)v[3], r1 = (Py_ssize_t)v[4], out_at = (Py_ssize_t)v[5], ldo = (Py_ssize_t)v[6],
                         seg = (Py_ssize_t)v[7], seg_stride = (Py_ssize_t)v[8], n = ns[p];
        const Py_ssize_t reach = out_reach(r0, r1, n, out_at, ldo, seg, seg_stride);
        if (ka != kb || r0 < 0 || r1 < r0 || r1 > m || out_at < 0 || ldo < 0 || seg < 1 || seg_stride < 0 ||
            n % seg != 0 || (r1 > r0 && n > 0 && reach >= count(&o))) {
            PyErr_Format(PyExc_ValueError,
                         "part %zd: a [%zd, %zd], b [%zd, %zd], rows [%zd, %zd), out %zd elements (n a multiple of seg,"
                         " inside out)", p, m, ka, n, kb, r0, r1, count(&o));
            goto done;
        }
        k = ka;
        if (scratch_init(&scs[p], &As[p], &Bs[p], r0, r1, n, ka, ldo, seg, seg_stride) != 0) goto done;
        ready = p + 1;
    }
    {
        float *out = (float *)o.view.buf;
        const Py_ssize_t kk = k;
        Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
        for (Py_ssize_t p = 0; p < n_parts; ++p) {
            const int64_t *v = pv + p * PART_VALUES;
            matmul_run(&As[p], &Bs[p], out + v[5] + v[3] * v[6], (Py_ssize_t)v[3], (Py_ssize_t)v[4], ns[p], kk, &scs[p]);
        }
        Py_END_ALLOW_THREADS
    }
    rc = 0;
done:
    for (Py_ssize_t p = 0; p < ready; ++p) scratch_free(&scs[p]);
    free(As); free(Bs); free(scs); free(ns);
    release(&a); release(&ga); release(&b); release(&gb); release(&o); release(&pt);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- D2: batch norm in fewer passes */

/* The fixed tree of det_sum (hpc_elastic/est/d2_math.py) over buf[0, len): padded with +0.0 to a power of two p,
   then halved, buf[i] = buf[i] + buf[i + p/2] for i < p/2, until one value is left.  buf holds p floats. */
static float tree_sum(float *buf, Py_ssize_t len) {
    Py_ssize_t p = 1;
    while (p < len) p *= 2;
    for (Py_ssize_t i = len; i < p; ++i) buf[i] = 0.0f;
    for (Py_ssize_t h = p / 2; h >= 1; h /= 2) {
        for (Py_ssize_t i = 0; i < h; ++i) buf[i] = buf[i] + buf[i + h];
    }
    return buf[0];
}

/* What a batch norm sums: x, (x - mean)^2 (each operation rounded), or x * y. */
enum { TERM_X, TERM_SQUARED_DEVIATION, TERM_PRODUCT };

/* Rows whose last-dimension trees row_trees forms side by side, one lane each. */
#define ROW_GROUP 16
/* row_trees halves inside a row while more than this many values are left, then across a group of rows. */
#define ROW_TAIL 8

static inline __attribute__((always_inline)) float bn_term(const float *x, const float *y, float mean, int term,
                                                           Py_ssize_t i) {
    if (term == TERM_X) return x[i];
    if (term == TERM_PRODUCT) return x[i] * y[i];
    const float d = x[i] - mean;
    return d * d;
}

/* The fixed tree of tree_sum over the last dimension (len values) of `rows` rows, the rows of `samples` blocks
   `stride` floats apart (rows_per_sample contiguous rows of len values each): work[s * rows_per_sample + r] is the
   sum of the terms of row r of block s.  Every row sees tree_sum's additions, padded with +0.0 to p = 2^ceil(log2
   len), in the same pairs (value i + value i + h, h = p/2, p/4, ..., 1), only the order in which independent
   additions are made changes: while more than ROW_TAIL values are left a row is halved in place (contiguous
   additions, which vectorise), then the last ROW_TAIL values of ROW_GROUP rows are laid side by side (tails[i][g])
   and halved together, one vector addition per step.  buf holds 2p floats. */
CLONES
static void row_trees(const float *x, const float *y, float mean, int term, Py_ssize_t samples, Py_ssize_t stride,
                      Py_ssize_t rows_per_sample, Py_ssize_t len, float *work, float *buf) {
    Py_ssize_t p = 1;
    while (p < len) p *= 2;
    const Py_ssize_t q = p < ROW_TAIL ? p : ROW_TAIL;
    float tails[ROW_TAIL][ROW_GROUP];
    memset(tails, 0, sizeof tails);  /* the lanes of a last, partial group add values that are never read */
    const Py_ssize_t total = samples * rows_per_sample;
    Py_ssize_t sample = 0, row = 0;  /* of row r0 + g, walked without a division per row */
    for (Py_ssize_t r0 = 0; r0 < total; r0 += ROW_GROUP) {
        const Py_ssize_t group = total - r0 < ROW_GROUP ? total - r0 : ROW_GROUP;
        for (Py_ssize_t g = 0; g < group; ++g) {
            const Py_ssize_t at = sample * stride + row * len;
            if (++row == rows_per_sample) {
                row = 0;
                ++sample;
            }
            const float *xr = x + at, *yr = y ? y + at : NULL;
            float *src = buf, *dst = buf + p;
            Py_ssize_t cur = p;
            if (len == p && p > ROW_TAIL) {
                /* the first halving straight from the terms */
                const Py_ssize_t h = p / 2;
                for (Py_ssize_t i = 0; i < h; ++i) {
                    src[i] = bn_term(xr, yr, mean, term, i) + bn_term(xr, yr, mean, term, i + h);
                }
                cur = h;
            } else {
                for (Py_ssize_t i = 0; i < len; ++i) src[i] = bn_term(xr, yr, mean, term, i);
                for (Py_ssize_t i = len; i < p; ++i) src[i] = 0.0f;
            }
            while (cur > ROW_TAIL) {
                const Py_ssize_t h = cur / 2;
                for (Py_ssize_t i = 0; i < h; ++i) dst[i] = src[i] + src[i + h];
                float *t = src;
                src = dst;
                dst = t;
                cur = h;
            }
            for (Py_ssize_t i = 0; i < q; ++i) tails[i][g] = src[i];
        }
        for (Py_ssize_t h = q / 2; h >= 1; h /= 2) {
            for (Py_ssize_t i = 0; i < h; ++i) {
                for (Py_ssize_t g = 0; g < ROW_GROUP; ++g) tails[i][g] = tails[i][g] + tails[i + h][g];
            }
        }
        for (Py_ssize_t g = 0; g < group; ++g) work[r0 + g] = tails[0][g];
    }
}

/* det_sum_dims over a channel of x [n, channels, *sizes] (d2_math.det_sum_dims over every dimension but the
   channels: the last dimension first, the batch last): the tree over the last dimension of every row of every
   sample (row_trees), then, per sample, the tree over the previous dimension of those results, and so on, then
   the tree over the samples (in vals).  buf holds twice the largest dimension's power of two, work n times the
   block's row count. */
static float channel_sum(const float *x, const float *y, float mean, int term, Py_ssize_t n, Py_ssize_t channels,
                         Py_ssize_t c, const Py_ssize_t *sizes, int nd, Py_ssize_t block, float *buf, float *work,
                         float *vals) {
    const float *xc = x + c * block, *yc = y ? y + c * block : NULL;
    if (nd == 0) {
        for (Py_ssize_t s = 0; s < n; ++s) vals[s] = bn_term(xc, yc, mean, term, s * channels);
        return tree_sum(vals, n);
    }
    const Py_ssize_t len = sizes[nd - 1], rows = block / len;
    row_trees(xc, yc, mean, term, n, channels * block, rows, len, work, buf);
    for (Py_ssize_t s = 0; s < n; ++s) {
        float *ws = work + s * rows;
        Py_ssize_t left = rows;
        for (int d = nd - 2; d >= 0; --d) {
            const Py_ssize_t size = sizes[d];
            left /= size;
            for (Py_ssize_t r = 0; r < left; ++r) {
                memcpy(buf, ws + r * size, (size_t)size * sizeof(float));
                ws[r] = tree_sum(buf, size);  /* r <= r * size: row r is read before ws[r] is written */
            }
        }
        vals[s] = ws[0];
    }
    return tree_sum(vals, n);
}

/* Batch norm's last forward pass over len values of one channel: xhat = (x - mean) * invstd, y = xhat * w + b
   (the weight and bias when present), each operation rounded; one loop per case so that each vectorises. */
CLONES
static void bn_normalise(const float *restrict x, float *restrict xh, float *restrict y, Py_ssize_t len, float mu,
                         float is, int has_w, float wc, int has_b, float bc) {
    if (has_w && has_b) {
        for (Py_ssize_t i = 0; i < len; ++i) {
            const float h = (x[i] - mu) * is;
            xh[i] = h;
            y[i] = h * wc + bc;
        }
    } else if (has_w) {
        for (Py_ssize_t i = 0; i < len; ++i) {
            const float h = (x[i] - mu) * is;
            xh[i] = h;
            y[i] = h * wc;
        }
    } else if (has_b) {
        for (Py_ssize_t i = 0; i < len; ++i) {
            const float h = (x[i] - mu) * is;
            xh[i] = h;
            y[i] = h + bc;
        }
    } else {
        for (Py_ssize_t i = 0; i < len; ++i) {
            const float h = (x[i] - mu) * is;
            xh[i] = h;
            y[i] = h;
        }
    }
}

/* Batch norm's input gradient over len values of one channel: ((g * w - mg) - xhat * mgx) * invstd (g alone
   without a weight), each operation rounded. */
CLONES
static void bn_input_grad(const float *restrict g, const float *restrict xh, float *restrict gx, Py_ssize_t len,
                          int has_w, float wc, float mg, float mgx, float is) {
    if (has_w) {
        for (Py_ssize_t i = 0; i < len; ++i) gx[i] = ((g[i] * wc - mg) - xh[i] * mgx) * is;
    } else {
        for (Py_ssize_t i = 0; i < len; ++i) gx[i] = ((g[i] - mg) - xh[i] * mgx) * is;
    }
}

/* The shape of a batch norm's input and the working memory of its channel sums: one set per thread (channels are
   shared out between up to `threads` OpenMP threads; a channel's sums are its own, so the bits do not depend on
   the threads). */
typedef struct {
    Py_ssize_t n, channels, block;
    int nd, threads;
    Py_ssize_t sizes[MAX_DIMS];
    float *buf, *work, *vals;
    Py_ssize_t buf_len, work_len, vals_len;
} bn_shape_t;

/* Below this many elements a batch norm runs on the calling thread: waking a team costs more. */
#define BN_PARALLEL_MIN (1 << 15)

/* Reads the inner sizes and allocates the trees' buffers; 0, or -1 with a Python error. */
static int bn_shape(bn_shape_t *sh, Py_ssize_t n, Py_ssize_t channels, const buf_t *sizes, int threads) {
    sh->n = n;
    sh->channels = channels;
    sh->nd = (int)count(sizes);
    sh->block = 1;
    sh->buf = sh->work = sh->vals = NULL;
    if (n < 1 || channels < 0 || sh->nd > MAX_DIMS || threads < 1) {
        PyErr_Format(PyExc_ValueError,
                     "batch norm needs n >= 1, channels >= 0, at most %d inner dimensions and threads >= 1", MAX_DIMS);
        return -1;
    }
    Py_ssize_t widest = n;
    for (int d = 0; d < sh->nd; ++d) {
        sh->sizes[d] = (Py_ssize_t)((const int64_t *)sizes->view.buf)[d];
        if (sh->sizes[d] < 1) {
            PyErr_SetString(PyExc_ValueError, "batch norm's inner sizes must be >= 1");
            return -1;
        }
        sh->block *= sh->sizes[d];
        widest = sh->sizes[d] > widest ? sh->sizes[d] : widest;
    }
    Py_ssize_t p = 1;
    while (p < widest) p *= 2;
    const Py_ssize_t per_channel = n * sh->block;
    sh->threads = 1;
    if (per_channel * channels >= BN_PARALLEL_MIN) sh->threads = channels < threads ? (int)channels : threads;
    sh->buf_len = 2 * p;
    sh->work_len = per_channel;
    sh->vals_len = n > 1 ? p : 1;
    sh->buf = (float *)malloc((size_t)(sh->threads * sh->buf_len) * sizeof(float));
    sh->work = (float *)malloc((size_t)(sh->threads * sh->work_len) * sizeof(float));
    sh->vals = (float *)malloc((size_t)(sh->threads * sh->vals_len) * sizeof(float));
    if (!sh->buf || !sh->work || !sh->vals) {
        free(sh->buf); free(sh->work); free(sh->vals);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void bn_free(bn_shape_t *sh) {
    free(sh->buf); free(sh->work); free(sh->vals);
}

static const char bn_forward_doc[] =
    "batch_norm_forward(x, y, xhat, mean, sq, invstd, weight, bias, n, channels, sizes, eps)\n"
    "Batch norm's training forward on a contiguous x [n, channels, *sizes], the operations of d2_ops'\n"
    "definition in three passes per channel: mean = det_sum_dims(x) / count, sq = det_sum_dims((x - mean)^2),\n"
    "invstd = 1 / sqrt(sq / count + eps), xhat = (x - mean) * invstd, y = xhat * weight + bias (each operation\n"
    "rounded; weight and bias empty when absent).  threads (optional, default 1): the channels are shared out\n"
    "between up to that many OpenMP threads (each channel's operations are the same).";

static PyObject *py_batch_norm_forward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oy, *oh, *om, *oq, *oi, *ow, *ob, *os;
    Py_ssize_t n, channels;
    double eps;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnOd|i", &ox, &oy, &oh, &om, &oq, &oi, &ow, &ob, &n, &channels, &os, &eps,
                          &threads)) {
        return NULL;
    }
    buf_t bx, by, bh, bm, bq, bi, bw, bb, bs;
    buf_t *held[9] = {&bx, &by, &bh, &bm, &bq, &bi, &bw, &bb, &bs};
    int got = 0;
    if (acquire(ox, &bx, 'f', 0, "x") == 0 && ++got && acquire(oy, &by, 'f', 1, "y") == 0 && ++got &&
        acquire(oh, &bh, 'f', 1, "xhat") == 0 && ++got && acquire(om, &bm, 'f', 1, "mean") == 0 && ++got &&
        acquire(oq, &bq, 'f', 1, "sq") == 0 && ++got && acquire(oi, &bi, 'f', 1, "invstd") == 0 && ++got &&
        acquire(ow, &bw, 'f', 0, "weight") == 0 && ++got && acquire(ob, &bb, 'f', 0, "bias") == 0 && ++got &&
        acquire(os, &bs, 'q', 0, "sizes") == 0 && ++got) {
    }
    bn_shape_t sh;
    int rc = -1;
    if (got == 9 && bn_shape(&sh, n, channels, &bs, threads) == 0) {
        const Py_ssize_t total = n * channels * sh.block;
        const int has_w = count(&bw) != 0, has_b = count(&bb) != 0;
        if (count(&bx) != total || count(&by) != total || count(&bh) != total || count(&bm) != channels ||
            count(&bq) != channels || count(&bi) != channels || (has_w && count(&bw) != channels) ||
            (has_b && count(&bb) != channels)) {
            PyErr_SetString(PyExc_ValueError, "size mismatch: x, y, xhat [n, channels, *sizes]; mean, sq, invstd, "
                                              "weight, bias [channels] (weight, bias or empty)");
        } else {
            const float *x = (const float *)bx.view.buf, *w = (const float *)bw.view.buf;
            const float *b = (const float *)bb.view.buf;
            float *y = (float *)by.view.buf, *xh = (float *)bh.view.buf, *mean = (float *)bm.view.buf;
            float *sq = (float *)bq.view.buf, *inv = (float *)bi.view.buf;
            const float cnt = (float)(n * sh.block), e = (float)eps;
            Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel for num_threads(sh.threads) schedule(static)
#endif
            for (Py_ssize_t c = 0; c < channels; ++c) {
                const int t_id = THREAD_ID;
                float *buf = sh.buf + t_id * sh.buf_len, *work = sh.work + t_id * sh.work_len;
                float *vals = sh.vals + t_id * sh.vals_len;
                const float s =
                    channel_sum(x, NULL, 0.0f, TERM_X, n, channels, c, sh.sizes, sh.nd, sh.block, buf, work, vals);
                const float mu = s / cnt;
                const float q = channel_sum(x, NULL, mu, TERM_SQUARED_DEVIATION, n, channels, c, sh.sizes, sh.nd,
                                            sh.block, buf, work, vals);
                const float is = 1.0f / sqrtf(q / cnt + e);
                mean[c] = mu;
                sq[c] = q;
                inv[c] = is;
                for (Py_ssize_t t = 0; t < n; ++t) {
                    const Py_ssize_t at = (t * channels + c) * sh.block;
                    bn_normalise(x + at, xh + at, y + at, sh.block, mu, is, has_w, has_w ? w[c] : 0.0f, has_b,
                                 has_b ? b[c] : 0.0f);
                }
            }
            Py_END_ALLOW_THREADS
            rc = 0;
        }
        bn_free(&sh);
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

static const char bn_backward_doc[] =
    "batch_norm_backward(g, xhat, invstd, weight, gx, gw, gb, n, channels, sizes)\n"
    "Batch norm's training backward on contiguous g, xhat [n, channels, *sizes], d2_ops' operations in two\n"
    "passes per channel: gb = det_sum_dims(g), gw = det_sum_dims(g * xhat), and (gx not empty)\n"
    "gx = ((g * weight - gb * weight / count) - xhat * (gw * weight / count)) * invstd (weight empty: absent).\n"
    "threads (optional, default 1): the channels are shared out between up to that many OpenMP threads.";

static PyObject *py_batch_norm_backward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *oh, *oi, *ow, *ox, *ogw, *ogb, *os;
    Py_ssize_t n, channels;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnO|i", &og, &oh, &oi, &ow, &ox, &ogw, &ogb, &n, &channels, &os, &threads)) {
        return NULL;
    }
    buf_t bg, bh, bi, bw, bx, bgw, bgb, bs;
    buf_t *held[8] = {&bg, &bh, &bi, &bw, &bx, &bgw, &bgb, &bs};
    int got = 0;
    if (acquire(og, &bg, 'f', 0, "g") == 0 && ++got && acquire(oh, &bh, 'f', 0, "xhat") == 0 && ++got &&
        acquire(oi, &bi, 'f', 0, "invstd") == 0 && ++got && acquire(ow, &bw, 'f', 0, "weight") == 0 && ++got &&
        acquire(ox, &bx, 'f', 1, "gx") == 0 && ++got && acquire(ogw, &bgw, 'f', 1, "gw") == 0 && ++got &&
        acquire(ogb, &bgb, 'f', 1, "gb") == 0 && ++got && acquire(os, &bs, 'q', 0, "sizes") == 0 && ++got) {
    }
    bn_shape_t sh;
    int rc = -1;
    if (got == 8 && bn_shape(&sh, n, channels, &bs, threads) == 0) {
        const Py_ssize_t total = n * channels * sh.block;
        const int has_w = count(&bw) != 0, want_gx = count(&bx) != 0;
        if (count(&bg) != total || count(&bh) != total || count(&bi) != channels || count(&bgw) != channels ||
            count(&bgb) != channels || (has_w && count(&bw) != channels) || (want_gx && count(&bx) != total)) {
            PyErr_SetString(PyExc_ValueError, "size mismatch: g, xhat, gx [n, channels, *sizes] (gx or empty); "
                                              "invstd, weight, gw, gb [channels] (weight or empty)");
        } else {
            const float *g = (const float *)bg.view.buf, *xh = (const float *)bh.view.buf;
            const float *inv = (const float *)bi.view.buf, *w = (const float *)bw.view.buf;
            float *gx = (float *)bx.view.buf, *gw = (float *)bgw.view.buf, *gb = (float *)bgb.view.buf;
            const float cnt = (float)(n * sh.block);
            Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel for num_threads(sh.threads) schedule(static)
#endif
            for (Py_ssize_t c = 0; c < channels; ++c) {
                const int t_id = THREAD_ID;
                float *buf = sh.buf + t_id * sh.buf_len, *work = sh.work + t_id * sh.work_len;
                float *vals = sh.vals + t_id * sh.vals_len;
                const float sg =
                    channel_sum(g, NULL, 0.0f, TERM_X, n, channels, c, sh.sizes, sh.nd, sh.block, buf, work, vals);
                const float sgx =
                    channel_sum(g, xh, 0.0f, TERM_PRODUCT, n, channels, c, sh.sizes, sh.nd, sh.block, buf, work, vals);
                gb[c] = sg;
                gw[c] = sgx;
                if (!want_gx) continue;
                const float mg = (has_w ? sg * w[c] : sg) / cnt;
                const float mgx = (has_w ? sgx * w[c] : sgx) / cnt;
                for (Py_ssize_t t = 0; t < n; ++t) {
                    const Py_ssize_t at = (t * channels + c) * sh.block;
                    bn_input_grad(g + at, xh + at, gx + at, sh.block, has_w, has_w ? w[c] : 0.0f, mg, mgx, inv[c]);
                }
            }
            Py_END_ALLOW_THREADS
            rc = 0;
        }
        bn_free(&sh);
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- max pool (D2) */

/* D2's max pool over the planes of a contiguous [planes, h, w] input (d2_ops._MaxPool2dFn's definition): for each
   window the kernel offsets t = i * kw + j in increasing order, a padded position reading -inf; an offset replaces
   the best so far only when strictly greater, or NaN over a number, so ties go to the first offset.  Only
   comparisons and copies of the input's bits: exact, whatever the implementation.  geometry: planes, h, w, kh, kw,
   sh, sw, ph, pw, dh, dw, ho, wo. */

typedef struct {
    Py_ssize_t planes, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo;
} pool_t;

static int pool_geometry(pool_t *p, const buf_t *bg) {
    if (count(bg) != 13) {
        PyErr_SetString(PyExc_ValueError, "geometry must hold 13 int64: planes, h, w, kh, kw, sh, sw, ph, pw, dh, "
                                          "dw, ho, wo");
        return -1;
    }
    const int64_t *v = (const int64_t *)bg->view.buf;
    p->planes = v[0]; p->h = v[1]; p->w = v[2]; p->kh = v[3]; p->kw = v[4]; p->sh = v[5]; p->sw = v[6];
    p->ph = v[7]; p->pw = v[8]; p->dh = v[9]; p->dw = v[10]; p->ho = v[11]; p->wo = v[12];
    for (int i = 0; i < 13; ++i) {
        if (v[i] < (i == 7 || i == 8 ? 0 : 1)) {
            PyErr_Format(PyExc_ValueError, "geometry[%d] out of range: %lld", i, (long long)v[i]);
            return -1;
        }
    }
    if (p->kh * p->kw > 256) {
        PyErr_Format(PyExc_ValueError, "at most 256 kernel offsets (uint8 indices), got %zd", p->kh * p->kw);
        return -1;
    }
    return 0;
}

/* POOL_RUN consecutive windows of one output row lying wholly inside the plane, offset by offset: the comparisons
   above as selections over arrays (the compiler's vectors; a select moves the loaded bits, a NaN's payload too). */
#define POOL_RUN 64

static inline void max_pool_run(const float *x, Py_ssize_t w, Py_ssize_t n, Py_ssize_t kh, Py_ssize_t kw,
                                Py_ssize_t sw, Py_ssize_t dh, Py_ssize_t dw, float *out, uint8_t *idx) {
    float best[POOL_RUN];
    int32_t bt[POOL_RUN];
    for (Py_ssize_t k = 0; k < n; ++k) {
        best[k] = x[k * sw];
        bt[k] = 0;
    }
    int32_t t = 0;
    for (Py_ssize_t i = 0; i < kh; ++i) {
        for (Py_ssize_t j = 0; j < kw; ++j, ++t) {
            if (t == 0) continue;
            const float *row = x + i * dh * w + j * dw;
            for (Py_ssize_t k = 0; k < n; ++k) {
                const float v = row[k * sw], b = best[k];
                const int take = (v > b) | ((v != v) & (b == b));
                best[k] = take ? v : b;
                bt[k] = take ? t : bt[k];
            }
        }
    }
    for (Py_ssize_t k = 0; k < n; ++k) {
        out[k] = best[k];
        idx[k] = (uint8_t)bt[k];
    }
}

CLONES
static void max_pool_plane(const float *x, float *out, uint8_t *idx, const pool_t *p) {
    const float neg_inf = -INFINITY;
    for (Py_ssize_t oy = 0; oy < p->ho; ++oy) {
        const Py_ssize_t y0 = oy * p->sh - p->ph;
        const int rows_inside = y0 >= 0 && y0 + (p->kh - 1) * p->dh < p->h;
        for (Py_ssize_t ox = 0; ox < p->wo; ++ox) {
            const Py_ssize_t o = oy * p->wo + ox, x0 = ox * p->sw - p->pw;
            if (rows_inside && x0 >= 0) {
                /* the windows from here on that lie inside the plane, in runs */
                Py_ssize_t n = 0;
                while (ox + n < p->wo && n < POOL_RUN && x0 + n * p->sw + (p->kw - 1) * p->dw < p->w) ++n;
                if (n > 0) {
                    const float *at = x + y0 * p->w + x0;
                    /* constant shapes let the compiler unroll and vectorise the common windows */
                    if (p->kh == 2 && p->kw == 2 && p->sw == 2 && p->dh == 1 && p->dw == 1) {
                        max_pool_run(at, p->w, n, 2, 2, 2, 1, 1, out + o, idx + o);
                    } else if (p->kh == 3 && p->kw == 3 && p->sw == 2 && p->dh == 1 && p->dw == 1) {
                        max_pool_run(at, p->w, n, 3, 3, 2, 1, 1, out + o, idx + o);
                    } else if (p->kh == 3 && p->kw == 3 && p->sw == 1 && p->dh == 1 && p->dw == 1) {
                        max_pool_run(at, p->w, n, 3, 3, 1, 1, 1, out + o, idx + o);
                    } else {
                        max_pool_run(at, p->w, n, p->kh, p->kw, p->sw, p->dh, p->dw, out + o, idx + o);
                    }
                    ox += n - 1;
                    continue;
                }
            }
            float best = neg_inf;
            const float *from = NULL; /* NULL: the best is a padded position */
            int bt = 0, t = 0;
            for (Py_ssize_t i = 0; i < p->kh; ++i) {
                const Py_ssize_t y = y0 + i * p->dh;
                for (Py_ssize_t j = 0; j < p->kw; ++j, ++t) {
                    const Py_ssize_t xx = x0 + j * p->dw;
                    const float *at = (y >= 0 && y < p->h && xx >= 0 && xx < p->w) ? x + y * p->w + xx : NULL;
                    const float v = at ? *at : neg_inf;
                    if (t == 0 || v > best || (v != v && best == best)) {
                        best = v;
                        from = at;
                        bt = t;
                    }
                }
            }
            if (from) {
                memcpy(out + o, from, sizeof(float)); /* the selected input's bits (a NaN's payload too) */
            } else {
                out[o] = neg_inf;
            }
            idx[o] = (uint8_t)bt;
        }
    }
}

/* The backward of the definition: the padded input gradient starts at +0 and each offset t, in increasing order,
   adds the output gradients of the windows that selected t (the definition also adds +0 where a window did not:
   an identity here, since a sum that starts at +0 is never -0 under rounding to nearest); positions in the padding
   are dropped.  One pass over the windows in reverse row-major order gives every input position its additions in
   that order: the windows that reach row y through kernel row i are oy = (y + ph - i dh) / sh, decreasing in i
   (and the same along x within one kernel row). */
static void max_pool_plane_backward(const float *g, const uint8_t *idx, float *gx, const pool_t *p) {
    for (Py_ssize_t k = 0; k < p->h * p->w; ++k) gx[k] = 0.0f;
    for (Py_ssize_t oy = p->ho - 1; oy >= 0; --oy) {
        for (Py_ssize_t ox = p->wo - 1; ox >= 0; --ox) {
            const Py_ssize_t o = oy * p->wo + ox;
            const Py_ssize_t i = idx[o] / p->kw, j = idx[o] % p->kw;
            const Py_ssize_t y = oy * p->sh + i * p->dh - p->ph, xx = ox * p->sw + j * p->dw - p->pw;
            if (y < 0 || y >= p->h || xx < 0 || xx >= p->w) continue;
            gx[y * p->w + xx] = gx[y * p->w + xx] + g[o];
        }
    }
}

static const char max_pool_forward_doc[] =
    "max_pool_forward(x, out, idx, geometry)\n"
    "D2's max pool on contiguous x [planes, h, w] into out and idx (uint8: the selected offset) [planes, ho, wo];\n"
    "geometry int64 [planes, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo]. Ties go to the first offset.";

static PyObject *py_max_pool_forward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo, *oi, *og;
    if (!PyArg_ParseTuple(args, "OOOO", &ox, &oo, &oi, &og)) return NULL;
    buf_t bx, bo, bi, bg;
    buf_t *held[4] = {&bx, &bo, &bi, &bg};
    int got = 0;
    if (acquire(ox, &bx, 'f', 0, "x") == 0 && ++got && acquire(oo, &bo, 'f', 1, "out") == 0 && ++got &&
        acquire(oi, &bi, 'B', 1, "idx") == 0 && ++got && acquire(og, &bg, 'q', 0, "geometry") == 0 && ++got) {
    }
    pool_t p;
    int rc = -1;
    if (got == 4 && pool_geometry(&p, &bg) == 0) {
        const Py_ssize_t in_plane = p.h * p.w, out_plane = p.ho * p.wo;
        if (count(&bx) != p.planes * in_plane || count(&bo) != p.planes * out_plane ||
            count(&bi) != p.planes * out_plane) {
            PyErr_SetString(PyExc_ValueError, "size mismatch: x [planes, h, w]; out, idx [planes, ho, wo]");
        } else {
            const float *x = (const float *)bx.view.buf;
            float *out = (float *)bo.view.buf;
            uint8_t *idx = (uint8_t *)bi.view.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t c = 0; c < p.planes; ++c) {
                max_pool_plane(x + c * in_plane, out + c * out_plane, idx + c * out_plane, &p);
            }
            Py_END_ALLOW_THREADS
            rc = 0;
        }
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

static const char max_pool_backward_doc[] =
    "max_pool_backward(g, idx, gx, geometry)\n"
    "The input gradient gx [planes, h, w] of max_pool_forward from contiguous g and idx [planes, ho, wo]: each\n"
    "offset in increasing order adds the gradients of the windows that selected it.";

static PyObject *py_max_pool_backward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *oi, *ox, *ogeo;
    if (!PyArg_ParseTuple(args, "OOOO", &og, &oi, &ox, &ogeo)) return NULL;
    buf_t bg, bi, bx, bgeo;
    buf_t *held[4] = {&bg, &bi, &bx, &bgeo};
    int got = 0;
    if (acquire(og, &bg, 'f', 0, "g") == 0 && ++got && acquire(oi, &bi, 'B', 0, "idx") == 0 && ++got &&
        acquire(ox, &bx, 'f', 1, "gx") == 0 && ++got && acquire(ogeo, &bgeo, 'q', 0, "geometry") == 0 && ++got) {
    }
    pool_t p;
    int rc = -1;
    if (got == 4 && pool_geometry(&p, &bgeo) == 0) {
        const Py_ssize_t in_plane = p.h * p.w, out_plane = p.ho * p.wo;
        if (count(&bx) != p.planes * in_plane || count(&bg) != p.planes * out_plane ||
            count(&bi) != p.planes * out_plane) {
            PyErr_SetString(PyExc_ValueError, "size mismatch: gx [planes, h, w]; g, idx [planes, ho, wo]");
        } else {
            const float *g = (const float *)bg.view.buf;
            const uint8_t *idx = (const uint8_t *)bi.view.buf;
            float *gx = (float *)bx.view.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t c = 0; c < p.planes; ++c) {
                max_pool_plane_backward(g + c * out_plane, idx + c * out_plane, gx + c * in_plane, &p);
            }
            Py_END_ALLOW_THREADS
            rc = 0;
        }
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- exp and expm1 (D2)
 *
 * hpc_elastic/est/d2_math.py's det_exp and det_expm1, element by element: the same float32 operations in the same
 * order (this file is built with -ffp-contract=off: no multiply is fused into an add), so the same bits as the
 * torch definitions, which the GPU runs.  The constants come from Python (one source of truth):
 * LOG2E, LN2_HI, LN2_LO, EXP_LO, EXP_HI, then the seven Taylor coefficients 1/2! .. 1/8!.
 *   x clamped to [EXP_LO, EXP_HI]; k = round-half-even(x * LOG2E); r = (x - k LN2_HI) - k LN2_LO (two roundings);
 *   q = r + (r * r) * P(r) (Horner, one multiply and one add per step) = expm1(r);
 *   exp: (q + 1) 2^k; expm1: q 2^k + (2^k - 1); 2^k as two exact power-of-two factors (2^128 alone overflows);
 *   x < EXP_LO gives 0 (exp) or -1 (expm1), x > EXP_HI inf, NaN stays NaN.
 * And from them det_sigmoid (e = exp(-|x|), 1 / (e + 1) for x >= 0, else e / (e + 1)) and det_tanh
 * (t = expm1(-2 |x|), -t / (t + 2) with the sign of x). */

#define EXP_CONSTANTS 12

static inline float pow2_bits(int32_t k) {
    const uint32_t bits = (uint32_t)(k + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float scale_pow2(float y, int32_t k) {
    const int32_t half = (k - (k & 1)) / 2; /* floor(k / 2) */
    return (y * pow2_bits(half)) * pow2_bits(k - half);
}

/* nearbyintf(v) in the default rounding mode (to nearest, ties to even) for |v| <= 2^22: v + 1.5 2^23 lies where
   the float32 spacing is 1, so that addition rounds v to an integer and the subtraction is exact; the sign of a zero
   result is v's, as nearbyintf's.  Branch-free and vectorisable, unlike the libm call. */
static inline float round_half_even(float v) {
    const float shifter = 12582912.0f;
    return copysignf((v + shifter) - shifter, v);
}

/* One element, without branches (selects only), so that the loops below vectorise; the clamp keeps
   |x LOG2E| <= 128, and a NaN takes the path of 0 and is returned as it came. */
static inline float det_exp_one(float x, const float *c, int expm1) {
    const int nan = x != x;
    const float lo = c[3], hi = c[4];
    float xc = x < lo ? lo : (x > hi ? hi : x);
    xc = nan ? 0.0f : xc;
    const float kf = round_half_even(xc * c[0]);
    float t = kf * c[1];
    float r = xc - t;
    t = kf * c[2];
    r = r - t;
    float acc = c[5 + 6];
    for (int j = 5; j >= 0; --j) {
        acc = acc * r;
        acc = acc + c[5 + j];
    }
    float q = (r * r) * acc;
    q = r + q;
    const int32_t k = (int32_t)kf;
    float value;
    if (expm1) {
        const float p = scale_pow2(1.0f, k);
        value = scale_pow2(q, k) + (p - 1.0f);
    } else {
        value = scale_pow2(q + 1.0f, k);
    }
    value = x < lo ? (expm1 ? -1.0f : 0.0f) : value;
    value = x > hi ? INFINITY : value;
    return nan ? x : value;
}

enum { FN_EXP = 0, FN_EXPM1 = 1, FN_SIGMOID = 2, FN_TANH = 3 };

static inline float det_sigmoid_one(float x, const float *c) {
    const float e = det_exp_one(-fabsf(x), c, 0);
    const float d = e + 1.0f;
    return x >= 0.0f ? 1.0f / d : e / d;
}

static inline float det_tanh_one(float x, const float *c) {
    const float t = det_exp_one(fabsf(x) * -2.0f, c, 1);
    const float y = (-t) / (t + 2.0f);
    return copysignf(y, x);
}

/* One loop per function (the choice outside the loop), the constants copied to a local array (no aliasing with
   out), compiled per instruction set: each clone runs the same operations per element. */
CLONES
static void det_fn_loop(const float *restrict x, float *restrict out, Py_ssize_t n, const float *constants, int fn) {
    float c[EXP_CONSTANTS];
    memcpy(c, constants, sizeof c);
    switch (fn) {
    case FN_EXP:
        for (Py_ssize_t i = 0; i < n; ++i) out[i] = det_exp_one(x[i], c, 0);
        break;
    case FN_EXPM1:
        for (Py_ssize_t i = 0; i < n; ++i) out[i] = det_exp_one(x[i], c, 1);
        break;
    case FN_SIGMOID:
        for (Py_ssize_t i = 0; i < n; ++i) out[i] = det_sigmoid_one(x[i], c);
        break;
    default:
        for (Py_ssize_t i = 0; i < n; ++i) out[i] = det_tanh_one(x[i], c);
        break;
    }
}

PyDoc_STRVAR(exp_doc,
    "exp(x, out, constants, fn)\n"
    "det_exp (fn 0), det_expm1 (1), det_sigmoid (2) or det_tanh (3) of float32 x into out, element by element,\n"
    "with d2_math's 12 float32 constants: the torch definitions' operations, the same bits.");

static PyObject *py_exp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo, *oc;
    int fn;
    if (!PyArg_ParseTuple(args, "OOOi", &ox, &oo, &oc, &fn)) return NULL;
    if (fn < FN_EXP || fn > FN_TANH) {
        PyErr_Format(PyExc_ValueError, "fn: 0 (exp), 1 (expm1), 2 (sigmoid) or 3 (tanh), got %d", fn);
        return NULL;
    }
    buf_t bx, bo, bc;
    buf_t *held[3] = {&bx, &bo, &bc};
    int got = 0;
    if (acquire(ox, &bx, 'f', 0, "x") == 0 && ++got && acquire(oo, &bo, 'f', 1, "out") == 0 && ++got &&
        acquire(oc, &bc, 'f', 0, "constants") == 0 && ++got) {
    }
    int rc = -1;
    if (got == 3) {
        if (count(&bc) != EXP_CONSTANTS) {
            PyErr_Format(PyExc_ValueError, "constants: %d float32 values, got %zd", EXP_CONSTANTS, count(&bc));
        } else if (count(&bo) != count(&bx)) {
            PyErr_Format(PyExc_ValueError, "out has %zd elements, x %zd", count(&bo), count(&bx));
        } else {
            const float *x = (const float *)bx.view.buf, *c = (const float *)bc.view.buf;
            float *out = (float *)bo.view.buf;
            const Py_ssize_t n = count(&bx);
            Py_BEGIN_ALLOW_THREADS
            det_fn_loop(x, out, n, c, fn);
            Py_END_ALLOW_THREADS
            rc = 0;
        }
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- layout (D2 convolutions) */

/* pad_image: a contiguous [N, C, H, W] image zero-padded, as the contiguous [N, C, top + H + bottom,
 * left + W + right] tensor (planes) or as the channels-last [N, top + H + bottom, left + W + right, C] tensor
 * (d2_ops._pad_image), the layouts D2's convolutions read their windows from.  Only copies of the input's
 * bits (moved as 32-bit integers: a NaN's payload, the sign of a zero kept) and +0.0 around: exact, whatever the
 * order.  Each output row is written once: no fill of the whole tensor before the copy, as F.pad does.  torch's copy
 * of a permuted view into channels last moves one element at a time, 5-8x slower than a plain copy of the same bytes;
 * here an output row (one image row of every channel) is transposed in blocks of 8 x 8 (the AVX shuffles that pack
 * a transposed operand for the product).  Rows are shared out between
 * up to `threads` OpenMP threads (torch's team) from LAYOUT_PARALLEL_MIN elements. */

#define LAYOUT_PARALLEL_MIN (1 << 15)

/* geometry's `len` int64 values into g, all >= 0; else 0 */
static int read_geometry(const buf_t *geometry, Py_ssize_t *g, Py_ssize_t len) {
    if (count(geometry) != len) return 0;
    const int64_t *v = (const int64_t *)geometry->view.buf;
    for (Py_ssize_t i = 0; i < len; ++i) {
        if (v[i] < 0) return 0;
        g[i] = (Py_ssize_t)v[i];
    }
    return 1;
}

/* dst [w, c] = src [c, w] (rows `stride` apart): whole 8 x 8 blocks by the packing's AVX shuffles (transpose8_avx)
   where `avx`, the rest, and everything without AVX2, element by element (only bits move either way). */
static void transpose_tiles(const uint32_t *restrict src, uint32_t *restrict dst, Py_ssize_t c, Py_ssize_t stride,
                            Py_ssize_t w, int avx) {
    Py_ssize_t c8 = 0, w8 = 0;
#ifdef HAVE_X86_FMA
    if (avx) {
        c8 = c - c % 8;
        w8 = w - w % 8;
        for (Py_ssize_t c0 = 0; c0 < c8; c0 += 8) {
            for (Py_ssize_t x0 = 0; x0 < w8; x0 += 8) {
                transpose8_avx((const float *)(src + c0 * stride + x0), stride, (float *)(dst + x0 * c + c0), c);
            }
        }
    }
#else
    (void)avx;
#endif
    for (Py_ssize_t ch = 0; ch < c; ++ch) {
        const uint32_t *s = src + ch * stride;
        const Py_ssize_t from = ch < c8 ? w8 : 0;
        for (Py_ssize_t x = from; x < w; ++x) dst[x * c + ch] = s[x];
    }
}

/* One output row of a zero-padded image: `left` zeros, the w values of src, `right` zeros (planes), or the same in
   pixels of c channels, src the row of channel 0 and the channels `plane` apart (channels last). */
static void pad_row(const uint32_t *src, uint32_t *dst, Py_ssize_t c, Py_ssize_t plane, Py_ssize_t w,
                    Py_ssize_t left, Py_ssize_t right, int channels_last, int avx) {
    const Py_ssize_t px = channels_last ? c : 1;
    memset(dst, 0, (size_t)(left * px) * sizeof *dst);
    if (channels_last) {
        transpose_tiles(src, dst + left * c, c, plane, w, avx);
    } else {
        memcpy(dst + left, src, (size_t)w * sizeof *dst);
    }
    memset(dst + (left + w) * px, 0, (size_t)(right * px) * sizeof *dst);
}

PyDoc_STRVAR(pad_image_doc,
    "pad_image(x, out, geometry, channels_last, threads)\n"
    "Contiguous float32 x [n, c, h, w] into contiguous out [n, c, top + h + bottom, left + w + right] (channels_last\n"
    "0) or [n, top + h + bottom, left + w + right, c] (1), +0.0 around; geometry: int64 [n, c, h, w, top, bottom,\n"
    "left, right].  Copies of the bits only.");

static PyObject *py_pad_image(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo, *og;
    int channels_last, threads;
    if (!PyArg_ParseTuple(args, "OOOpi", &ox, &oo, &og, &channels_last, &threads)) return NULL;
    buf_t bx, bo, bg;
    buf_t *held[3] = {&bx, &bo, &bg};
    int got = 0;
    if (acquire(ox, &bx, 'f', 0, "x") == 0 && ++got && acquire(oo, &bo, 'f', 1, "out") == 0 && ++got &&
        acquire(og, &bg, 'q', 0, "geometry") == 0 && ++got) {
    }
    int rc = -1;
    if (got == 3) {
        Py_ssize_t g[8] = {0};
        if (!read_geometry(&bg, g, 8) || threads < 1) {
            PyErr_SetString(PyExc_ValueError,
                            "geometry: 8 int64 values >= 0 (n, c, h, w, top, bottom, left, right); threads >= 1");
        } else {
            const Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], top = g[4], left = g[6], right = g[7];
            const Py_ssize_t hp = top + h + g[5], wp = left + w + right, plane = h * w;
            if (count(&bx) != n * c * plane || count(&bo) != n * c * hp * wp) {
                PyErr_Format(PyExc_ValueError, "size mismatch: x has %zd elements, out %zd; geometry wants %zd, %zd",
                             count(&bx), count(&bo), n * c * plane, n * c * hp * wp);
            } else {
                const uint32_t *x = (const uint32_t *)bx.view.buf;
                uint32_t *out = (uint32_t *)bo.view.buf;
                /* planes: a row per (image, channel, y); channels last: a row per (image, y), its pixels whole */
                const Py_ssize_t images = channels_last ? n : n * c, px = channels_last ? c : 1;
                const Py_ssize_t rows = images * hp, row = wp * px, image = channels_last ? c * plane : plane;
                const int team = rows * row >= LAYOUT_PARALLEL_MIN ? threads : 1;
                const int avx = transpose_avx_ok(matmul_path());
                Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(team) schedule(static)
                for (Py_ssize_t r = 0; r < rows; ++r) {
                    const Py_ssize_t y = r % hp - top;
                    uint32_t *dst = out + r * row;
                    if (y < 0 || y >= h) {
                        memset(dst, 0, (size_t)row * sizeof *dst);
                    } else {
                        pad_row(x + (r / hp) * image + y * w, dst, c, plane, w, left, right, channels_last, avx);
                    }
                }
                Py_END_ALLOW_THREADS
                rc = 0;
            }
        }
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- stencil (D2 depthwise convolutions) */

/* stencil: for every plane p of a zero-padded image and every output (t, u),
 *   out[p, t, u] = the fixed-order dot product (matmul_nt's: lane l = k mod 8 accumulating fma(w_k, x_k, acc) in
 *                  increasing k from +0, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) of the T taps
 *                  w_k = weights[p mod C, k] and x_k = img[p, (y0 + t sy) Wp + x0 + u sx + offsets[k]].
 * A depthwise convolution's output (taps: the kernel offsets) and its input's gradient (per phase of the stride:
 * the offsets that reach it, from the last to the first) are such dot products over one channel's plane: the bits of
 * the one-channel products of d2_ops' grouped convolution, with no per-output packing or tree of the blocked product
 * (whose 3 x 4 blocks and 8-lane vectors over k are mostly empty for k = 9).  Here the vectors run along a row's
 * outputs, 8 at once, each lane's accumulator one vector over them, every output seeing the same operations in the
 * same order (the vector FMA where the product's path has one, else fmaf lane by lane: the same bits; lanes no tap
 * reaches stay +0 and enter the tree, as in the product).  Planes are shared out between up to `threads` OpenMP
 * threads. */

/* One row of `width` outputs, DOT_LANES at a time: acc[l] holds lane l of 8 outputs (the taps k0 + l: constant lane
   indices, so the accumulators stay in registers), each step one vector FMA of a tap's weight and 8 window values;
   then each output's tree, 8 outputs at once (element-wise additions: each output sees its own). */
static inline __attribute__((always_inline)) void stencil_row_impl(const float *row, const float *w,
                                                                   const int64_t *offsets, Py_ssize_t taps,
                                                                   Py_ssize_t sx, float *out, Py_ssize_t out_sx,
                                                                   Py_ssize_t width, const int use_fma) {
    (void)use_fma;
    for (Py_ssize_t u0 = 0; u0 < width; u0 += DOT_LANES) {
        const Py_ssize_t run = width - u0 < DOT_LANES ? width - u0 : DOT_LANES;
        const float *x0 = row + u0 * sx;
        lanes_t acc[DOT_LANES];
#pragma GCC unroll 8
        for (int l = 0; l < DOT_LANES; ++l) acc[l] = (lanes_t){0};
        for (Py_ssize_t k0 = 0; k0 < taps; k0 += DOT_LANES) {
#pragma GCC unroll 8
            for (int l = 0; l < DOT_LANES; ++l) {
                if (k0 + l < taps) {
                    const float *x = x0 + offsets[k0 + l];
                    lanes_t xv, wv;
                    if (sx == 1 && run == DOT_LANES) {
                        LOAD_LANES(xv, x);
                    } else {
                        for (int v = 0; v < DOT_LANES; ++v) xv[v] = v < run ? x[v * sx] : 0.0f;
                    }
                    const float wk = w[k0 + l];
                    for (int v = 0; v < DOT_LANES; ++v) wv[v] = wk;
                    FMA_STEP(acc[l], wv, xv);
                }
            }
        }
        const lanes_t sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        if (out_sx == 1 && run == DOT_LANES) {
            STORE_LANES(out + u0, sum);
        } else {
            for (Py_ssize_t u = 0; u < run; ++u) out[(u0 + u) * out_sx] = sum[u];
        }
    }
}

typedef void (*stencil_row_fn)(const float *, const float *, const int64_t *, Py_ssize_t, Py_ssize_t, float *,
                               Py_ssize_t, Py_ssize_t);

static void stencil_row_plain(const float *row, const float *w, const int64_t *offsets, Py_ssize_t taps,
                              Py_ssize_t sx, float *out, Py_ssize_t out_sx, Py_ssize_t width) {
    stencil_row_impl(row, w, offsets, taps, sx, out, out_sx, width, 0);
}

#ifdef HAVE_X86_FMA
__attribute__((target("avx2,fma"))) static void stencil_row_fma(const float *row, const float *w,
                                                                 const int64_t *offsets, Py_ssize_t taps,
                                                                 Py_ssize_t sx, float *out, Py_ssize_t out_sx,
                                                                 Py_ssize_t width) {
    stencil_row_impl(row, w, offsets, taps, sx, out, out_sx, width, 1);
}
#endif

/* the vector FMA where the product's path has one (AVX2, AVX-512), else fmaf lane by lane: the same bits */
static stencil_row_fn stencil_row_for_path(void) {
#ifdef HAVE_X86_FMA
    if (matmul_path() != PATH_SCALAR) return stencil_row_fma;
#endif
    return stencil_row_plain;
}

/* Whether every window of a stencil lies inside its plane of `plane` elements: the first and last outputs' windows
   (rows wp apart) by the least and greatest offsets. */
static int windows_inside(const int64_t *offsets, Py_ssize_t taps, Py_ssize_t plane, Py_ssize_t wp,
                          const Py_ssize_t *window) {
    const Py_ssize_t y0 = window[0], x0 = window[1], sy = window[2], sx = window[3], th = window[4], tw = window[5];
    if (taps == 0 || th == 0 || tw == 0) return 1;
    Py_ssize_t lo = offsets[0], hi = offsets[0];
    for (Py_ssize_t k = 1; k < taps; ++k) {
        lo = offsets[k] < lo ? offsets[k] : lo;
        hi = offsets[k] > hi ? offsets[k] : hi;
    }
    const Py_ssize_t first = y0 * wp + x0, last = (y0 + (th - 1) * sy) * wp + x0 + (tw - 1) * sx;
    return first + lo >= 0 && last + hi < plane;
}

PyDoc_STRVAR(stencil_doc,
    "stencil(img, weights, offsets, out, geometry, threads)\n"
    "Contiguous float32 img [planes, hp, wp] and weights [c, taps]; int64 offsets [taps] (elements within a plane);\n"
    "out: float32, written at out_at + p * out_sp + t * out_st + u * out_su for p < planes, t < th, u < tw.\n"
    "geometry: int64 [planes, hp, wp, c, y0, x0, sy, sx, th, tw, out_at, out_sp, out_st, out_su].  Each output\n"
    "the fixed-order dot product of matmul_nt over the taps (see kernels/detreduce.c).");

static PyObject *py_stencil(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oi, *ow, *of, *oo, *og;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOi", &oi, &ow, &of, &oo, &og, &threads)) return NULL;
    buf_t bi, bw, bf, bo, bg;
    buf_t *held[5] = {&bi, &bw, &bf, &bo, &bg};
    int got = 0;
    if (acquire(oi, &bi, 'f', 0, "img") == 0 && ++got && acquire(ow, &bw, 'f', 0, "weights") == 0 && ++got &&
        acquire(of, &bf, 'q', 0, "offsets") == 0 && ++got && acquire(oo, &bo, 'f', 1, "out") == 0 && ++got &&
        acquire(og, &bg, 'q', 0, "geometry") == 0 && ++got) {
    }
    int rc = -1;
    if (got == 5) {
        const int64_t *offsets = (const int64_t *)bf.view.buf;
        const Py_ssize_t taps = count(&bf);
        Py_ssize_t g[14] = {0};
        const int ok = read_geometry(&bg, g, 14) && threads >= 1;
        const Py_ssize_t planes = g[0], hp = g[1], wp = g[2], c = g[3], sy = g[6], sx = g[7], th = g[8], tw = g[9];
        const Py_ssize_t out_at = g[10], out_sp = g[11], out_st = g[12], out_su = g[13];
        const Py_ssize_t reach = out_at + (planes - 1) * out_sp + (th - 1) * out_st + (tw - 1) * out_su;
        if (!ok || c < 1 || sy < 1 || sx < 1) {
            PyErr_SetString(PyExc_ValueError, "stencil: geometry of 14 int64 values >= 0, c, sy, sx >= 1; threads >= 1");
        } else if (count(&bi) != planes * hp * wp || count(&bw) != c * taps || (planes > 0 && planes % c != 0)) {
            PyErr_SetString(PyExc_ValueError, "stencil: size mismatch: img [planes, hp, wp], weights [c, taps], "
                                              "planes a multiple of c");
        } else if (planes > 0 && th > 0 && tw > 0 &&
                   (!windows_inside(offsets, taps, hp * wp, wp, g + 4) || reach >= count(&bo))) {
            PyErr_SetString(PyExc_ValueError, "stencil: a window outside its plane or an output outside out");
        } else {
            const Py_ssize_t y0 = g[4], x0 = g[5];
            const float *img = (const float *)bi.view.buf, *w = (const float *)bw.view.buf;
            float *out = (float *)bo.view.buf;
            const int team = planes * th * tw * (taps > 0 ? taps : 1) >= LAYOUT_PARALLEL_MIN ? threads : 1;
            const stencil_row_fn stencil_row = stencil_row_for_path();
            Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(team) schedule(static)
            for (Py_ssize_t p = 0; p < planes; ++p) {
                for (Py_ssize_t t = 0; t < th; ++t) {
                    const float *row = img + p * hp * wp + (y0 + t * sy) * wp + x0;
                    stencil_row(row, w + (p % c) * taps, offsets, taps, sx, out + out_at + p * out_sp + t * out_st,
                                out_su, tw);
                }
            }
            Py_END_ALLOW_THREADS
            rc = 0;
        }
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* stencil_weight_grad: a depthwise convolution's weight gradient, gw[c, k] = the fixed-order dot product (as above)
 * over the outputs (n, y, x) in row-major order, t = (n Th + y) Tw + x, of g[n, c, y, x] and
 * img[n c, (y0 + y sy) Wp + x0 + x sx + offsets[k]]: the one-channel product of the output gradient's plane and the
 * patch columns of d2_ops' grouped convolution (lane t mod 8 of each output), with whole runs of 8 outputs that start
 * at lane 0 as one vector step.  Channels are shared out between up to `threads` OpenMP threads. */

/* The dot product over the outputs of one channel and one tap: the outputs' (g, window value) pairs in order, 8 at a
   time into one vector FMA (lane = the output's position mod 8), read straight from the row where 8 start at lane 0
   there, else staged; the last step padded with g = +0 and x = -0, which adds the exact product -0 to the lanes
   past the end: x + (-0) = x for every x, so they keep their bits (the product's tail does the same).
   window: y0, x0, sy, sx, th, tw. */
static inline __attribute__((always_inline)) float stencil_dot_impl(const float *img, const float *g, Py_ssize_t n,
                                                                    Py_ssize_t c, Py_ssize_t plane, Py_ssize_t wp,
                                                                    const Py_ssize_t *window, int64_t offset,
                                                                    const int use_fma) {
    (void)use_fma;
    const Py_ssize_t y0 = window[0], x0 = window[1], sy = window[2], sx = window[3], th = window[4], tw = window[5];
    lanes_t acc = (lanes_t){0}, gv, xv;
    float gbuf[DOT_LANES], xbuf[DOT_LANES];
    int fill = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        for (Py_ssize_t y = 0; y < th; ++y) {
            const float *gr = g + ((i * c) * th + y) * tw;
            const float *xr = img + (i * c) * plane + (y0 + y * sy) * wp + x0 + offset;
            Py_ssize_t x = 0;
            while (x < tw) {
                if (fill == 0 && sx == 1 && tw - x >= DOT_LANES) {
                    LOAD_LANES(gv, gr + x);
                    LOAD_LANES(xv, xr + x);
                    FMA_STEP(acc, gv, xv);
                    x += DOT_LANES;
                    continue;
                }
                gbuf[fill] = gr[x];
                xbuf[fill] = xr[x * sx];
                ++x;
                if (++fill == DOT_LANES) {
                    LOAD_LANES(gv, gbuf);
                    LOAD_LANES(xv, xbuf);
                    FMA_STEP(acc, gv, xv);
                    fill = 0;
                }
            }
        }
    }
    if (fill > 0) {
        for (int l = fill; l < DOT_LANES; ++l) {
            gbuf[l] = 0.0f;
            xbuf[l] = -0.0f;
        }
        LOAD_LANES(gv, gbuf);
        LOAD_LANES(xv, xbuf);
        FMA_STEP(acc, gv, xv);
    }
    const float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3], s45 = acc[4] + acc[5], s67 = acc[6] + acc[7];
    return (s01 + s23) + (s45 + s67);
}

typedef float (*stencil_dot_fn)(const float *, const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                const Py_ssize_t *, int64_t);

static float stencil_dot_plain(const float *img, const float *g, Py_ssize_t n, Py_ssize_t c, Py_ssize_t plane,
                               Py_ssize_t wp, const Py_ssize_t *window, int64_t offset) {
    return stencil_dot_impl(img, g, n, c, plane, wp, window, offset, 0);
}

#ifdef HAVE_X86_FMA
__attribute__((target("avx2,fma"))) static float stencil_dot_fma(const float *img, const float *g, Py_ssize_t n,
                                                                  Py_ssize_t c, Py_ssize_t plane, Py_ssize_t wp,
                                                                  const Py_ssize_t *window, int64_t offset) {
    return stencil_dot_impl(img, g, n, c, plane, wp, window, offset, 1);
}
#endif

static stencil_dot_fn stencil_dot_for_path(void) {
#ifdef HAVE_X86_FMA
    if (matmul_path() != PATH_SCALAR) return stencil_dot_fma;
#endif
    return stencil_dot_plain;
}

PyDoc_STRVAR(stencil_weight_grad_doc,
    "stencil_weight_grad(img, g, offsets, out, geometry, threads)\n"
    "Contiguous float32 img [n * c, hp, wp], g [n, c, th, tw] and out [c, taps]; int64 offsets [taps];\n"
    "geometry: int64 [n, c, hp, wp, y0, x0, sy, sx, th, tw].  out[c, k]: the fixed-order dot product over the\n"
    "outputs (n, y, x) of g and the image at the output's window position plus offsets[k].");

static PyObject *py_stencil_weight_grad(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oi, *og, *of, *oo, *ogeo;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOi", &oi, &og, &of, &oo, &ogeo, &threads)) return NULL;
    buf_t bi, bg, bf, bo, bgeo;
    buf_t *held[5] = {&bi, &bg, &bf, &bo, &bgeo};
    int got = 0;
    if (acquire(oi, &bi, 'f', 0, "img") == 0 && ++got && acquire(og, &bg, 'f', 0, "g") == 0 && ++got &&
        acquire(of, &bf, 'q', 0, "offsets") == 0 && ++got && acquire(oo, &bo, 'f', 1, "out") == 0 && ++got &&
        acquire(ogeo, &bgeo, 'q', 0, "geometry") == 0 && ++got) {
    }
    int rc = -1;
    if (got == 5) {
        const int64_t *offsets = (const int64_t *)bf.view.buf;
        const Py_ssize_t taps = count(&bf);
        Py_ssize_t geo[10] = {0};
        const int ok = read_geometry(&bgeo, geo, 10) && threads >= 1;
        const Py_ssize_t n = geo[0], c = geo[1], hp = geo[2], wp = geo[3], sy = geo[6], sx = geo[7];
        const Py_ssize_t th = geo[8], tw = geo[9];
        if (!ok || sy < 1 || sx < 1) {
            PyErr_SetString(PyExc_ValueError,
                            "stencil_weight_grad: geometry of 10 int64 values >= 0, sy, sx >= 1; threads >= 1");
        } else if (count(&bi) != n * c * hp * wp || count(&bg) != n * c * th * tw || count(&bo) != c * taps) {
            PyErr_SetString(PyExc_ValueError, "stencil_weight_grad: size mismatch: img [n c, hp, wp], "
                                              "g [n, c, th, tw], out [c, taps]");
        } else if (n > 0 && !windows_inside(offsets, taps, hp * wp, wp, geo + 4)) {
            PyErr_SetString(PyExc_ValueError, "stencil_weight_grad: a window outside its plane");
        } else {
            const float *img = (const float *)bi.view.buf, *g = (const float *)bg.view.buf;
            float *out = (float *)bo.view.buf;
            const int team = c * taps * n * th * tw >= LAYOUT_PARALLEL_MIN ? threads : 1;
            const stencil_dot_fn dot = stencil_dot_for_path();
            const Py_ssize_t *window = geo + 4;
            Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(team) schedule(static)
            for (Py_ssize_t ch = 0; ch < c; ++ch) {
                for (Py_ssize_t k = 0; k < taps; ++k) {
                    out[ch * taps + k] = dot(img + ch * hp * wp, g + ch * th * tw, n, c, hp * wp, wp, window, offsets[k]);
                }
            }
            Py_END_ALLOW_THREADS
            rc = 0;
        }
    }
    for (int i = 0; i < got; ++i) release(held[i]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"deposit", py_deposit, METH_VARARGS, deposit_doc},
    {"combine", py_combine, METH_VARARGS, combine_doc},
    {"tops", py_tops, METH_VARARGS, tops_doc},
    {"fold", py_fold, METH_VARARGS, fold_doc},
    {"finalize", py_finalize, METH_VARARGS, finalize_doc},
    {"owner_sum", py_owner_sum, METH_VARARGS, owner_sum_doc},
    {"matmul_nt", py_matmul_nt, METH_VARARGS, matmul_doc},
    {"matmul_nt_view", py_matmul_nt_view, METH_VARARGS, matmul_view_doc},
    {"matmul_nt_parts", py_matmul_nt_parts, METH_VARARGS, matmul_parts_doc},
    {"_matmul_paths", py_matmul_paths, METH_NOARGS, matmul_paths_doc},
    {"_matmul_path", py_matmul_path, METH_VARARGS, matmul_path_doc},
    {"batch_norm_forward", py_batch_norm_forward, METH_VARARGS, bn_forward_doc},
    {"batch_norm_backward", py_batch_norm_backward, METH_VARARGS, bn_backward_doc},
    {"max_pool_forward", py_max_pool_forward, METH_VARARGS, max_pool_forward_doc},
    {"max_pool_backward", py_max_pool_backward, METH_VARARGS, max_pool_backward_doc},
    {"exp", py_exp, METH_VARARGS, exp_doc},
    {"pad_image", py_pad_image, METH_VARARGS, pad_image_doc},
    {"stencil", py_stencil, METH_VARARGS, stencil_doc},
    {"stencil_weight_grad", py_stencil_weight_grad, METH_VARARGS, stencil_weight_grad_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_detreduce",
    "CPU kernels of hpc-elastic's deterministic allreduce and D2 operators (see kernels/detreduce.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__detreduce(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "NONFINITE_TOP", NONFINITE_TOP) != 0 ||
        PyModule_AddIntConstant(m, "DOT_LANES", DOT_LANES) != 0 ||
        PyModule_AddIntConstant(m, "ABI_VERSION", 1) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* DL²'s policy network and greedy inference loop (DL², §4.1), the CPython extension hpc_elastic._dl2.

   hpc_elastic/policy/dl2.py defines the inference loop (infer: state -> logits -> masked choice -> place the
   task, until void or nothing fits, in batches of J jobs) for any chooser; a deployed policy chooses greedily and
   places one task per inference, so a slot of a large cluster takes thousands of inferences.  This file runs the
   greedy loop whole: `decide` gives the same action sequence and servers as infer with the greedy chooser
   (tests/unit/policy/test_dl2_state.py checks it on random slots with ties), and `forward` is the network both
   use, so their logits are the same bits.

   The network (see Network in policy/dl2.py): a global MLP over the J x F state and, optionally, a per-job head
   applied to each job's row and its position r / J, whose three outputs add to that job's three logits.  Every
   dense layer computes out[j] = (sum over k of in[k] * w[k][j], accumulated from +0 in increasing k, each product
   and each sum rounded to float32) + b[j], then max(., 0) except after a net's last layer.  The first global layer
   is formed by rows: p[r][j] = the same sum over row r's F inputs, then h[j] = (sum of p[r][j] in increasing r) +
   b[j].  So one job's row changing (an action) changes one p[r]: the loop recomputes it and that job's head only,
   and gets the bits a whole forward pass would.  No FMA contraction (-ffp-contract=off): the vectorised loops run
   over independent outputs and keep each output's order. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pybuffer.h"

/* The dense loops have x86-64-v3 (AVX2) and x86-64-v4 (AVX-512) clones (GCC target_clones): each vector lane is
   one output's own product and sum, rounded as the scalar code rounds them, so every clone gives the same bits. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(DL2_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* ---------------------------------------------------------------- buffers */

/* acquire (pybuffer.h), then exactly `count` elements */
static int acquire_n(PyObject *obj, buf_t *b, char kind, int writable, Py_ssize_t count, const char *name) {
    if (acquire(obj, b, kind, writable, name)) return -1;
    if (b->view.len / b->view.itemsize != count) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd elements, expected %zd", name, b->view.len / b->view.itemsize,
                     count);
        release(b);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the network */

#define MAX_LAYERS 16

typedef struct {
    int64_t in, out;
    const float *w; /* in x out, row-major */
    const float *b; /* out */
} layer_t;

typedef struct {
    int64_t jobs, columns;
    int global_n, rows_n;
    layer_t global[MAX_LAYERS], rows[MAX_LAYERS];
    int64_t widest;
} net_t;

/* dims: [global layers, head layers, (in, out) per global layer, (in, out) per head layer]; weights: per layer
   its w then its b, global layers first.  ValueError unless the shapes chain and the sizes add up. */
static int parse_net(const int64_t *dims, Py_ssize_t ndims, const float *weights, Py_ssize_t nweights,
                     int64_t jobs, int64_t columns, net_t *net) {
    if (jobs < 1 || columns < 1) {
        PyErr_Format(PyExc_ValueError, "jobs and columns must be >= 1, got %lld and %lld", (long long)jobs,
                     (long long)columns);
        return -1;
    }
    if (ndims < 2 || dims[0] < 1 || dims[0] > MAX_LAYERS || dims[1] < 0 || dims[1] > MAX_LAYERS ||
        ndims != 2 + 2 * (dims[0] + dims[1])) {
        PyErr_SetString(PyExc_ValueError, "network dims: malformed layer counts");
        return -1;
    }
    net->jobs = jobs;
    net->columns = columns;
    net->global_n = (int)dims[0];
    net->rows_n = (int)dims[1];
    net->widest = 1;
    Py_ssize_t at = 0;
    for (int l = 0; l < net->global_n + net->rows_n; l++) {
        layer_t *layer = l < net->global_n ? &net->global[l] : &net->rows[l - net->global_n];
        layer->in = dims[2 + 2 * l];
        layer->out = dims[3 + 2 * l];
        if (layer->in < 1 || layer->out < 1 || layer->in > (1 << 24) || layer->out > (1 << 24)) {
            PyErr_Format(PyExc_ValueError, "network layer %d: bad shape", l);
            return -1;
        }
        int first = l == 0 || l == net->global_n;
        if (!first && layer->in != dims[1 + 2 * l]) {
            PyErr_Format(PyExc_ValueError, "network layer %d takes %lld inputs, the one before gives %lld", l,
                         (long long)layer->in, (long long)dims[1 + 2 * l]);
            return -1;
        }
        Py_ssize_t need = (Py_ssize_t)(layer->in * layer->out + layer->out);
        if (nweights - at < need) {
            PyErr_SetString(PyExc_ValueError, "network weights: fewer than the dims need");
            return -1;
        }
        layer->w = weights + at;
        layer->b = weights + at + layer->in * layer->out;
        at += need;
        if (layer->out > net->widest) net->widest = layer->out;
    }
    if (at != nweights) {
        PyErr_SetString(PyExc_ValueError, "network weights: more than the dims need");
        return -1;
    }
    if (net->global[0].in != jobs * columns || net->global[net->global_n - 1].out != 3 * jobs + 1) {
        PyErr_Format(PyExc_ValueError, "network: %lld inputs and %lld outputs, a J=%lld x F=%lld state needs %lld and %lld",
                     (long long)net->global[0].in, (long long)net->global[net->global_n - 1].out, (long long)jobs,
                     (long long)columns, (long long)(jobs * columns), (long long)(3 * jobs + 1));
        return -1;
    }
    if (net->rows_n && (net->rows[0].in != columns + 1 || net->rows[net->rows_n - 1].out != 3)) {
        PyErr_SetString(PyExc_ValueError, "network: the per-job head must take F + 1 inputs and give 3");
        return -1;
    }
    return 0;
}

/* out[j] = sum_k in[k] * w[k][j] in increasing k from +0 (no bias) */
CLONES static void dot_rows(const float *restrict in, int64_t m, const float *restrict w, int64_t n, float *restrict out) {
    for (int64_t j = 0; j < n; j++) out[j] = 0.0f;
    for (int64_t k = 0; k < m; k++) {
        const float v = in[k];
        const float *restrict row = w + k * n;
        for (int64_t j = 0; j < n; j++) out[j] = out[j] + v * row[j];
    }
}

static void bias_relu(float *restrict out, const float *restrict b, int64_t n, int relu) {
    for (int64_t j = 0; j < n; j++) {
        float s = out[j] + b[j];
        out[j] = relu ? (s > 0.0f ? s : 0.0f) : s;
    }
}

/* a chain of layers from `in`; scratch holds two vectors of net->widest; returns where the output is */
static float *run_layers(const layer_t *layers, int count, const float *in, float *scratch, int64_t widest) {
    float *a = scratch, *b = scratch + widest;
    const float *x = in;
    for (int l = 0; l < count; l++) {
        dot_rows(x, layers[l].in, layers[l].w, layers[l].out, a);
        bias_relu(a, layers[l].b, layers[l].out, l < count - 1);
        x = a;
        float *t = a;
        a = b;
        b = t;
    }
    return (float *)x;
}

typedef struct {
    const net_t *net;
    float *x;       /* J x F: the state in float32 */
    float *partial; /* J x H: the first global layer's sums per row */
    float *local;   /* J x 3: the per-job head's outputs */
    float *hidden;  /* H */
    float *scratch; /* 2 x widest */
    float *head_in; /* F + 1 */
    float *logits;  /* 3J + 1 */
} work_t;

static void work_free(work_t *w) {
    free(w->x);
    free(w->partial);
    free(w->local);
    free(w->hidden);
    free(w->scratch);
    free(w->head_in);
    free(w->logits);
}

static int work_alloc(work_t *w, const net_t *net) {
    int64_t J = net->jobs, F = net->columns, H = net->global[0].out;
    memset(w, 0, sizeof(*w));
    w->net = net;
    w->x = calloc((size_t)(J * F), sizeof(float));
    w->partial = calloc((size_t)(J * H), sizeof(float));
    w->local = calloc((size_t)(J * 3), sizeof(float));
    w->hidden = calloc((size_t)H, sizeof(float));
    w->scratch = calloc((size_t)(2 * net->widest), sizeof(float));
    w->head_in = calloc((size_t)(F + 1), sizeof(float));
    w->logits = calloc((size_t)(3 * J + 1), sizeof(float));
    if (!w->x || !w->partial || !w->local || !w->hidden || !w->scratch || !w->head_in || !w->logits) {
        work_free(w);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* row r of the state changed: its first-layer sums and its head's outputs */
static void refresh_row(work_t *w, int64_t r) {
    const net_t *net = w->net;
    int64_t F = net->columns, H = net->global[0].out;
    const float *xr = w->x + r * F;
    dot_rows(xr, F, net->global[0].w + r * F * H, H, w->partial + r * H);
    if (net->rows_n) {
        memcpy(w->head_in, xr, (size_t)F * sizeof(float));
        w->head_in[F] = (float)r / (float)net->jobs;
        const float *out = run_layers(net->rows, net->rows_n, w->head_in, w->scratch, net->widest);
        memcpy(w->local + 3 * r, out, 3 * sizeof(float));
    }
}

/* the logits from the rows' sums and heads */
CLONES static void logits_now(work_t *w) {
    const net_t *net = w->net;
    int64_t J = net->jobs, H = net->global[0].out, A = 3 * J + 1;
    float *h = w->hidden;
    for (int64_t j = 0; j < H; j++) h[j] = 0.0f;
    for (int64_t r = 0; r < J; r++) {
        const float *restrict p = w->partial + r * H;
        for (int64_t j = 0; j < H; j++) h[j] = h[j] + p[j];
    }
    bias_relu(h, net->global[0].b, H, net->global_n > 1);
    const float *out = net->global_n > 1 ? run_layers(net->global + 1, net->global_n - 1, h, w->scratch, net->widest) : h;
    memcpy(w->logits, out, (size_t)A * sizeof(float));
    if (net->rows_n)
        for (int64_t i = 0; i < 3 * J; i++) w->logits[i] = w->logits[i] + w->local[i];
}

/* ---------------------------------------------------------------- forward */

static PyObject *py_forward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *odims, *oweights, *ox, *oout;
    long long jobs, columns;
    if (!PyArg_ParseTuple(args, "OOLLOO", &odims, &oweights, &jobs, &columns, &ox, &oout)) return NULL;
    buf_t dims = {0}, weights = {0}, x = {0}, out = {0};
    net_t net;
    work_t w;
    PyObject *result = NULL;
    if (acquire(odims, &dims, 'q', 0, "dims") || acquire(oweights, &weights, 'f', 0, "weights")) goto done;
    if (parse_net(dims.view.buf, dims.view.len / 8, weights.view.buf, weights.view.len / 4, jobs, columns, &net))
        goto done;
    if (acquire_n(ox, &x, 'f', 0, (Py_ssize_t)(jobs * columns), "state") ||
        acquire_n(oout, &out, 'f', 1, (Py_ssize_t)(3 * jobs + 1), "logits"))
        goto done;
    if (work_alloc(&w, &net)) goto done;
    memcpy(w.x, x.view.buf, (size_t)(jobs * columns) * sizeof(float));
    for (int64_t r = 0; r < jobs; r++) refresh_row(&w, r);
    logits_now(&w);
    memcpy(out.view.buf, w.logits, (size_t)(3 * jobs + 1) * sizeof(float));
    work_free(&w);
    result = Py_None;
    Py_INCREF(result);
done:
    release(&dims);
    release(&weights);
    release(&x);
    release(&out);
    return result;
}

/* ---------------------------------------------------------------- the slot's packing (policy/slots.py's Packing) */

enum { WORKER = 0, PS = 1, BOTH = 2, VOID = 3 }; /* JOB_ACTIONS' order, then void */

typedef struct {
    int64_t servers;
    int64_t *free_gpu, *free_cpu;
    const int64_t *demand; /* per job type: worker GPUs, worker cores, PS cores */
} pack_t;

/* Packing._server: the fitting server with the most free units of what the task needs most (GPUs when it needs
   any, else cores), the first of equals; -1 when none fits */
static int64_t pick_server(const pack_t *p, int64_t gpus, int64_t cpus) {
    int64_t best = -1, key_best = -1;
    for (int64_t s = 0; s < p->servers; s++) {
        if (p->free_gpu[s] < gpus || p->free_cpu[s] < cpus) continue;
        int64_t key = gpus > 0 ? p->free_gpu[s] : p->free_cpu[s];
        if (key > key_best) {
            best = s;
            key_best = key;
        }
    }
    return best;
}

static void give(pack_t *p, int64_t type, int64_t worker, int64_t ps) {
    const int64_t *d = p->demand + 3 * type;
    if (worker >= 0) {
        p->free_gpu[worker] += d[0];
        p->free_cpu[worker] += d[1];
    }
    if (ps >= 0) p->free_cpu[ps] += d[2];
}

/* Packing._take without the maxima (the caller checks them): 1 and the servers, or 0 with nothing taken */
static int take(pack_t *p, int64_t type, int action, int64_t *worker, int64_t *ps) {
    const int64_t *d = p->demand + 3 * type;
    *worker = *ps = -1;
    if (action != PS) {
        *worker = pick_server(p, d[0], d[1]);
        if (*worker < 0) return 0;
        p->free_gpu[*worker] -= d[0];
        p->free_cpu[*worker] -= d[1];
    }
    if (action != WORKER) {
        *ps = pick_server(p, 0, d[2]);
        if (*ps < 0) {
            give(p, type, *worker, -1);
            *worker = -1;
            return 0;
        }
        p->free_cpu[*ps] -= d[2];
    }
    return 1;
}

static int fits(pack_t *p, int64_t type, int action) {
    int64_t worker, ps;
    if (!take(p, type, action, &worker, &ps)) return 0;
    give(p, type, worker, ps);
    return 1;
}

/* ---------------------------------------------------------------- decide */

typedef struct {
    /* the slot */
    int64_t n, types, base;
    double share_scale, tasks_scale;
    int64_t total_gpus, total_cpus;
    const double *rows;     /* n x F: each job's first state row */
    const int64_t *jobs;    /* n x 3: type, max workers, max PS */
    pack_t pack;
    /* what no longer fits anywhere this slot (free resources only shrink): dead[type * 3 + action] */
    unsigned char *dead;
    int64_t dead_count;
    /* the batch */
    int64_t start, m;
    unsigned char *present; /* per job type */
    int64_t *workers, *ps;  /* per batch row */
    unsigned char *tried;   /* per action */
    work_t work;
    /* the decision */
    int64_t *out, capacity, count;
} slot_t;

static int64_t type_of(const slot_t *s, int64_t k) { return s->jobs[3 * (s->start + k)]; }

static void mark_dead(slot_t *s, int64_t type, int action) {
    if (!s->dead[3 * type + action]) {
        s->dead[3 * type + action] = 1;
        s->dead_count++;
    }
}

/* the batch is done: every action of every job type in it is dead */
static int exhausted(const slot_t *s) {
    for (int64_t t = 0; t < s->types; t++)
        if (s->present[t])
            for (int a = 0; a < 3; a++)
                if (!s->dead[3 * t + a]) return 0;
    return 1;
}

/* whether _Batch.mask allows this one job action now: a job of the batch below its maximum of the task, the type
   and action not dead, and Packing.fits; a refusal by fits kills the type and action */
static int allows(slot_t *s, int64_t action) {
    int64_t k = action / 3;
    int a = (int)(action % 3);
    if (k >= s->m) return 0;
    const int64_t *job = s->jobs + 3 * (s->start + k);
    if ((a != PS && s->workers[k] >= job[1]) || (a != WORKER && s->ps[k] >= job[2])) return 0;
    if (s->dead[3 * job[0] + a]) return 0;
    if (fits(&s->pack, job[0], a)) return 1;
    mark_dead(s, job[0], a);
    return 0;
}

/* _Batch.mask()[:void].any(), with the mask's side effect: a (type, action) some job has room for and that does
   not fit is dead */
static int any_allowed(slot_t *s) {
    int any = 0;
    for (int64_t t = 0; t < s->types; t++) {
        if (!s->present[t]) continue;
        int room[3] = {0, 0, 0};
        for (int64_t k = 0; k < s->m; k++) {
            const int64_t *job = s->jobs + 3 * (s->start + k);
            if (job[0] != t) continue;
            int w = s->workers[k] < job[1], p = s->ps[k] < job[2];
            room[WORKER] |= w;
            room[PS] |= p;
            room[BOTH] |= w && p;
        }
        for (int a = 0; a < 3; a++) {
            if (!room[a] || s->dead[3 * t + a]) continue;
            if (fits(&s->pack, t, a))
                any = 1;
            else
                mark_dead(s, t, a);
        }
    }
    return any;
}

static int record(slot_t *s, int64_t row, int64_t action, int64_t worker, int64_t ps) {
    if (s->count >= s->capacity) {
        PyErr_SetString(PyExc_ValueError, "decide: more actions than the output holds");
        return -1;
    }
    int64_t *o = s->out + 4 * s->count++;
    o[0] = row;
    o[1] = action;
    o[2] = worker;
    o[3] = ps;
    return 0;
}

/* _Batch.apply: place the task(s), then the job's share, workers and PS in its state row */
static int apply(slot_t *s, int64_t action) {
    int64_t k = action / 3;
    int a = (int)(action % 3);
    int64_t type = type_of(s, k), worker, ps;
    if (!take(&s->pack, type, a, &worker, &ps)) {
        PyErr_Format(PyExc_ValueError, "action %lld does not fit: the mask allowed it", (long long)action);
        return -1;
    }
    if (record(s, s->start + k, a, worker, ps)) return -1;
    if (a != PS) s->workers[k]++;
    if (a != WORKER) s->ps[k]++;
    const int64_t *d = s->pack.demand + 3 * type;
    int64_t w = s->workers[k], p = s->ps[k];
    /* SlotInput.dominant_share, in the same float64 operations */
    double gpu = s->total_gpus ? (double)(w * d[0]) / (double)s->total_gpus : 0.0;
    double cpu = (double)(w * d[1] + p * d[2]) / (double)s->total_cpus;
    double share = cpu > gpu ? cpu : gpu;
    float *x = s->work.x + k * s->work.net->columns + s->base;
    x[2] = (float)(share / s->share_scale);
    x[3] = (float)((double)w / s->tasks_scale);
    x[4] = (float)((double)p / s->tasks_scale);
    refresh_row(&s->work, k);
    return 0;
}

/* before an inference, every job action that allows() refuses without asking the packing (a row beyond the
   batch, a job at its maximum of that task, a dead type and action) counts as tried: the walk below skips what
   allows() would refuse with no side effect, so it meets the same first action */
static void block_refused(slot_t *s) {
    int64_t J = s->work.net->jobs;
    for (int64_t k = 0; k < J; k++) {
        unsigned char *t = s->tried + 3 * k;
        if (k >= s->m) {
            t[0] = t[1] = t[2] = 1;
            continue;
        }
        const int64_t *job = s->jobs + 3 * (s->start + k);
        const unsigned char *dead = s->dead + 3 * job[0];
        int full_w = s->workers[k] >= job[1], full_p = s->ps[k] >= job[2];
        t[WORKER] = full_w || dead[WORKER];
        t[PS] = full_p || dead[PS];
        t[BOTH] = full_w || full_p || dead[BOTH];
    }
    s->tried[3 * J] = 0;
}

/* the next action in decreasing logit order (np.argsort(-logits, kind="stable"): the lowest index first among
   equals, NaN last) not tried yet */
static int64_t next_action(slot_t *s) {
    const float *v = s->work.logits;
    int64_t A = 3 * s->work.net->jobs + 1, best = -1;
    for (int64_t i = 0; i < A; i++) {
        if (s->tried[i]) continue;
        if (best < 0 || (v[best] != v[best] && v[i] == v[i]) || v[i] > v[best]) best = i;
    }
    if (best >= 0) s->tried[best] = 1;
    return best;
}

/* one batch of J jobs: infer's loop with the greedy chooser, which takes the first allowed action in decreasing
   logit order; -1 on error */
static int run_batch(slot_t *s) {
    const net_t *net = s->work.net;
    int64_t J = net->jobs, F = net->columns, A = 3 * J + 1;
    for (int64_t r = 0; r < J; r++) {
        for (int64_t c = 0; c < F; c++)
            s->work.x[r * F + c] = r < s->m ? (float)s->rows[(s->start + r) * F + c] : 0.0f;
        if (r < s->m) s->workers[r] = s->ps[r] = 0;
        refresh_row(&s->work, r);
    }
    while (!exhausted(s)) {
        logits_now(&s->work);
        block_refused(s);
        int64_t action;
        for (;;) {
            action = next_action(s);
            if (action < 0) return 0; /* not reached: void is always among the actions */
            if (action == A - 1) {
                if (any_allowed(s) && record(s, -1, VOID, -1, -1)) return -1;
                return 0;
            }
            if (allows(s, action)) {
                if (apply(s, action)) return -1;
                break;
            }
        }
    }
    return 0;
}

static PyObject *py_decide(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *odims, *oweights, *orows, *ojobs, *otypes, *ogpus, *ocpus, *oout;
    long long J, F, base, total_gpus, total_cpus;
    double share_scale, tasks_scale;
    if (!PyArg_ParseTuple(args, "OOLLLddLLOOOOOO", &odims, &oweights, &J, &F, &base, &share_scale, &tasks_scale,
                          &total_gpus, &total_cpus, &orows, &ojobs, &otypes, &ogpus, &ocpus, &oout))
        return NULL;
    buf_t dims = {0}, weights = {0}, rows = {0}, jobs = {0}, types = {0}, gpus = {0}, cpus = {0}, out = {0};
    net_t net;
    slot_t s;
    memset(&s, 0, sizeof(s));
    int have_work = 0;
    PyObject *result = NULL;
    if (acquire(odims, &dims, 'q', 0, "dims") || acquire(oweights, &weights, 'f', 0, "weights")) goto done;
    if (parse_net(dims.view.buf, dims.view.len / 8, weights.view.buf, weights.view.len / 4, J, F, &net)) goto done;
    if (base < 0 || base + 5 > F || !(share_scale > 0) || !(tasks_scale > 0) || total_gpus < 0 || total_cpus < 1) {
        PyErr_SetString(PyExc_ValueError, "decide: bad state layout, scales or cluster totals");
        goto done;
    }
    if (acquire(ojobs, &jobs, 'q', 0, "jobs") || acquire(otypes, &types, 'q', 0, "types") ||
        acquire(ogpus, &gpus, 'q', 0, "gpus") || acquire(oout, &out, 'q', 1, "out"))
        goto done;
    s.n = jobs.view.len / 8 / 3;
    s.types = types.view.len / 8 / 3;
    s.pack.servers = gpus.view.len / 8;
    if (acquire_n(orows, &rows, 'd', 0, (Py_ssize_t)(s.n * F), "rows") ||
        acquire_n(ocpus, &cpus, 'q', 0, s.pack.servers, "cpus"))
        goto done;
    s.base = base;
    s.share_scale = share_scale;
    s.tasks_scale = tasks_scale;
    s.total_gpus = total_gpus;
    s.total_cpus = total_cpus;
    s.rows = rows.view.buf;
    s.jobs = jobs.view.buf;
    s.pack.demand = types.view.buf;
    s.out = out.view.buf;
    s.capacity = out.view.len / 8 / 4;
    for (int64_t i = 0; i < s.n; i++)
        if (s.jobs[3 * i] < 0 || s.jobs[3 * i] >= s.types) {
            PyErr_Format(PyExc_ValueError, "decide: job %lld has type %lld, the slot has %lld", (long long)i,
                         (long long)s.jobs[3 * i], (long long)s.types);
            goto done;
        }
    s.pack.free_gpu = malloc((size_t)(s.pack.servers + 1) * sizeof(int64_t));
    s.pack.free_cpu = malloc((size_t)(s.pack.servers + 1) * sizeof(int64_t));
    s.dead = calloc((size_t)(3 * s.types + 1), 1);
    s.present = calloc((size_t)(s.types + 1), 1);
    s.workers = calloc((size_t)J, sizeof(int64_t));
    s.ps = calloc((size_t)J, sizeof(int64_t));
    s.tried = calloc((size_t)(3 * J + 1), 1);
    if (!s.pack.free_gpu || !s.pack.free_cpu || !s.dead || !s.present || !s.workers || !s.ps || !s.tried) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(s.pack.free_gpu, gpus.view.buf, (size_t)s.pack.servers * sizeof(int64_t));
    memcpy(s.pack.free_cpu, cpus.view.buf, (size_t)s.pack.servers * sizeof(int64_t));
    if (work_alloc(&s.work, &net)) goto done;
    have_work = 1;
    /* _batches: the batches of J jobs in arrival order, less those with nothing of their types left to place */
    for (s.start = 0; s.start < s.n; s.start += J) {
        if (s.dead_count == 3 * s.types) break;
        s.m = s.n - s.start < J ? s.n - s.start : J;
        memset(s.present, 0, (size_t)s.types);
        for (int64_t k = 0; k < s.m; k++) s.present[type_of(&s, k)] = 1;
        if (exhausted(&s)) continue;
        if (run_batch(&s)) goto done;
    }
    result = PyLong_FromLongLong(s.count);
done:
    if (have_work) work_free(&s.work);
    free(s.pack.free_gpu);
    free(s.pack.free_cpu);
    free(s.dead);
    free(s.present);
    free(s.workers);
    free(s.ps);
    free(s.tried);
    release(&dims);
    release(&weights);
    release(&rows);
    release(&jobs);
    release(&types);
    release(&gpus);
    release(&cpus);
    release(&out);
    return result;
}

/* ---------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"forward", py_forward, METH_VARARGS,
     "forward(dims, weights, jobs, columns, state, logits): the network's logits of one float32 state."},
    {"decide", py_decide, METH_VARARGS,
     "decide(dims, weights, jobs, columns, base, share_scale, tasks_scale, total_gpus, total_cpus, rows, "
     "job_fields, type_demands, server_gpus, server_cpus, out) -> the number of (row, action, worker server, PS "
     "server) rows written to out: the greedy inference loop of a slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dl2", "DL²'s policy network and greedy inference loop (see kernels/dl2.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__dl2(void) { return PyModule_Create(&module); }

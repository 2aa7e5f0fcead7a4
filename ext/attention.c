/* kvstore._attention: float32 attention with its log-sum-exp, for the batched engine's CPU
 * prefills (a prompt's causal attention, queries against a shared prefix).
 *
 * o[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, h / G, j]) v[b, h / G, j]
 * lse[b, h, i] = log sum_j exp(scale * q . k)
 *
 * over keys j < K, or j <= i + (K - M) with ``causal`` (the last query sees every key);
 * G = Hq / Hkv query heads share a key/value head (no copies of K/V per query head). Blocks
 * of 64 queries x 256 keys, online softmax (flash attention's order): the scores of a block
 * in a register-tiled product against the head's keys transposed once, exp as 2^n * p(f)
 * (degree 7, under an ulp), the weighted sum of values in a second register-tiled product.
 * Sums run in another order than torch's kernels: float32 results agree to rounding.
 *
 * Work items (b, h, query block) are shared by ``threads`` OpenMP threads, interleaved
 * (causal blocks grow with i: interleaving balances them). Built with -fopenmp, the module
 * needs libgomp.so.1: imported after torch, that is torch's own (its wheel bundles it under
 * that name), so the kernel runs on the team torch's operations run on, whose threads are
 * awake right after them; a second runtime's threads would fight them for the cores. The GIL
 * is released during the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define KV_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KV_CLONES
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

#define QB 64  /* queries per block */
#define KB 256 /* keys per block */
#define TR 8   /* rows of the score tile */
#define TC 32  /* columns of the score tile (2 vectors) */

static inline __attribute__((always_inline)) v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline __attribute__((always_inline)) v16 splat(float x) { return (v16){0} + x; }

/* exp(x) for x <= 0 (scores minus their running maximum): 2^n * e^f, f in [-ln2/2, ln2/2],
 * e^f by Taylor to degree 7 (error < 6e-9 relative); below -87 it is 0 (-inf included) */
static inline __attribute__((always_inline)) v16 exp16(v16 x) {
    const v16 lo = splat(-87.0f);
    i16 dead = x < lo; /* lanes of -1 where x is below the range */
    x = (v16)(((i16)x & ~dead) | ((i16)lo & dead));
    v16 t = x * splat(1.44269504088896341f);
    v16 n = t + splat(12582912.0f) - splat(12582912.0f); /* round to nearest */
    v16 f = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v16 p = splat(1.0f / 5040.0f);
    p = p * f + splat(1.0f / 720.0f);
    p = p * f + splat(1.0f / 120.0f);
    p = p * f + splat(1.0f / 24.0f);
    p = p * f + splat(1.0f / 6.0f);
    p = p * f + splat(0.5f);
    p = p * f + splat(1.0f);
    p = p * f + splat(1.0f);
    i16 ni = __builtin_convertvector(n, i16);
    i16 bits = (i16)p + (ni << 23);
    return (v16)(bits & ~dead);
}

typedef struct {
    const float *q, *k, *v;
    float *o, *lse;
    Py_ssize_t B, Hq, Hkv, M, K, D;
    Py_ssize_t qs[3], ks[3], vs[3]; /* strides (elements) of batch, head, row */
    float scale;
    int causal;
} Job;

/* s[r][c] for r < TR rows of qp (row stride D) and c < TC columns of kt (row stride ld) */
static inline __attribute__((always_inline)) void score_tile(const float *qp, const float *kt, Py_ssize_t ld, Py_ssize_t D,
                              float *s, Py_ssize_t sld) {
    v16 a[TR][2];
    for (int r = 0; r < TR; r++)
        a[r][0] = a[r][1] = splat(0.0f);
    for (Py_ssize_t d = 0; d < D; d++) {
        v16 k0 = load16(kt + d * ld), k1 = load16(kt + d * ld + 16);
        for (int r = 0; r < TR; r++) {
            v16 qb = splat(qp[r * D + d]);
            a[r][0] += qb * k0;
            a[r][1] += qb * k1;
        }
    }
    for (int r = 0; r < TR; r++) {
        store16(s + r * sld, a[r][0]);
        store16(s + r * sld + 16, a[r][1]);
    }
}

/* acc[r][0:64] of rows r < 4 of o (row stride D), scaled by alpha[r], plus p[r][0:n] . v */
static inline __attribute__((always_inline)) void pv_tile(const float *p, Py_ssize_t pld, Py_ssize_t n, const float *v,
                           Py_ssize_t vld, float *o, Py_ssize_t D, const float *alpha) {
    v16 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++)
            a[r][c] = load16(o + r * D + c * 16) * splat(alpha[r]);
    for (Py_ssize_t j = 0; j < n; j++) {
        const float *vj = v + j * vld;
        v16 v0 = load16(vj), v1 = load16(vj + 16), v2 = load16(vj + 32), v3 = load16(vj + 48);
        for (int r = 0; r < 4; r++) {
            v16 pb = splat(p[r * pld + j]);
            a[r][0] += pb * v0;
            a[r][1] += pb * v1;
            a[r][2] += pb * v2;
            a[r][3] += pb * v3;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++)
            store16(o + r * D + c * 16, a[r][c]);
}

KV_CLONES
static void run_items(const Job *J, Py_ssize_t first, Py_ssize_t step, float *kt, float *qp,
                      float *s, float *acc, float *vb) {
    const Py_ssize_t D = J->D, M = J->M, K = J->K, G = J->Hq / J->Hkv;
    const Py_ssize_t qblocks = (M + QB - 1) / QB;
    const Py_ssize_t kpad = (K + TC - 1) / TC * TC;
    const Py_ssize_t items = J->B * J->Hq * qblocks;
    const Py_ssize_t shift = K - M; /* causal: query i sees keys j <= i + shift */
    Py_ssize_t have_b = -1, have_h = -1;
    float m[QB], l[QB], alpha[QB];
    for (Py_ssize_t it = first; it < items; it += step) {
        Py_ssize_t b = it / (J->Hq * qblocks), rest = it % (J->Hq * qblocks);
        Py_ssize_t h = rest / qblocks, i0 = (rest % qblocks) * QB;
        Py_ssize_t hk = h / G, rows = M - i0 < QB ? M - i0 : QB;
        const float *kh = J->k + b * J->ks[0] + hk * J->ks[1];
        const float *vh = J->v + b * J->vs[0] + hk * J->vs[1];
        if (b != have_b || hk != have_h) { /* this KV head's keys, transposed: kt[d][j] */
            for (Py_ssize_t j = 0; j < kpad; j++)
                for (Py_ssize_t d = 0; d < D; d++)
                    kt[d * kpad + j] = j < K ? kh[j * J->ks[2] + d] : 0.0f;
            have_b = b, have_h = hk;
        }
        const float *qh = J->q + b * J->qs[0] + h * J->qs[1];
        for (Py_ssize_t r = 0; r < QB; r++) {
            for (Py_ssize_t d = 0; d < D; d++)
                qp[r * D + d] = r < rows ? qh[(i0 + r) * J->qs[2] + d] * J->scale : 0.0f;
            m[r] = -INFINITY, l[r] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * QB * D);
        Py_ssize_t kend = J->causal ? i0 + rows + shift : K; /* keys any row of the block sees */
        if (kend > K)
            kend = K;
        for (Py_ssize_t j0 = 0; j0 < kend; j0 += KB) {
            Py_ssize_t n = kend - j0 < KB ? kend - j0 : KB;
            Py_ssize_t ncol = (n + TC - 1) / TC * TC;
            for (Py_ssize_t r = 0; r < QB; r += TR)
                for (Py_ssize_t c = 0; c < ncol; c += TC)
                    score_tile(qp + r * D, kt + j0 + c, kpad, D, s + r * KB + c, KB);
            for (Py_ssize_t r = 0; r < QB; r++) {
                float *sr = s + r * KB;
                /* columns a row sees: all n, fewer on the diagonal, none for padding rows */
                Py_ssize_t see = r >= rows ? 0 : n;
                if (J->causal && r < rows && i0 + r + shift + 1 - j0 < see)
                    see = i0 + r + shift + 1 - j0;
                if (see < 0)
                    see = 0;
                for (Py_ssize_t c = see; c < ncol; c++)
                    sr[c] = -INFINITY;
                float mx = m[r];
                for (Py_ssize_t c = 0; c < see; c++)
                    mx = sr[c] > mx ? sr[c] : mx;
                if (mx == -INFINITY) { /* nothing seen yet: p = 0, nothing to rescale */
                    alpha[r] = 1.0f;
                    memset(sr, 0, sizeof(float) * ncol);
                    continue;
                }
                v16 sum = splat(0.0f), mv = splat(mx);
                for (Py_ssize_t c = 0; c < ncol; c += 16) {
                    v16 e = exp16(load16(sr + c) - mv);
                    store16(sr + c, e);
                    sum += e;
                }
                float tot = 0.0f;
                for (int z = 0; z < 16; z++)
                    tot += sum[z];
                alpha[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                l[r] = l[r] * alpha[r] + tot;
                m[r] = mx;
            }
            for (Py_ssize_t r = 0; r < QB; r += 4)
                for (Py_ssize_t dc = 0; dc < D; dc += 64) {
                    /* values of this block, contiguous per d-chunk: vb[j][0:64] */
                    if (r == 0)
                        for (Py_ssize_t j = 0; j < n; j++)
                            memcpy(vb + (dc / 64) * KB * 64 + j * 64, vh + (j0 + j) * J->vs[2] + dc,
                                   sizeof(float) * 64);
                    pv_tile(s + r * KB, KB, n, vb + (dc / 64) * KB * 64, 64, acc + r * D + dc, D,
                            alpha + r);
                }
        }
        float *oh = J->o + ((b * J->Hq + h) * M + i0) * D;
        float *lh = J->lse + (b * J->Hq + h) * M + i0;
        for (Py_ssize_t r = 0; r < rows; r++) {
            float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (Py_ssize_t d = 0; d < D; d++)
                oh[r * D + d] = acc[r * D + d] * inv;
            lh[r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
        }
    }
}

PyDoc_STRVAR(attend_doc,
"attend(q, k, v, o, lse, B, Hq, Hkv, M, K, D, qstrides, kstrides, vstrides, scale, causal,\n"
"       threads) -> None\n\n"
"Attention of float32 ``q [B, Hq, M, D]`` over ``k``, ``v [B, Hkv, K, D]`` (last dimension\n"
"contiguous; strides in elements of batch, head and row as 3-tuples) into contiguous ``o\n"
"[B, Hq, M, D]`` and ``lse [B, Hq, M]``; addresses as ints. ``D`` a multiple of 64, ``Hq``\n"
"a multiple of ``Hkv``; on ``threads`` OpenMP threads.");

static PyObject *attend(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, o, lse;
    Job J;
    double scale;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKnnnnnn(nnn)(nnn)(nnn)dpi", &q, &k, &v, &o, &lse, &J.B,
                          &J.Hq, &J.Hkv, &J.M, &J.K, &J.D, &J.qs[0], &J.qs[1], &J.qs[2],
                          &J.ks[0], &J.ks[1], &J.ks[2], &J.vs[0], &J.vs[1], &J.vs[2], &scale,
                          &J.causal, &threads))
        return NULL;
    if (J.B < 1 || J.Hkv < 1 || J.Hq % J.Hkv || J.M < 1 || J.K < 1 || J.D < 64 || J.D % 64
        || J.D > 512 || threads < 1 || !q || !k || !v || !o || !lse) {
        PyErr_SetString(PyExc_ValueError,
                        "attend: B, M, K >= 1, Hq a multiple of Hkv, D a multiple of 64 up to "
                        "512, threads >= 1 and non-null addresses");
        return NULL;
    }
    J.q = (const float *)(uintptr_t)q, J.k = (const float *)(uintptr_t)k;
    J.v = (const float *)(uintptr_t)v, J.o = (float *)(uintptr_t)o;
    J.lse = (float *)(uintptr_t)lse, J.scale = (float)scale;
    const Py_ssize_t kpad = (J.K + TC - 1) / TC * TC;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int nth = 1, me = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads(), me = omp_get_thread_num();
#endif
        float *kt = malloc(sizeof(float) * J.D * kpad);
        float *qp = malloc(sizeof(float) * QB * J.D);
        float *s = malloc(sizeof(float) * QB * KB);
        float *acc = malloc(sizeof(float) * QB * J.D);
        float *vb = malloc(sizeof(float) * KB * J.D);
        if (kt && qp && s && acc && vb)
            run_items(&J, me, nth, kt, qp, s, acc, vb);
        else
            failed = 1;
        free(kt), free(qp), free(s), free(acc), free(vb);
    }
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS, attend_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._attention",
    "float32 attention with its log-sum-exp for the batched engine (ext/attention.c)", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__attention(void) { return PyModule_Create(&module); }

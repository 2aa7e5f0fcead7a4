/* kvstore._attention: float32 attention with its log-sum-exp, for the batched engine's CPU
 * prefills (a prompt's causal attention, queries against a shared prefix).
 *
 * o[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, h / G, j]) v[b, h / G, j]
 * lse[b, h, i] = log sum_j exp(scale * q . k)
 *
 * over keys j < K, or j <= i + (K - M) with ``causal`` (the last query sees every key);
 * G = Hq / Hkv query heads share a key/value head (no copies of K/V per query head). Blocks
 * of 64 queries x 1024 keys, online softmax (flash attention's order): the scores of a block
 * in a register-tiled product against the head's keys transposed once, exp as 2^n * p(f)
 * (degree 7, under an ulp), the weighted sum of values in a second register-tiled product,
 * 8 rows at a time through all three (their scores stay in L1; the values are read in place).
 * Sums run in another order than torch's kernels: float32 results agree to rounding.
 *
 * An item of at most TR rows (a decode step: one query per head) skips the transposition and
 * takes each key's scores as dot products, then the row's softmax at once. ``attend_rows``
 * runs sequences of different lengths (each its own rows of q and its own row of k/v, read in
 * place: a forward's suffix parts without padding or masks), a KV head's G query heads folded
 * into one item's rows; ``attend`` may take a prefix's keys already transposed (kept by the
 * caller across decode steps).
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

/* One build per instruction set (setup.py: kvstore._attention, _attention_avx2 and
 * _attention_avx512 from ext/attention_avx2.c and ext/attention_avx512.c, which define
 * KV_MODULE and include this file; engines/flash.py imports the one torch's CPU capability
 * allows). GCC's target_clones ran this code at about half the speed of a plain -mavx512f
 * build (the clone's vectors went through the default target's lowering). */
#ifndef KV_MODULE
#define KV_MODULE _attention
#endif
#define KV_PASTE2(a, b) a##b
#define KV_PASTE(a, b) KV_PASTE2(a, b)
#define KV_STR2(a) #a
#define KV_STR(a) KV_STR2(a)

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

#define QB 64  /* queries per block */
#define KB 1024 /* keys per block (256: 0.87-0.9x the speed; per-block costs) */
#define TR 8   /* rows of the score tile */
#define TC 32  /* columns of the score tile (2 vectors) */

static inline __attribute__((always_inline)) v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

#ifdef __AVX512F__
#include <immintrin.h>
/* a broadcast; GCC builds ``(v16){0} + x`` as a scalar add first (0 + -0.0 is +0.0) */
static inline __attribute__((always_inline)) v16 splat(float x) { return (v16)_mm512_set1_ps(x); }
#else
static inline __attribute__((always_inline)) v16 splat(float x) { return (v16){0} + x; }
#endif

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
    /* varlen (attend_rows): sequence b's queries are rows qstart[b].. of every head of q
     * (no batch stride), its mlen[b] queries see the first klen[b] keys of k/v batch row
     * krow[b]; o [Hq, N, D], lse [Hq, N] (N = M: every query row of q). A KV head's G
     * query heads are folded into one item's rows. NULL in the dense attend. */
    const int64_t *qstart, *mlen, *krow, *klen;
    Py_ssize_t *first; /* varlen: first item of each sequence (B + 1 entries) */
    /* dense: the keys already transposed, [B, Hkv, D, ktpad] contiguous and zero past K (a
     * shared prefix's, kept across decode steps by the caller), or NULL */
    const float *ktc;
    Py_ssize_t ktpad;
} Job;

/* One work item: up to QB query rows against one KV head. Row r reads q at qr[r], writes
 * o at orow[r] and its log-sum-exp at lrow[r], and sees the first see[r] keys. */
typedef struct {
    const float *kh, *vh;
    const float *kth;    /* the head's keys transposed by the caller (row stride ktpad), or NULL */
    Py_ssize_t kst, vst; /* row strides of the keys and values */
    Py_ssize_t kfull;    /* the head's keys (what a transposition covers) */
    Py_ssize_t kend;     /* keys any row sees: max see[r] */
    Py_ssize_t rows;
    const float *qr[QB];
    float *orow[QB], *lrow[QB];
    Py_ssize_t see[QB];
} Item;

/* lane-wise max(m, x), NaN winning (a NaN score must give a NaN row, as torch's) */
static inline __attribute__((always_inline)) v16 max_nan(v16 m, v16 x) {
    i16 take = (x > m) | (x != x);
    return (v16)(((i16)x & take) | ((i16)m & ~take));
}

/* s[see:n] = -inf (n a multiple of 16: the columns a row does not see); max(mx, s[0:see]),
 * NaN winning. One vector pass: no scalar tail (a short row's cost was in its tail). */
static inline __attribute__((always_inline)) float mask_max(float *s, Py_ssize_t see, Py_ssize_t n,
                                                            float mx) {
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 ninf = splat(-INFINITY);
    v16 m = splat(mx);
    for (Py_ssize_t c = 0; c < n; c += 16) {
        v16 x = load16(s + c);
        if (c + 16 > see) {
            i16 keep = lane < (i16){0} + (int32_t)(see - c < 0 ? 0 : see - c);
            x = (v16)(((i16)x & keep) | ((i16)ninf & ~keep));
            store16(s + c, x);
        }
        m = max_nan(m, x);
    }
    m = max_nan(m, __builtin_shuffle(m, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    m = max_nan(m, __builtin_shuffle(m, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    m = max_nan(m, __builtin_shuffle(m, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    m = max_nan(m, __builtin_shuffle(m, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return m[0] > mx || m[0] != m[0] ? m[0] : mx;
}

/* qp[r][0:D] = scale * q row r for r < rows, zero for rows..upto (D a multiple of 16) */
static inline __attribute__((always_inline)) void scaled_rows(const Item *x, Py_ssize_t rows,
                                                              Py_ssize_t upto, Py_ssize_t D,
                                                              float scale, float *qp) {
    const v16 sc = splat(scale);
    for (Py_ssize_t r = 0; r < upto; r++)
        for (Py_ssize_t d = 0; d < D; d += 16)
            store16(qp + r * D + d, r < rows ? load16(x->qr[r] + d) * sc : splat(0.0f));
}

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

static inline __attribute__((always_inline)) float hsum16(v16 a) {
    a += __builtin_shuffle(a, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    a += __builtin_shuffle(a, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    return a[0] + a[1];
}

/* s[0:n] = exp(s - mx) in place (n a multiple of 16); their sum */
static inline __attribute__((always_inline)) float exp_row(float *s, Py_ssize_t n, float mx) {
    v16 sum = splat(0.0f), mv = splat(mx);
    for (Py_ssize_t c = 0; c < n; c += 16) {
        v16 e = exp16(load16(s + c) - mv);
        store16(s + c, e);
        sum += e;
    }
    return hsum16(sum);
}

static Py_ssize_t item_count(const Job *J) {
    if (!J->qstart)
        return J->B * J->Hq * ((J->M + QB - 1) / QB);
    return J->first[J->B];
}

/* Row r of an item is query i of m against k keys: the keys it sees (causal: j <= i + k - m) */
static inline void row_sees(const Job *J, Item *x, Py_ssize_t r, Py_ssize_t i, Py_ssize_t m,
                            Py_ssize_t k) {
    Py_ssize_t see = k;
    if (J->causal && i + k - m + 1 < see)
        see = i + k - m + 1;
    x->see[r] = see < 0 ? 0 : see;
    x->kend = x->see[r] > x->kend ? x->see[r] : x->kend;
}

/* The rows, keys and addresses of item ``it`` */
static void make_item(const Job *J, Py_ssize_t it, Item *x) {
    const Py_ssize_t D = J->D, G = J->Hq / J->Hkv;
    if (!J->qstart) { /* dense: (b, h, block of QB queries) */
        const Py_ssize_t qblocks = (J->M + QB - 1) / QB;
        Py_ssize_t b = it / (J->Hq * qblocks), rest = it % (J->Hq * qblocks);
        Py_ssize_t h = rest / qblocks, i0 = (rest % qblocks) * QB, hk = h / G;
        x->rows = J->M - i0 < QB ? J->M - i0 : QB;
        x->kh = J->k + b * J->ks[0] + hk * J->ks[1], x->kst = J->ks[2];
        x->vh = J->v + b * J->vs[0] + hk * J->vs[1], x->vst = J->vs[2];
        x->kth = J->ktc ? J->ktc + (b * J->Hkv + hk) * D * J->ktpad : NULL;
        x->kfull = J->K, x->kend = 0;
        for (Py_ssize_t r = 0; r < x->rows; r++) {
            Py_ssize_t i = i0 + r;
            row_sees(J, x, r, i, J->M, J->K);
            x->qr[r] = J->q + b * J->qs[0] + h * J->qs[1] + i * J->qs[2];
            x->orow[r] = J->o + ((b * J->Hq + h) * J->M + i) * D;
            x->lrow[r] = J->lse + (b * J->Hq + h) * J->M + i;
        }
        return;
    }
    /* varlen: (sequence b, KV head hk, block of QB of its G * mlen[b] folded rows) */
    Py_ssize_t lo = 0, hi = J->B; /* the sequence: first[b] <= it < first[b + 1] */
    while (hi - lo > 1) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (J->first[mid] <= it)
            lo = mid;
        else
            hi = mid;
    }
    const Py_ssize_t b = lo, m = J->mlen[b], kb = J->klen[b];
    const Py_ssize_t per = (G * m + QB - 1) / QB; /* items per KV head */
    const Py_ssize_t hk = (it - J->first[b]) / per, f0 = ((it - J->first[b]) % per) * QB;
    x->rows = G * m - f0 < QB ? G * m - f0 : QB;
    x->kh = J->k + J->krow[b] * J->ks[0] + hk * J->ks[1], x->kst = J->ks[2];
    x->vh = J->v + J->krow[b] * J->vs[0] + hk * J->vs[1], x->vst = J->vs[2];
    x->kth = NULL, x->kfull = kb, x->kend = 0;
    for (Py_ssize_t r = 0; r < x->rows; r++) {
        Py_ssize_t f = f0 + r, h = hk * G + f / m, i = f % m;
        row_sees(J, x, r, i, m, kb);
        Py_ssize_t t = J->qstart[b] + i; /* the query's row in q, o and lse */
        x->qr[r] = J->q + h * J->qs[1] + t * J->qs[2];
        x->orow[r] = J->o + (h * J->M + t) * D;
        x->lrow[r] = J->lse + h * J->M + t;
    }
}

/* o and lse of a row from its accumulated values, weight sum and maximum */
static inline void finish_row(const Item *x, Py_ssize_t r, const float *acc, Py_ssize_t D,
                              float m, float l) {
    const int any = l > 0.0f || l != l; /* NaN: the row's NaN, not "no key" */
    const v16 inv = splat(any ? 1.0f / l : 0.0f);
    float *o = x->orow[r];
    for (Py_ssize_t d = 0; d < D; d += 16)
        store16(o + d, load16(acc + d) * inv);
    *x->lrow[r] = any ? m + logf(l) : -INFINITY;
}

/* Few rows (a decode step's query heads on one KV head): each key's scores as dot products
 * straight from the keys (no transposition, which costs more than the products here), the
 * row's softmax over all its keys at once, then the values. s: TR rows of ``ld`` floats. */
static void item_small(const Job *J, const Item *x, float *qp, float *s, Py_ssize_t ld,
                       float *acc) {
    const Py_ssize_t D = J->D, rows = x->rows, n = x->kend, r4 = (rows + 3) / 4 * 4;
    float m[TR], l[TR], one[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    scaled_rows(x, rows, rows, D, J->scale, qp);
    for (Py_ssize_t j = 0; j < n; j++) {
        const float *kj = x->kh + j * x->kst;
        for (Py_ssize_t r = 0; r < rows; r++) {
            v16 a = splat(0.0f);
            for (Py_ssize_t d = 0; d < D; d += 16)
                a += load16(qp + r * D + d) * load16(kj + d);
            s[r * ld + j] = hsum16(a);
        }
    }
    const Py_ssize_t npad = (n + 15) / 16 * 16;
    for (Py_ssize_t r = 0; r < r4; r++) {
        float *sr = s + r * ld;
        float mx = mask_max(sr, r < rows ? x->see[r] : 0, npad, -INFINITY);
        m[r] = mx, l[r] = 0.0f;
        if (mx == -INFINITY) {
            memset(sr, 0, sizeof(float) * npad);
            continue;
        }
        l[r] = exp_row(sr, npad, mx);
    }
    memset(acc, 0, sizeof(float) * r4 * D);
    for (Py_ssize_t r = 0; r < r4; r += 4)
        for (Py_ssize_t dc = 0; dc < D; dc += 64)
            pv_tile(s + r * ld, ld, n, x->vh + dc, x->vst, acc + r * D + dc, D, one);
    for (Py_ssize_t r = 0; r < rows; r++)
        finish_row(x, r, acc + r * D, D, m[r], l[r]);
}

/* Up to QB rows: blocks of KB keys, the scores in register tiles against the head's keys
 * transposed (kt, ``kpad`` columns; *have names the head it holds), online softmax; TR rows
 * at a time through scores, softmax and values, so that their scores stay in L1. */
static void item_tiled(const Job *J, const Item *x, float *kt, Py_ssize_t kpad,
                       const float **have, Py_ssize_t *have_n, float *qp, float *s, float *acc) {
    const Py_ssize_t D = J->D, rows = x->rows;
    const Py_ssize_t rt = (rows + TR - 1) / TR * TR, r4 = (rows + 3) / 4 * 4;
    float m[QB], l[QB], alpha[QB];
    if (x->kth) { /* transposed by the caller */
        kt = (float *)x->kth, kpad = J->ktpad;
    } else if (*have != x->kh || *have_n != x->kfull) { /* the head's keys, transposed: kt[d][j] */
        const Py_ssize_t kp = (x->kfull + TC - 1) / TC * TC;
        for (Py_ssize_t j = 0; j < kp; j++)
            for (Py_ssize_t d = 0; d < D; d++)
                kt[d * kpad + j] = j < x->kfull ? x->kh[j * x->kst + d] : 0.0f;
        *have = x->kh, *have_n = x->kfull;
    }
    scaled_rows(x, rows, rt, D, J->scale, qp);
    for (Py_ssize_t r = 0; r < rt; r++)
        m[r] = -INFINITY, l[r] = 0.0f;
    memset(acc, 0, sizeof(float) * r4 * D);
    for (Py_ssize_t j0 = 0; j0 < x->kend; j0 += KB) {
        Py_ssize_t n = x->kend - j0 < KB ? x->kend - j0 : KB;
        Py_ssize_t ncol = (n + TC - 1) / TC * TC;
        for (Py_ssize_t r0 = 0; r0 < rt; r0 += TR) {
            for (Py_ssize_t c = 0; c < ncol; c += TC)
                score_tile(qp + r0 * D, kt + j0 + c, kpad, D, s + r0 * KB + c, KB);
            const Py_ssize_t rend = r0 + TR < r4 ? r0 + TR : r4;
            for (Py_ssize_t r = r0; r < rend; r++) {
                float *sr = s + r * KB;
                /* columns a row sees: all n, fewer on the diagonal, none for padding rows */
                Py_ssize_t see = r >= rows ? 0 : x->see[r] - j0;
                if (see > n)
                    see = n;
                if (see < 0)
                    see = 0;
                float mx = mask_max(sr, see, ncol, m[r]);
                if (mx == -INFINITY) { /* nothing seen yet: p = 0, nothing to rescale */
                    alpha[r] = 1.0f;
                    memset(sr, 0, sizeof(float) * ncol);
                    continue;
                }
                const float tot = exp_row(sr, ncol, mx);
                alpha[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                l[r] = l[r] * alpha[r] + tot;
                m[r] = mx;
            }
            for (Py_ssize_t r = r0; r < rend; r += 4)
                for (Py_ssize_t dc = 0; dc < D; dc += 64)
                    pv_tile(s + r * KB, KB, n, x->vh + j0 * x->vst + dc, x->vst,
                            acc + r * D + dc, D, alpha + r);
        }
    }
    for (Py_ssize_t r = 0; r < rows; r++)
        finish_row(x, r, acc + r * D, D, m[r], l[r]);
}

typedef struct {
    float *kt, *qp, *s, *acc, *ss;
} Scratch;

static void run_items(const Job *J, Py_ssize_t first, Py_ssize_t step, const Scratch *w,
                      Py_ssize_t kpad) {
    const float *have = NULL;
    Py_ssize_t have_n = 0;
    Item x;
    for (Py_ssize_t it = first, n = item_count(J); it < n; it += step) {
        make_item(J, it, &x);
        if (x.rows <= TR)
            item_small(J, &x, w->qp, w->ss, kpad, w->acc);
        else
            item_tiled(J, &x, w->kt, kpad, &have, &have_n, w->qp, w->s, w->acc);
    }
}

/* Run the job's items on ``threads`` OpenMP threads (the GIL released); 0, or -1 when out of
 * memory. ``kmax``: the most keys any item's head has. */
static int run_job(const Job *J, Py_ssize_t kmax, int threads) {
    const Py_ssize_t kpad = (kmax + TC - 1) / TC * TC + 16;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int nth = 1, me = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads(), me = omp_get_thread_num();
#endif
        Scratch w = {malloc(sizeof(float) * J->D * kpad), malloc(sizeof(float) * QB * J->D),
                     malloc(sizeof(float) * QB * KB), malloc(sizeof(float) * QB * J->D),
                     malloc(sizeof(float) * TR * kpad)};
        if (w.kt && w.qp && w.s && w.acc && w.ss)
            run_items(J, me, nth, &w, kpad);
        else
            failed = 1;
        free(w.kt), free(w.qp), free(w.s), free(w.acc), free(w.ss);
    }
    Py_END_ALLOW_THREADS
    return failed ? -1 : 0;
}

PyDoc_STRVAR(attend_doc,
"attend(q, k, v, o, lse, B, Hq, Hkv, M, K, D, qstrides, kstrides, vstrides, scale, causal,\n"
"       threads[, kt, ktpad]) -> None\n\n"
"Attention of float32 ``q [B, Hq, M, D]`` over ``k``, ``v [B, Hkv, K, D]`` (last dimension\n"
"contiguous; strides in elements of batch, head and row as 3-tuples) into contiguous ``o\n"
"[B, Hq, M, D]`` and ``lse [B, Hq, M]``; addresses as ints. ``D`` a multiple of 64, ``Hq``\n"
"a multiple of ``Hkv``; on ``threads`` OpenMP threads. ``kt``, ``ktpad`` (optional): ``k``\n"
"already transposed, contiguous ``[B, Hkv, D, ktpad]``, zero past ``K``.");

static int check_job(const Job *J, int threads, const char *name) {
    if (J->B < 1 || J->Hkv < 1 || J->Hq % J->Hkv || J->M < 1 || J->K < 1 || J->D < 64
        || J->D % 64 || J->D > 512 || threads < 1 || !J->q || !J->k || !J->v || !J->o
        || !J->lse) {
        PyErr_Format(PyExc_ValueError,
                     "%s: B, M, K >= 1, Hq a multiple of Hkv, D a multiple of 64 up to 512, "
                     "threads >= 1 and non-null addresses", name);
        return -1;
    }
    return 0;
}

static PyObject *attend(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, o, lse;
    Job J = {0};
    double scale;
    int threads;
    (void)self;
    unsigned long long kt = 0;
    if (!PyArg_ParseTuple(args, "KKKKKnnnnnn(nnn)(nnn)(nnn)dpi|Kn", &q, &k, &v, &o, &lse, &J.B,
                          &J.Hq, &J.Hkv, &J.M, &J.K, &J.D, &J.qs[0], &J.qs[1], &J.qs[2],
                          &J.ks[0], &J.ks[1], &J.ks[2], &J.vs[0], &J.vs[1], &J.vs[2], &scale,
                          &J.causal, &threads, &kt, &J.ktpad))
        return NULL;
    J.ktc = (const float *)(uintptr_t)kt;
    if (J.ktc && (J.ktpad < J.K || J.ktpad % TC)) {
        PyErr_Format(PyExc_ValueError, "attend: transposed keys need ktpad >= K, a multiple of %d",
                     TC);
        return NULL;
    }
    J.q = (const float *)(uintptr_t)q, J.k = (const float *)(uintptr_t)k;
    J.v = (const float *)(uintptr_t)v, J.o = (float *)(uintptr_t)o;
    J.lse = (float *)(uintptr_t)lse, J.scale = (float)scale;
    if (check_job(&J, threads, "attend") < 0)
        return NULL;
    if (run_job(&J, J.K, threads) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(attend_rows_doc,
"attend_rows(q, k, v, o, lse, qstart, mlen, krow, klen, S, Hq, Hkv, N, D, qstrides,\n"
"            kstrides, vstrides, scale, causal, threads) -> None\n\n"
"Attention of ``S`` sequences of different lengths. Sequence ``b``'s ``mlen[b]`` queries are\n"
"rows ``qstart[b]``.. of float32 ``q [Hq, N, D]`` (strides of head and row as a 2-tuple);\n"
"they see the first ``klen[b]`` keys of batch row ``krow[b]`` of ``k``, ``v [*, Hkv, *, D]``\n"
"(``causal``: query ``i`` sees keys ``j <= i + klen[b] - mlen[b]``). ``qstart``, ``mlen``,\n"
"``krow``, ``klen``: addresses of int64 arrays of ``S`` entries. Writes rows ``qstart[b]``..\n"
"of contiguous ``o [Hq, N, D]`` and ``lse [Hq, N]``, no other.");

static PyObject *attend_rows(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, o, lse, qstart, mlen, krow, klen;
    Job J = {0};
    double scale;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKnnnnn(nn)(nnn)(nnn)dpi", &q, &k, &v, &o, &lse,
                          &qstart, &mlen, &krow, &klen, &J.B, &J.Hq, &J.Hkv, &J.M, &J.D,
                          &J.qs[1], &J.qs[2], &J.ks[0], &J.ks[1], &J.ks[2], &J.vs[0], &J.vs[1],
                          &J.vs[2], &scale, &J.causal, &threads))
        return NULL;
    J.q = (const float *)(uintptr_t)q, J.k = (const float *)(uintptr_t)k;
    J.v = (const float *)(uintptr_t)v, J.o = (float *)(uintptr_t)o;
    J.lse = (float *)(uintptr_t)lse, J.scale = (float)scale;
    J.qstart = (const int64_t *)(uintptr_t)qstart, J.mlen = (const int64_t *)(uintptr_t)mlen;
    J.krow = (const int64_t *)(uintptr_t)krow, J.klen = (const int64_t *)(uintptr_t)klen;
    J.K = 1;
    if (check_job(&J, threads, "attend_rows") < 0)
        return NULL;
    if (!J.qstart || !J.mlen || !J.krow || !J.klen) {
        PyErr_SetString(PyExc_ValueError, "attend_rows: non-null length arrays");
        return NULL;
    }
    const Py_ssize_t G = J.Hq / J.Hkv;
    Py_ssize_t kmax = 1;
    J.first = PyMem_Malloc(sizeof(Py_ssize_t) * (J.B + 1));
    if (!J.first)
        return PyErr_NoMemory();
    J.first[0] = 0;
    for (Py_ssize_t b = 0; b < J.B; b++) {
        int64_t m = J.mlen[b], kb = J.klen[b], t = J.qstart[b];
        if (m < 1 || kb < 1 || t < 0 || t + m > J.M || J.krow[b] < 0) {
            PyMem_Free(J.first);
            PyErr_Format(PyExc_ValueError,
                         "attend_rows: sequence %zd needs mlen, klen >= 1, qstart >= 0, "
                         "qstart + mlen <= N and krow >= 0", b);
            return NULL;
        }
        kmax = kb > kmax ? kb : kmax;
        J.first[b + 1] = J.first[b] + J.Hkv * ((G * m + QB - 1) / QB);
    }
    int rc = run_job(&J, kmax, threads);
    PyMem_Free(J.first);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS, attend_doc},
    {"attend_rows", attend_rows, METH_VARARGS, attend_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore." KV_STR(KV_MODULE),
    "float32 attention with its log-sum-exp for the batched engine (ext/attention.c)", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC KV_PASTE(PyInit_, KV_MODULE)(void) { return PyModule_Create(&module); }

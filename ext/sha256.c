/* SHA-256 (FIPS 180-4) for kvstore: portable C plus an x86 SHA-NI path picked at run time.
 *
 * Written for this project from the FIPS 180-4 specification and the Intel SHA extensions
 * instruction definitions; no third-party source is included.
 */
#include "sha256.h"

#include <string.h>

static const uint32_t K256[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u,
};

static const uint32_t H0[8] = {
    0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
    0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u,
};

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* The 64-bit big-endian bit length that ends a padded message (`end` is one past it). */
static inline void put_length(uint8_t *end, size_t len) {
    uint64_t bits = (uint64_t)len << 3;
    for (int i = 0; i < 8; i++) end[-1 - i] = (uint8_t)(bits >> (8 * i));
}

/* FIPS 180-4 padding of a `len`-byte message in buf: 0x80, zeros, 64-bit bit length. */
static inline void pad_message(uint8_t *buf, size_t len) {
    size_t padded = kv_sha256_padded_size(len);
    buf[len] = 0x80;
    memset(buf + len + 1, 0, padded - len - 9);
    put_length(buf + padded, len);
}

/* ------------------------------------------------------------------------------------------ */
/* Portable C                                                                                 */
/* ------------------------------------------------------------------------------------------ */

#define ROTR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define BSIG0(x) (ROTR32(x, 2) ^ ROTR32(x, 13) ^ ROTR32(x, 22))
#define BSIG1(x) (ROTR32(x, 6) ^ ROTR32(x, 11) ^ ROTR32(x, 25))
#define SSIG0(x) (ROTR32(x, 7) ^ ROTR32(x, 18) ^ ((x) >> 3))
#define SSIG1(x) (ROTR32(x, 17) ^ ROTR32(x, 19) ^ ((x) >> 10))
#define CH(x, y, z) (((x) & (y)) ^ (~(x) & (z)))
#define MAJ(x, y, z) (((x) & (y)) ^ ((x) & (z)) ^ ((y) & (z)))

static void compress_portable(uint32_t state[8], const uint8_t *data, size_t nblocks) {
    uint32_t w[64];
    while (nblocks--) {
        for (int t = 0; t < 16; t++) w[t] = load_be32(data + 4 * t);
        for (int t = 16; t < 64; t++)
            w[t] = SSIG1(w[t - 2]) + w[t - 7] + SSIG0(w[t - 15]) + w[t - 16];
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + BSIG1(e) + CH(e, f, g) + K256[t] + w[t];
            uint32_t t2 = BSIG0(a) + MAJ(a, b, c);
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
        data += KV_SHA256_BLOCK;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* x86 SHA extensions                                                                         */
/* ------------------------------------------------------------------------------------------ */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KV_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>

#define KV_SHANI __attribute__((target("sha,sse4.1")))

/* Four rounds: msg holds W[t..t+3]; the state is kept as ABEF (st0) and CDGH (st1), the
 * register layout SHA256RNDS2 works on. Each SHA256RNDS2 does two rounds with the low two
 * dwords of its third operand, returning the new ABEF; the old ABEF is the new CDGH. */
#define KV_QROUND(msg, t)                                                                    \
    do {                                                                                     \
        __m128i wk_ = _mm_add_epi32((msg), _mm_loadu_si128((const __m128i *)&K256[(t)]));    \
        st1 = _mm_sha256rnds2_epu32(st1, st0, wk_);                                          \
        wk_ = _mm_shuffle_epi32(wk_, 0x0E);                                                  \
        st0 = _mm_sha256rnds2_epu32(st0, st1, wk_);                                          \
    } while (0)

/* W[t..t+3] from a = W[t-16..t-13], b = W[t-12..t-9], c = W[t-8..t-5], d = W[t-4..t-1]:
 * MSG1 gives W[t-16+j] + s0(W[t-15+j]); adding W[t-7..t-4] (= d:c shifted by one dword)
 * and MSG2 (which adds s1(W[t-2+j]), including the in-vector dependencies) completes it. */
#define KV_SCHED(a, b, c, d) \
    _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32((a), (b)), _mm_alignr_epi8((d), (c), 4)), (d))

/* One 64-byte block whose message words W[0..15] are m0..m3 (W[0] in lane 0 of m0). */
KV_SHANI static inline void shani_block(__m128i *pst0, __m128i *pst1, __m128i m0, __m128i m1,
                                        __m128i m2, __m128i m3) {
    __m128i st0 = *pst0, st1 = *pst1;
    KV_QROUND(m0, 0);
    KV_QROUND(m1, 4);
    KV_QROUND(m2, 8);
    KV_QROUND(m3, 12);
    for (int t = 16; t < 64; t += 16) {
        m0 = KV_SCHED(m0, m1, m2, m3);
        KV_QROUND(m0, t);
        m1 = KV_SCHED(m1, m2, m3, m0);
        KV_QROUND(m1, t + 4);
        m2 = KV_SCHED(m2, m3, m0, m1);
        KV_QROUND(m2, t + 8);
        m3 = KV_SCHED(m3, m0, m1, m2);
        KV_QROUND(m3, t + 12);
    }
    *pst0 = _mm_add_epi32(st0, *pst0);
    *pst1 = _mm_add_epi32(st1, *pst1);
}

KV_SHANI static inline __m128i shani_bswap_mask(void) {
    return _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
}

/* Big-endian message words W[4j..4j+3] of the 16 bytes at p. */
KV_SHANI static inline __m128i shani_load_words(const uint8_t *p, __m128i bswap) {
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), bswap);
}

/* (A B C D), (E F G H) (A in lane 0) <-> ABEF, CDGH register layout */
KV_SHANI static inline void shani_pack(__m128i abcd, __m128i efgh, __m128i *st0, __m128i *st1) {
    abcd = _mm_shuffle_epi32(abcd, 0xB1);          /* lanes B A D C */
    efgh = _mm_shuffle_epi32(efgh, 0x1B);          /* lanes H G F E */
    *st0 = _mm_alignr_epi8(abcd, efgh, 8);         /* lanes F E B A: "ABEF" */
    *st1 = _mm_blend_epi16(efgh, abcd, 0xF0);      /* lanes H G D C: "CDGH" */
}

KV_SHANI static inline void shani_unpack(__m128i st0, __m128i st1, __m128i *abcd, __m128i *efgh) {
    __m128i feba = _mm_shuffle_epi32(st0, 0x1B);   /* lanes A B E F */
    __m128i ghcd = _mm_shuffle_epi32(st1, 0xB1);   /* lanes G H C D */
    *abcd = _mm_blend_epi16(feba, ghcd, 0xF0);     /* lanes A B C D */
    *efgh = _mm_alignr_epi8(ghcd, feba, 8);        /* lanes E F G H */
}

KV_SHANI static void compress_shani(uint32_t state[8], const uint8_t *data, size_t nblocks) {
    const __m128i bswap = shani_bswap_mask();
    __m128i st0, st1;
    shani_pack(_mm_loadu_si128((const __m128i *)&state[0]),
               _mm_loadu_si128((const __m128i *)&state[4]), &st0, &st1);
    for (; nblocks; nblocks--, data += KV_SHA256_BLOCK)
        shani_block(&st0, &st1, shani_load_words(data, bswap), shani_load_words(data + 16, bswap),
                    shani_load_words(data + 32, bswap), shani_load_words(data + 48, bswap));
    __m128i abcd, efgh;
    shani_unpack(st0, st1, &abcd, &efgh);
    _mm_storeu_si128((__m128i *)&state[0], abcd);
    _mm_storeu_si128((__m128i *)&state[4], efgh);
}

/* The key chain with SHA-NI. The previous key never goes through memory: its digest words
 * are exactly the message words W[0..7] of the next key's first block, so they pass from
 * the final state to the next compression in registers. Only the bytes after the 32-byte
 * prefix are staged in `scratch` (at the same offsets as in the whole message), and they do
 * not depend on the chain, so the CPU overlaps staging with the previous key's rounds. */
KV_SHANI static void chain_shani(const uint8_t root[KV_SHA256_DIGEST], const uint8_t *tokens,
                                 size_t nblocks, size_t block_bytes,
                                 const uint8_t *const *extra_ptr, const size_t *extra_len,
                                 uint8_t *scratch, uint8_t *out) {
    const __m128i bswap = shani_bswap_mask();
    __m128i h0_st0, h0_st1;
    shani_pack(_mm_loadu_si128((const __m128i *)&H0[0]), _mm_loadu_si128((const __m128i *)&H0[4]),
               &h0_st0, &h0_st1);
    __m128i wa = shani_load_words(root, bswap), we = shani_load_words(root + 16, bswap);
    const size_t base_len = KV_SHA256_DIGEST + block_bytes;
    if (extra_ptr == NULL && block_bytes == 64) {
        /* The default 16-token block without extras: a 96-byte message, two blocks; the
         * tokens are read in place and the second block ends in constant padding. */
        const __m128i pad_lo = _mm_set_epi32(0, 0, 0, (int)0x80000000u);
        const __m128i pad_hi = _mm_set_epi32(96 * 8, 0, 0, 0);
        for (size_t i = 0; i < nblocks; i++) {
            const uint8_t *t = tokens + i * 64;
            __m128i st0 = h0_st0, st1 = h0_st1;
            shani_block(&st0, &st1, wa, we, shani_load_words(t, bswap),
                        shani_load_words(t + 16, bswap));
            shani_block(&st0, &st1, shani_load_words(t + 32, bswap),
                        shani_load_words(t + 48, bswap), pad_lo, pad_hi);
            shani_unpack(st0, st1, &wa, &we);
            uint8_t *key = out + i * KV_SHA256_DIGEST;
            _mm_storeu_si128((__m128i *)key, _mm_shuffle_epi8(wa, bswap));
            _mm_storeu_si128((__m128i *)(key + 16), _mm_shuffle_epi8(we, bswap));
        }
        return;
    }
    if (extra_ptr == NULL) pad_message(scratch, base_len); /* the same padding for every key */
    for (size_t i = 0; i < nblocks; i++) {
        size_t len = base_len;
        if (block_bytes == 64) /* the default 16-token block: a fixed-size copy */
            memcpy(scratch + KV_SHA256_DIGEST, tokens + i * 64, 64);
        else
            memcpy(scratch + KV_SHA256_DIGEST, tokens + i * block_bytes, block_bytes);
        if (extra_ptr != NULL) {
            if (extra_len[i]) memcpy(scratch + len, extra_ptr[i], extra_len[i]);
            len += extra_len[i];
            pad_message(scratch, len);
        }
        const size_t padded = kv_sha256_padded_size(len);
        __m128i st0 = h0_st0, st1 = h0_st1;
        shani_block(&st0, &st1, wa, we, shani_load_words(scratch + 32, bswap),
                    shani_load_words(scratch + 48, bswap));
        for (size_t off = KV_SHA256_BLOCK; off < padded; off += KV_SHA256_BLOCK)
            shani_block(&st0, &st1, shani_load_words(scratch + off, bswap),
                        shani_load_words(scratch + off + 16, bswap),
                        shani_load_words(scratch + off + 32, bswap),
                        shani_load_words(scratch + off + 48, bswap));
        shani_unpack(st0, st1, &wa, &we);
        uint8_t *key = out + i * KV_SHA256_DIGEST;
        _mm_storeu_si128((__m128i *)key, _mm_shuffle_epi8(wa, bswap));
        _mm_storeu_si128((__m128i *)(key + 16), _mm_shuffle_epi8(we, bswap));
    }
}

static int detect_shani(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0; /* SSSE3, SSE4.1 */
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (int)((b >> 29) & 1u); /* CPUID.(EAX=7,ECX=0):EBX.SHA[bit 29] */
}
#endif /* x86 */

int kv_sha256_cpu_has_shani(void) {
#ifdef KV_HAVE_SHANI
    static volatile int cached = -1; /* benign race: every thread computes the same value */
    if (cached < 0) cached = detect_shani();
    return cached;
#else
    return 0;
#endif
}

kv_sha256_compress_fn kv_sha256_compress_for(enum kv_sha256_impl impl) {
    switch (impl) {
    case KV_SHA256_PORTABLE:
        return compress_portable;
    case KV_SHA256_SHANI:
#ifdef KV_HAVE_SHANI
        if (kv_sha256_cpu_has_shani()) return compress_shani;
#endif
        return NULL;
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Whole messages                                                                             */
/* ------------------------------------------------------------------------------------------ */

static inline void finish(const uint32_t st[8], uint8_t out[KV_SHA256_DIGEST]) {
    for (int i = 0; i < 8; i++) store_be32(out + 4 * i, st[i]);
}

void kv_sha256(kv_sha256_compress_fn compress, const uint8_t *data, size_t len,
               uint8_t out[KV_SHA256_DIGEST]) {
    uint32_t st[8];
    memcpy(st, H0, sizeof st);
    size_t full = len / KV_SHA256_BLOCK;
    if (full) compress(st, data, full);
    size_t rem = len - full * KV_SHA256_BLOCK;
    uint8_t tail[2 * KV_SHA256_BLOCK];
    memcpy(tail, data + full * KV_SHA256_BLOCK, rem);
    size_t padded = kv_sha256_padded_size(rem);
    tail[rem] = 0x80;
    memset(tail + rem + 1, 0, padded - rem - 1);
    put_length(tail + padded, len);
    compress(st, tail, padded / KV_SHA256_BLOCK);
    finish(st, out);
}

void kv_sha256_inplace(kv_sha256_compress_fn compress, uint8_t *buf, size_t len,
                       uint8_t out[KV_SHA256_DIGEST]) {
    uint32_t st[8];
    memcpy(st, H0, sizeof st);
    pad_message(buf, len);
    compress(st, buf, kv_sha256_padded_size(len) / KV_SHA256_BLOCK);
    finish(st, out);
}

void kv_chain_keys(kv_sha256_compress_fn compress, const uint8_t root[KV_SHA256_DIGEST],
                   const uint8_t *tokens, size_t nblocks, size_t block_bytes,
                   const uint8_t *const *extra_ptr, const size_t *extra_len,
                   uint8_t *scratch, uint8_t *out) {
#ifdef KV_HAVE_SHANI
    if (compress == compress_shani) {
        chain_shani(root, tokens, nblocks, block_bytes, extra_ptr, extra_len, scratch, out);
        return;
    }
#endif
    const uint8_t *prev = root;
    for (size_t i = 0; i < nblocks; i++) {
        size_t len = KV_SHA256_DIGEST + block_bytes;
        memcpy(scratch, prev, KV_SHA256_DIGEST);
        memcpy(scratch + KV_SHA256_DIGEST, tokens + i * block_bytes, block_bytes);
        if (extra_ptr && extra_len[i]) {
            memcpy(scratch + len, extra_ptr[i], extra_len[i]);
            len += extra_len[i];
        }
        uint8_t *key = out + i * KV_SHA256_DIGEST;
        kv_sha256_inplace(compress, scratch, len, key);
        prev = key;
    }
}

/* SHA-256 (FIPS 180-4) for kvstore: a portable C implementation and, on x86, an SHA-NI
 * implementation chosen at run time. Written for this project; no third-party source.
 */
#ifndef KVSTORE_SHA256_H
#define KVSTORE_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define KV_SHA256_DIGEST 32
#define KV_SHA256_BLOCK 64

/* Compression function: process `nblocks` consecutive 64-byte blocks into `state`. */
typedef void (*kv_sha256_compress_fn)(uint32_t state[8], const uint8_t *data, size_t nblocks);

enum kv_sha256_impl {
    KV_SHA256_PORTABLE = 0,
    KV_SHA256_SHANI = 1,
};

/* 1 when the CPU executing this has the SHA extensions (plus SSSE3/SSE4.1) and this build
 * contains the SHA-NI path, else 0. Cached after the first call. */
int kv_sha256_cpu_has_shani(void);

/* The compression function of `impl`; NULL when that impl is not available here. */
kv_sha256_compress_fn kv_sha256_compress_for(enum kv_sha256_impl impl);

/* One-shot SHA-256 of `len` bytes. */
void kv_sha256(kv_sha256_compress_fn compress, const uint8_t *data, size_t len,
               uint8_t out[KV_SHA256_DIGEST]);

/* SHA-256 of buf[0:len], padding in place: `buf` must have room for
 * kv_sha256_padded_size(len) bytes; bytes past `len` are overwritten. */
static inline size_t kv_sha256_padded_size(size_t len) {
    return (len + 9 + (KV_SHA256_BLOCK - 1)) & ~(size_t)(KV_SHA256_BLOCK - 1);
}
void kv_sha256_inplace(kv_sha256_compress_fn compress, uint8_t *buf, size_t len,
                       uint8_t out[KV_SHA256_DIGEST]);

/* The kvstore key chain (DESIGN.md section 2):
 *   key_i = SHA-256(key_{i-1} || tokens[i*block_bytes : (i+1)*block_bytes] || extra_i)
 * with key_{-1} = root. `tokens` holds nblocks*block_bytes bytes (uint32 LE token ids).
 * `extra_ptr`/`extra_len` may be NULL (no extras); otherwise entry i is block i's extra
 * (a zero length means none). `scratch` must hold
 * kv_sha256_padded_size(32 + block_bytes + max extra length) bytes.
 * Writes nblocks*32 bytes to `out`. */
void kv_chain_keys(kv_sha256_compress_fn compress, const uint8_t root[KV_SHA256_DIGEST],
                   const uint8_t *tokens, size_t nblocks, size_t block_bytes,
                   const uint8_t *const *extra_ptr, const size_t *extra_len,
                   uint8_t *scratch, uint8_t *out);

#endif

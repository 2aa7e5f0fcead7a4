/* KV_CLONES: GCC's target_clones for the element-wise kernels (AVX-512, AVX2, baseline,
 * chosen at load on x86-64 Linux); empty elsewhere, and where a file defines it first (the
 * ASan recipe of docs/native.md builds the baseline clone alone that way). */
#ifndef KV_CLONES
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define KV_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KV_CLONES
#endif
#endif

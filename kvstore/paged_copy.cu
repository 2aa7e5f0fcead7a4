// Gather/scatter between kvstore blocks and vLLM flash-attention paged caches.
//
// Store side, one layer of n blocks:  src[n][P][T][H*D]            (T*H*D contiguous per plane)
// Engine side, one layer:             pages[P][num_pages][ps][H*D] (ps*H*D contiguous per page)
// A block covers ppb = T / ps pages; block b, page j goes to engine page ids[b * ppb + j].
// The outer axes are strided (byte strides from kvstore/kernels.py launch_args): the store
// side is usually kv[:, layer], a non-contiguous slice, and is read in place, never copied.
//
// One CUDA block copies one (page, plane) chunk of ps * H * D elements, 16 bytes per thread
// per step when the chunk is 16-byte aligned (the common case), byte-wise otherwise.
// Compiled at run time by CuPy's RawModule (NVRTC, no headers: nothing is #included; uint4 is
// an NVRTC builtin); the torch index_copy_ path is the reference.

typedef unsigned long long kvstore_uintptr;  // NVRTC ships no C headers: no <stdint.h>

extern "C" __global__ void kvstore_scatter_pages(
    const unsigned char* __restrict__ src, unsigned char* __restrict__ pages,
    const long long* __restrict__ ids, long long n_pages_moved, long long planes,
    long long chunk_bytes, long long ppb, long long block_stride, long long block_plane_stride,
    long long page_plane_stride, long long page_stride)
{
    const long long m = blockIdx.x;          // page index among the moved ones
    const long long p = blockIdx.y;          // plane
    if (m >= n_pages_moved || p >= planes) return;
    const long long b = m / ppb, j = m % ppb;
    const unsigned char* s = src + b * block_stride + p * block_plane_stride + j * chunk_bytes;
    unsigned char* d = pages + p * page_plane_stride + ids[m] * page_stride;
    if ((chunk_bytes & 15) == 0 && (((kvstore_uintptr)s | (kvstore_uintptr)d) & 15) == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        for (long long i = threadIdx.x; i < chunk_bytes / 16; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (long long i = threadIdx.x; i < chunk_bytes; i += blockDim.x) d[i] = s[i];
    }
}

extern "C" __global__ void kvstore_gather_pages(
    const unsigned char* __restrict__ pages, unsigned char* __restrict__ dst,
    const long long* __restrict__ ids, long long n_pages_moved, long long planes,
    long long chunk_bytes, long long ppb, long long block_stride, long long block_plane_stride,
    long long page_plane_stride, long long page_stride)
{
    const long long m = blockIdx.x;
    const long long p = blockIdx.y;
    if (m >= n_pages_moved || p >= planes) return;
    const long long b = m / ppb, j = m % ppb;
    const unsigned char* s = pages + p * page_plane_stride + ids[m] * page_stride;
    unsigned char* d = dst + b * block_stride + p * block_plane_stride + j * chunk_bytes;
    if ((chunk_bytes & 15) == 0 && (((kvstore_uintptr)s | (kvstore_uintptr)d) & 15) == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        for (long long i = threadIdx.x; i < chunk_bytes / 16; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (long long i = threadIdx.x; i < chunk_bytes; i += blockDim.x) d[i] = s[i];
    }
}

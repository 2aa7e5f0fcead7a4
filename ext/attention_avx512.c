/* kvstore._attention_avx512: ext/attention.c built with -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma (setup.py), imported by
 * engines/flash.py only where torch's CPU capability is AVX512 or above */
#define KV_MODULE _attention_avx512
#include "attention.c"

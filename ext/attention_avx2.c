/* kvstore._attention_avx2: ext/attention.c built with -mavx2 -mfma (setup.py), imported by
 * engines/flash.py only where torch's CPU capability is AVX2 or above */
#define KV_MODULE _attention_avx2
#include "attention.c"

/* kvstore._native: the chained SHA-256 block keys of DESIGN.md section 2, in one call.
 *
 *   chain_keys(root, tokens, block_tokens, extras=None, *, impl=None) -> list[bytes]
 *   sha256(data, *, impl=None) -> bytes
 *   cpu_has_sha_ni() -> bool
 *   active_impl() -> "sha-ni" | "portable"
 *
 * The output is byte-identical to kvstore.keys.chain_python. `impl` (or the environment
 * variable KVSTORE_NATIVE_PORTABLE=1, read at each call) selects the SHA-256 implementation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "sha256.h"

#define GIL_RELEASE_BLOCKS 64      /* release the GIL when hashing more blocks than this */
#define GIL_RELEASE_BYTES (1 << 16) /* ... or more bytes than this, for sha256() */

static const char RANGE_MSG[] = "token ids must be in [0, 2**32)";

/* ------------------------------------------------------------------------------------------ */
/* Implementation selection                                                                   */
/* ------------------------------------------------------------------------------------------ */

static int env_forces_portable(void) {
    const char *v = getenv("KVSTORE_NATIVE_PORTABLE");
    return v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
}

static const char *default_impl_name(void) {
    if (!env_forces_portable() && kv_sha256_cpu_has_shani()) return "sha-ni";
    return "portable";
}

/* impl: NULL/None = default (environment + CPU), or "portable" / "sha-ni". */
static kv_sha256_compress_fn resolve_impl(PyObject *impl) {
    const char *name;
    if (impl == NULL || impl == Py_None) {
        name = default_impl_name();
    } else if (PyUnicode_Check(impl)) {
        name = PyUnicode_AsUTF8(impl);
        if (name == NULL) return NULL;
    } else {
        PyErr_Format(PyExc_TypeError, "impl must be 'portable', 'sha-ni' or None, not %.100s",
                     Py_TYPE(impl)->tp_name);
        return NULL;
    }
    if (strcmp(name, "portable") == 0) return kv_sha256_compress_for(KV_SHA256_PORTABLE);
    if (strcmp(name, "sha-ni") == 0) {
        kv_sha256_compress_fn f = kv_sha256_compress_for(KV_SHA256_SHANI);
        if (f == NULL)
            PyErr_SetString(PyExc_ValueError,
                            "impl 'sha-ni' is not available: this CPU (or build) has no SHA "
                            "extensions; use 'portable'");
        return f;
    }
    PyErr_Format(PyExc_ValueError, "impl must be 'portable', 'sha-ni' or None, not %R", impl);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Tokens -> uint32 LE                                                                        */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *data; /* ntok * 4 bytes of uint32 LE */
    Py_ssize_t ntok;
    uint8_t *owned;  /* PyMem buffer to free, or NULL */
    PyObject *keep;  /* object owning `data` when not copied (immutable bytes), or NULL */
} tokbuf;

static void tokbuf_clear(tokbuf *tb) {
    PyMem_Free(tb->owned);
    Py_XDECREF(tb->keep);
    tb->owned = NULL;
    tb->keep = NULL;
    tb->data = NULL;
}

static inline void store_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint8_t *alloc_tokens(Py_ssize_t n) {
    if ((size_t)n > PY_SSIZE_T_MAX / 4) {
        PyErr_NoMemory();
        return NULL;
    }
    uint8_t *p = PyMem_Malloc(n > 0 ? (size_t)n * 4 : 1);
    if (p == NULL) PyErr_NoMemory();
    return p;
}

static void range_error_obj(PyObject *item, Py_ssize_t index) {
    PyErr_Format(PyExc_OverflowError, "token id %R (at index %zd) is out of range: %s", item,
                 index, RANGE_MSG);
}

/* Convert one int-like item; 0 on success, -1 with an exception set. */
static int item_to_u32(PyObject *item, Py_ssize_t index, uint32_t *out) {
    PyObject *num = NULL;
    if (PyBool_Check(item)) {
        PyErr_Format(PyExc_TypeError,
                     "token ids must be ints, got %R (bool) at index %zd; a bool is not a "
                     "token id (pass the token ids themselves)",
                     item, index);
        return -1;
    }
    if (!PyLong_Check(item)) {
        if (!PyIndex_Check(item)) {
            PyErr_Format(PyExc_TypeError,
                         "token ids must be ints, got %.200R (%.100s) at index %zd; convert "
                         "floats or strings to token ids first",
                         item, Py_TYPE(item)->tp_name, index);
            return -1;
        }
        num = PyNumber_Index(item);
        if (num == NULL) return -1;
        item = num;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (v == -1 && !overflow && PyErr_Occurred()) {
        Py_XDECREF(num);
        return -1;
    }
    if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
        range_error_obj(item, index);
        Py_XDECREF(num);
        return -1;
    }
    Py_XDECREF(num);
    *out = (uint32_t)v;
    return 0;
}

/* list or tuple of ints */
static int tokens_from_sequence(PyObject *seq, tokbuf *tb) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint8_t *buf = alloc_tokens(n);
    if (buf == NULL) return -1;
    /* Fast path: exact ints and int subclasses (not bool) convert without running Python
     * code, so a list cannot change under us. */
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        PyObject *item = items[i];
        long long v;
        int overflow = 0;
#if PY_VERSION_HEX >= 0x030C0000
        if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item)) {
            v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
            if (v >= 0 && v <= 0xFFFFFFFFLL) {
                store_le32(buf + 4 * i, (uint32_t)v);
                continue;
            }
        }
#else
        if (PyLong_CheckExact(item)) {
            /* CPython <= 3.11 ints: ob_size digits of PyLong_SHIFT (30 or 15) bits, sign in the
             * size; a value of one digit (or zero) is read directly. */
            Py_ssize_t size = Py_SIZE(item);
            if (size == 0 || size == 1) {
                v = size ? (long long)((PyLongObject *)item)->ob_digit[0] : 0;
                store_le32(buf + 4 * i, (uint32_t)v);
                continue;
            }
        }
#endif
        if (!PyLong_Check(item) || PyBool_Check(item)) break; /* bools: refused below */
        v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
            if (v == -1 && !overflow && PyErr_Occurred()) goto fail;
            range_error_obj(item, i);
            goto fail;
        }
        store_le32(buf + 4 * i, (uint32_t)v);
    }
    if (i < n) {
        /* Some item needs __index__, which may run Python code (and mutate a list): work on
         * a tuple snapshot from here on. */
        PyObject *snap = PySequence_Tuple(seq);
        if (snap == NULL) goto fail;
        Py_ssize_t m = PyTuple_GET_SIZE(snap);
        if (m != n) {
            PyMem_Free(buf);
            buf = alloc_tokens(m);
            if (buf == NULL) {
                Py_DECREF(snap);
                return -1;
            }
            n = m;
            i = 0;
        }
        for (; i < n; i++) {
            uint32_t v;
            if (item_to_u32(PyTuple_GET_ITEM(snap, i), i, &v) < 0) {
                Py_DECREF(snap);
                goto fail;
            }
            store_le32(buf + 4 * i, v);
        }
        Py_DECREF(snap);
    }
    tb->data = buf;
    tb->owned = buf;
    tb->ntok = n;
    return 0;
fail:
    PyMem_Free(buf);
    return -1;
}

static inline uint32_t bswap32(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}

static inline uint64_t bswap64(uint64_t x) {
    return ((uint64_t)bswap32((uint32_t)x) << 32) | bswap32((uint32_t)(x >> 32));
}

static int host_is_little(void) {
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}

/* A buffer of 16/32/64-bit integers (numpy arrays, array.array, memoryview.cast(...)). */
static int tokens_from_buffer(PyObject *obj, tokbuf *tb) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "token buffer of type %.100s could not be read as a strided array",
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    const char *fmt = view.format ? view.format : "B";
    char order = '@';
    if (*fmt == '@' || *fmt == '=' || *fmt == '<' || *fmt == '>' || *fmt == '!') order = *fmt++;
    char code = fmt[0];
    int is_signed;
    switch (code) {
    case 'h': case 'i': case 'l': case 'q': case 'n':
        is_signed = 1;
        break;
    case 'H': case 'I': case 'L': case 'Q': case 'N':
        is_signed = 0;
        break;
    default:
        code = 0;
        is_signed = 0;
        break;
    }
    Py_ssize_t size = view.itemsize;
    if (code == 0 || fmt[1] != '\0' || (size != 2 && size != 4 && size != 8)) {
        PyErr_Format(PyExc_TypeError,
                     "token buffer must hold 16, 32 or 64-bit integers (formats h H i I l L q Q), "
                     "not format '%s' of %.100s",
                     view.format ? view.format : "B", Py_TYPE(obj)->tp_name);
        PyBuffer_Release(&view);
        return -1;
    }
    int little = host_is_little();
    int swap = (order == '<' && !little) || ((order == '>' || order == '!') && little);

    Py_ssize_t n, stride;
    if (view.ndim == 0) {
        n = 1;
        stride = size;
    } else if (view.ndim == 1) {
        n = view.shape[0];
        stride = view.strides ? view.strides[0] : size;
    } else if (PyBuffer_IsContiguous(&view, 'C')) {
        n = view.len / size;
        stride = size;
    } else {
        PyErr_SetString(PyExc_ValueError,
                        "token buffer must be 1-D or C-contiguous; flatten it first");
        PyBuffer_Release(&view);
        return -1;
    }

    uint8_t *buf = alloc_tokens(n);
    if (buf == NULL) {
        PyBuffer_Release(&view);
        return -1;
    }
    const char *p = (const char *)view.buf;
    if (size == 4 && !is_signed && !swap && stride == 4 && little) {
        memcpy(buf, p, (size_t)n * 4); /* uint32 native LE: nothing to check */
    } else {
        for (Py_ssize_t i = 0; i < n; i++, p += stride) {
            uint64_t u;
            int neg = 0;
            if (size == 2) {
                uint16_t x;
                memcpy(&x, p, 2);
                if (swap) x = (uint16_t)((x >> 8) | (x << 8));
                neg = is_signed && (int16_t)x < 0;
                u = is_signed ? (uint64_t)(int64_t)(int16_t)x : x;
            } else if (size == 4) {
                uint32_t x;
                memcpy(&x, p, 4);
                if (swap) x = bswap32(x);
                neg = is_signed && (int32_t)x < 0;
                u = is_signed ? (uint64_t)(int64_t)(int32_t)x : x;
            } else {
                uint64_t x;
                memcpy(&x, p, 8);
                if (swap) x = bswap64(x);
                neg = is_signed && (int64_t)x < 0;
                u = x;
            }
            if (neg || u > 0xFFFFFFFFull) {
                if (neg)
                    PyErr_Format(PyExc_OverflowError,
                                 "token id %lld (at index %zd) is out of range: %s",
                                 (long long)(int64_t)u, i, RANGE_MSG);
                else
                    PyErr_Format(PyExc_OverflowError,
                                 "token id %llu (at index %zd) is out of range: %s",
                                 (unsigned long long)u, i, RANGE_MSG);
                PyMem_Free(buf);
                PyBuffer_Release(&view);
                return -1;
            }
            store_le32(buf + 4 * i, (uint32_t)u);
        }
    }
    PyBuffer_Release(&view);
    tb->data = buf;
    tb->owned = buf;
    tb->ntok = n;
    return 0;
}

static int tokens_convert(PyObject *obj, tokbuf *tb) {
    memset(tb, 0, sizeof *tb);
    if (PyBytes_Check(obj)) {
        /* already uint32 LE; bytes are immutable, so hash them in place */
        Py_ssize_t len = PyBytes_GET_SIZE(obj);
        if (len % 4) {
            PyErr_Format(PyExc_ValueError,
                         "token bytes must be uint32 little-endian (a multiple of 4 bytes), got "
                         "%zd bytes",
                         len);
            return -1;
        }
        Py_INCREF(obj);
        tb->keep = obj;
        tb->data = (const uint8_t *)PyBytes_AS_STRING(obj);
        tb->ntok = len / 4;
        return 0;
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) return tokens_from_sequence(obj, tb);
    if (PyObject_CheckBuffer(obj)) return tokens_from_buffer(obj, tb);
    PyErr_Format(PyExc_TypeError,
                 "tokens must be a list or tuple of ints, an integer buffer (numpy array) or "
                 "uint32 LE bytes, not %.100s",
                 Py_TYPE(obj)->tp_name);
    return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Extras                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    uint8_t *arena;          /* all extras' bytes, copied */
    const uint8_t **ptr;     /* per block, into arena (NULL when none) */
    size_t *len;             /* per block */
    size_t max_len;
} extrabuf;

static void extrabuf_clear(extrabuf *eb) {
    PyMem_Free(eb->arena);
    PyMem_Free((void *)eb->ptr);
    PyMem_Free(eb->len);
    memset(eb, 0, sizeof *eb);
}

static int extras_convert(PyObject *extras, Py_ssize_t nblocks, extrabuf *eb) {
    memset(eb, 0, sizeof *eb);
    if (extras == NULL || extras == Py_None) return 0;
    if (!PyList_Check(extras) && !PyTuple_Check(extras)) {
        PyErr_Format(PyExc_TypeError, "extras must be a list of bytes or None, not %.100s",
                     Py_TYPE(extras)->tp_name);
        return -1;
    }
    /* a tuple snapshot: getting buffers may run Python code */
    PyObject *snap = PySequence_Tuple(extras);
    if (snap == NULL) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(snap);
    if (n != nblocks) {
        PyErr_Format(PyExc_ValueError,
                     "extras must have one entry per full block: %zd blocks, got %zd entries",
                     nblocks, n);
        Py_DECREF(snap);
        return -1;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(snap, i);
        if (e == Py_None) continue;
        if (PyBytes_Check(e)) {
            total += (size_t)PyBytes_GET_SIZE(e);
        } else if (PyObject_CheckBuffer(e)) {
            Py_buffer v;
            if (PyObject_GetBuffer(e, &v, PyBUF_SIMPLE) < 0) goto fail;
            total += (size_t)v.len;
            PyBuffer_Release(&v);
        } else {
            PyErr_Format(PyExc_TypeError, "extras[%zd] must be bytes or None, not %.100s", i,
                         Py_TYPE(e)->tp_name);
            goto fail;
        }
    }
    eb->ptr = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *eb->ptr);
    eb->len = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *eb->len);
    eb->arena = PyMem_Malloc(total > 0 ? total : 1);
    if (eb->ptr == NULL || eb->len == NULL || eb->arena == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t off = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(snap, i);
        if (e == Py_None) continue;
        Py_buffer v;
        if (PyObject_GetBuffer(e, &v, PyBUF_SIMPLE) < 0) goto fail;
        if (off + (size_t)v.len > total) { /* a mutable buffer grew meanwhile */
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_RuntimeError, "extras changed while being read");
            goto fail;
        }
        memcpy(eb->arena + off, v.buf, (size_t)v.len);
        eb->ptr[i] = eb->arena + off;
        eb->len[i] = (size_t)v.len;
        if (eb->len[i] > eb->max_len) eb->max_len = eb->len[i];
        off += (size_t)v.len;
        PyBuffer_Release(&v);
    }
    Py_DECREF(snap);
    return 0;
fail:
    Py_DECREF(snap);
    extrabuf_clear(eb);
    return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Module functions                                                                           */
/* ------------------------------------------------------------------------------------------ */

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(root, tokens, block_tokens, extras=None, *, impl=None) -> list[bytes]\n\n"
"Keys of every full block: key_i = SHA-256(key_{i-1} || tokens_i as uint32 LE || extras[i]),\n"
"key_{-1} = root (32 bytes). tokens: a list/tuple of ints, a buffer of 16/32/64-bit integers\n"
"(numpy array), or bytes already encoded as uint32 LE. extras: None or one bytes/None per\n"
"full block. impl: None (default: SHA-NI when available unless KVSTORE_NATIVE_PORTABLE=1),\n"
"'portable' or 'sha-ni'. Raises OverflowError for a token outside [0, 2**32), TypeError for\n"
"a non-integer token or unsupported container, ValueError for bad sizes.");

static PyObject *chain_keys(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"root", "tokens", "block_tokens", "extras", "impl", NULL};
    Py_buffer root;
    PyObject *tokens, *bt_obj, *extras = Py_None, *impl = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*OO|O$O:chain_keys", kwlist, &root,
                                     &tokens, &bt_obj, &extras, &impl))
        return NULL;
    uint8_t root_key[KV_SHA256_DIGEST];
    if (root.len != KV_SHA256_DIGEST) {
        PyErr_Format(PyExc_ValueError, "root must be 32 bytes, got %zd", root.len);
        PyBuffer_Release(&root);
        return NULL;
    }
    memcpy(root_key, root.buf, KV_SHA256_DIGEST);
    PyBuffer_Release(&root);
    /* a huge block size just means no full block: clamp instead of overflowing */
    Py_ssize_t block_tokens = PyNumber_AsSsize_t(bt_obj, NULL);
    if (block_tokens == -1 && PyErr_Occurred()) return NULL;
    if (block_tokens <= 0) {
        PyErr_Format(PyExc_ValueError, "block_tokens must be a positive int, got %R", bt_obj);
        return NULL;
    }
    kv_sha256_compress_fn compress = resolve_impl(impl);
    if (compress == NULL) return NULL;

    tokbuf tb;
    if (tokens_convert(tokens, &tb) < 0) return NULL;
    Py_ssize_t nblocks = tb.ntok / block_tokens;
    /* only used when nblocks > 0, i.e. block_tokens <= ntok: no overflow */
    size_t block_bytes = nblocks > 0 ? (size_t)block_tokens * 4 : 0;

    extrabuf eb;
    if (extras_convert(extras, nblocks, &eb) < 0) {
        tokbuf_clear(&tb);
        return NULL;
    }

    PyObject *result = NULL;
    uint8_t *out = PyMem_Malloc(nblocks > 0 ? (size_t)nblocks * KV_SHA256_DIGEST : 1);
    uint8_t *scratch =
        PyMem_Malloc(kv_sha256_padded_size(KV_SHA256_DIGEST + block_bytes + eb.max_len));
    if (out == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (nblocks > GIL_RELEASE_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        kv_chain_keys(compress, root_key, tb.data, (size_t)nblocks, block_bytes, eb.ptr, eb.len,
                      scratch, out);
        Py_END_ALLOW_THREADS
    } else {
        kv_chain_keys(compress, root_key, tb.data, (size_t)nblocks, block_bytes, eb.ptr, eb.len,
                      scratch, out);
    }
    result = PyList_New(nblocks);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        PyObject *k =
            PyBytes_FromStringAndSize((const char *)out + i * KV_SHA256_DIGEST, KV_SHA256_DIGEST);
        if (k == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, k);
    }
done:
    PyMem_Free(out);
    PyMem_Free(scratch);
    extrabuf_clear(&eb);
    tokbuf_clear(&tb);
    return result;
}

PyDoc_STRVAR(sha256_doc,
"sha256(data, *, impl=None) -> bytes\n\n"
"SHA-256 digest of a bytes-like object with the chosen implementation (see chain_keys).");

static PyObject *sha256_fn(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"data", "impl", NULL};
    Py_buffer data;
    PyObject *impl = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|$O:sha256", kwlist, &data, &impl))
        return NULL;
    kv_sha256_compress_fn compress = resolve_impl(impl);
    if (compress == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint8_t out[KV_SHA256_DIGEST];
    if (data.len > GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        kv_sha256(compress, (const uint8_t *)data.buf, (size_t)data.len, out);
        Py_END_ALLOW_THREADS
    } else {
        kv_sha256(compress, (const uint8_t *)data.buf, (size_t)data.len, out);
    }
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, KV_SHA256_DIGEST);
}

static PyObject *cpu_has_sha_ni(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(kv_sha256_cpu_has_shani());
}

static PyObject *active_impl(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(default_impl_name());
}

/* ------------------------------------------------------------------------------------------ */
/* Key lists: the per-request checks of lookup/fetch, one C loop instead of several Python ones */
/* ------------------------------------------------------------------------------------------ */

/* 1 when obj is a list or tuple whose items are all exactly bytes of 32 bytes, else 0 */
static int all_keys_impl(PyObject *seq, Py_ssize_t *n_out) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != KV_SHA256_DIGEST) return 0;
    }
    *n_out = n;
    return 1;
}

PyDoc_STRVAR(all_keys_doc,
"all_keys(seq) -> bool\n\n"
"True when seq is a list or tuple (subclasses included) of bytes objects of exactly 32 bytes.");

static PyObject *all_keys(PyObject *self, PyObject *seq) {
    (void)self;
    Py_ssize_t n;
    return PyBool_FromLong(all_keys_impl(seq, &n));
}

PyDoc_STRVAR(join_keys_doc,
"join_keys(seq) -> bytes | None\n\n"
"The 32-byte keys of seq concatenated, or None when all_keys(seq) is false.");

static PyObject *join_keys(PyObject *self, PyObject *seq) {
    (void)self;
    Py_ssize_t n;
    if (!all_keys_impl(seq, &n)) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * KV_SHA256_DIGEST);
    if (out == NULL) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(dst + i * KV_SHA256_DIGEST, PyBytes_AS_STRING(items[i]), KV_SHA256_DIGEST);
    return out;
}

/* ------------------------------------------------------------------------------------------ */
/* Key directory probe (kvstore/tiers/key_directory.py has the layout and the writer)          */
/* ------------------------------------------------------------------------------------------ */

static uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

#define KD_HEADER 64
#define KD_ENTRY 40
#define KD_GONE UINT64_MAX
#define KD_MAX_PROBE 64

PyDoc_STRVAR(directory_run_doc,
"directory_run(directory, keys) -> int\n\n"
"How many of the 32-byte keys in keys (n * 32 bytes), in a row from the first, the key\n"
"directory buffer holds. Raises ValueError for a buffer that is not a key directory.");

static PyObject *directory_run(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer dir, keys;
    if (!PyArg_ParseTuple(args, "y*y*:directory_run", &dir, &keys)) return NULL;
    PyObject *result = NULL;
    const uint8_t *base = (const uint8_t *)dir.buf;
    if (dir.len < KD_HEADER || memcmp(base, "kvkeys01", 8) != 0) {
        PyErr_SetString(PyExc_ValueError, "not a kvstore key directory (bad magic)");
        goto done;
    }
    uint64_t cap = load_le64(base + 8);
    if (cap == 0 || (cap & (cap - 1)) != 0 ||
        cap > (uint64_t)(dir.len - KD_HEADER) / KD_ENTRY) {
        PyErr_SetString(PyExc_ValueError, "key directory capacity does not fit its buffer");
        goto done;
    }
    if (keys.len % KV_SHA256_DIGEST) {
        PyErr_SetString(PyExc_ValueError, "keys must be whole 32-byte keys");
        goto done;
    }
    const uint8_t *entries = base + KD_HEADER;
    const uint64_t mask = cap - 1;
    Py_ssize_t n = keys.len / KV_SHA256_DIGEST, i;
    for (i = 0; i < n; i++) {
        const uint8_t *k = (const uint8_t *)keys.buf + i * KV_SHA256_DIGEST;
        uint64_t pos = load_le64(k) & mask;
        int ok = 0;
        for (int probe = 0; probe < KD_MAX_PROBE; probe++) {
            const uint8_t *e = entries + pos * KD_ENTRY;
            uint64_t slot = load_le64(e + 32);
            if (slot == 0) break;
            if (slot != KD_GONE && memcmp(e, k, KV_SHA256_DIGEST) == 0) {
                ok = 1;
                break;
            }
            pos = (pos + 1) & mask;
        }
        if (!ok) break;
    }
    result = PyLong_FromSsize_t(i);
done:
    PyBuffer_Release(&dir);
    PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef native_methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_VARARGS | METH_KEYWORDS,
     chain_keys_doc},
    {"sha256", (PyCFunction)(void (*)(void))sha256_fn, METH_VARARGS | METH_KEYWORDS, sha256_doc},
    {"all_keys", all_keys, METH_O, all_keys_doc},
    {"join_keys", join_keys, METH_O, join_keys_doc},
    {"directory_run", directory_run, METH_VARARGS, directory_run_doc},
    {"cpu_has_sha_ni", cpu_has_sha_ni, METH_NOARGS,
     "cpu_has_sha_ni() -> bool\n\nWhether this CPU has the x86 SHA extensions (and this build "
     "can use them)."},
    {"active_impl", active_impl, METH_NOARGS,
     "active_impl() -> str\n\nThe SHA-256 implementation used by default now: 'sha-ni' or "
     "'portable' (KVSTORE_NATIVE_PORTABLE=1 forces 'portable')."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "kvstore._native",
    "Native chained SHA-256 block keys for kvstore (see kvstore.keys).",
    -1,
    native_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    return PyModule_Create(&native_module);
}

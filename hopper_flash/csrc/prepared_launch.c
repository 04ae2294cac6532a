/* A prepared forward call's launches in one C call (hopper_flash/c_launch.py).

   plan._PreparedLaunch keeps, per KV tile count, the forward kernel's
   arguments and (split-KV) the combine's as templates. On the Python path a
   call encodes four TMA descriptors, builds both argument lists and hands
   each to Triton's launcher, which parses ~45 Python objects back into C
   values: about half the backend call's host time in a decode step
   (BENCHMARKS.md, twenty-fourth session). Here the templates become kernel-parameter storage once
   (``make``), and a call (``launch``) takes the handful of values that change
   (addresses, the key length, K's and V's strides), fills a copy of that
   storage on its own stack (so that calls from several threads, each with
   the GIL released around its launch, never share one), encodes the descriptors
   with cuTensorMapEncodeTiled as Triton's fill_tma_descriptor (3.6) and
   fill_tma_descriptor_tiled (3.7 to 3.9) do, and
   calls cuLaunchKernelEx as Triton's launcher does (same grid, block,
   shared memory, programmatic-dependent-launch and cooperative attributes,
   and the two scratch pointers Triton appends, here null: prepared calls are
   only made for kernels without scratch).

   libcuda is opened at ``init(path)`` (tests pass a stand-in). Nothing here
   allocates per call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"

typedef CUresult (*encode_t)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                             const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                             CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*launch_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*error_string_t)(CUresult, const char **);

static encode_t encode_fn;
static launch_t launch_fn;
static error_string_t error_string_fn;

/* A parameter's kind (``make``'s spec). */
enum { P_CONST = 0, P_VALUE = 1, P_MAP = 2, P_DIM = 3, P_STRIDE = 4 };
#define N_VALUES 11  /* plan._Slot order: out, lse, o_part, lse_part, seqlen_k, sched, seqused, kv_batch, pages,
                        leftpad, q (the address of the Q descriptor's tensor, which Q_ROWS reads as a pointer) */
#define MAX_PARAMS 160
#define MAX_DESCS 4
#define RANK 4
#define STORAGE_MAX 2048  /* bytes of one launch's parameters: 8 per scalar, 128 per map */

typedef struct {
  int kind, size;   /* size in bytes: 1, 2, 4, 8, or 128 for a map */
  int a, b;         /* P_VALUE: value index; P_MAP: descriptor; P_DIM / P_STRIDE: descriptor, axis */
  size_t offset;    /* into the launch's storage */
} Param;

typedef struct {
  int tensor;       /* 0 q, 1 k, 2 v, 3 out: the call's addresses, in this order */
  int elem_type, elem_size, swizzle;
  cuuint32_t box[RANK];   /* the kernel's block, outermost axis first */
  int64_t shape[RANK];    /* outermost first; axis 1 is the key length for k and v */
  int64_t strides[RANK];  /* elements, TMA-ready; k's and v's come with each call */
} Desc;

typedef struct {
  CUfunction function;
  unsigned grid[3], block, shared;
  int pdl, cooperative;
  int n_params, n_descs;
  Param *params;
  Desc descs[MAX_DESCS];
  size_t size;             /* bytes of storage */
  unsigned char *storage;  /* 128-aligned: the template, constants written, the rest 0 */
  unsigned char *last;     /* what the last call passed (``params``, for tests) */
} Launch;

typedef struct {
  int n;
  Launch launches[2];
} State;

static const char *CAPSULE = "hopper_flash.prepared_launch";

static PyObject *init(PyObject *self, PyObject *args) {
  const char *path;
  if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
  void *lib = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
  if (!lib) Py_RETURN_FALSE;
  encode_fn = (encode_t)dlsym(lib, "cuTensorMapEncodeTiled");
  launch_fn = (launch_t)dlsym(lib, "cuLaunchKernelEx");
  error_string_fn = (error_string_t)dlsym(lib, "cuGetErrorString");
  if (!encode_fn || !launch_fn) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

static void free_launches(State *s) {
  for (int i = 0; i < 2; ++i) {
    free(s->launches[i].params);
    free(s->launches[i].storage);
    free(s->launches[i].last);
  }
  free(s);
}

static void free_state(PyObject *capsule) {
  State *s = (State *)PyCapsule_GetPointer(capsule, CAPSULE);
  if (s) free_launches(s);
}

static int as_i64(PyObject *seq, Py_ssize_t i, int64_t *out) {
  PyObject *item = PySequence_GetItem(seq, i);
  if (!item) return -1;
  *out = PyLong_AsLongLong(item);
  Py_DECREF(item);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* One launch from (function, grid, block, shared, pdl, cooperative, params,
   descs): params a sequence of (kind, size, a, b, value) in parameter order
   (constexprs left out), descs of (tensor, elem_type, elem_size, swizzle,
   box[4], shape[4], strides[4]). */
static int build(Launch *l, PyObject *spec) {
  uint64_t function;
  unsigned gx, gy, gz, block, shared;
  int pdl, coop;
  PyObject *params, *descs;
  if (!PyArg_ParseTuple(spec, "K(III)IIppOO", &function, &gx, &gy, &gz, &block, &shared, &pdl, &coop, &params,
                        &descs))
    return -1;
  l->function = (CUfunction)(uintptr_t)function;
  l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz;
  l->block = block, l->shared = shared, l->pdl = pdl, l->cooperative = coop;
  Py_ssize_t np = PySequence_Size(params), nd = PySequence_Size(descs);
  if (np < 0 || nd < 0) return -1;
  if (np > MAX_PARAMS || nd > MAX_DESCS) {
    PyErr_SetString(PyExc_ValueError, "too many kernel parameters or descriptors");
    return -1;
  }
  l->n_params = (int)np, l->n_descs = (int)nd;
  l->params = calloc(np ? np : 1, sizeof(Param));
  PyObject **values = calloc(np ? np : 1, sizeof(PyObject *));
  if (!values || !l->params) { free(values); PyErr_NoMemory(); return -1; }
  size_t offset = 0;
  int status = -1;
  for (Py_ssize_t i = 0; i < np; ++i) {
    PyObject *p = PySequence_GetItem(params, i);
    if (!p) goto done;
    Param *q = &l->params[i];
    int ok = PyArg_ParseTuple(p, "iiiiO", &q->kind, &q->size, &q->a, &q->b, &values[i]);
    Py_DECREF(p);
    if (!ok) goto done;
    size_t align = q->kind == P_MAP ? 128 : 8;
    offset = (offset + align - 1) / align * align;
    q->offset = offset;
    offset += q->kind == P_MAP ? sizeof(CUtensorMap) : 8;
    if (q->kind == P_VALUE && (q->a < 0 || q->a >= N_VALUES)) {
      PyErr_SetString(PyExc_ValueError, "value index out of range");
      goto done;
    }
    if ((q->kind == P_MAP || q->kind == P_DIM || q->kind == P_STRIDE) && (q->a < 0 || q->a >= nd)) {
      PyErr_SetString(PyExc_ValueError, "descriptor index out of range");
      goto done;
    }
  }
  if (offset > STORAGE_MAX) {
    PyErr_SetString(PyExc_ValueError, "kernel parameters too large");
    goto done;
  }
  l->size = offset ? (offset + 127) / 128 * 128 : 128;
  if (posix_memalign((void **)&l->storage, 128, l->size) != 0 || posix_memalign((void **)&l->last, 128, l->size) != 0) {
    PyErr_NoMemory();
    goto done;
  }
  memset(l->storage, 0, l->size);
  memset(l->last, 0, l->size);
  for (int i = 0; i < l->n_params; ++i) {
    Param *q = &l->params[i];
    if (q->kind == P_CONST) {
      /* Python hands every constant as its bits (floats packed, pointers as addresses). */
      unsigned long long v = PyLong_AsUnsignedLongLongMask(values[i]);
      if (PyErr_Occurred()) goto done;
      memcpy(l->storage + q->offset, &v, q->size);  /* little-endian: the low bytes */
    }
  }
  for (Py_ssize_t d = 0; d < nd; ++d) {
    PyObject *spec_d = PySequence_GetItem(descs, d);
    if (!spec_d) goto done;
    Desc *x = &l->descs[d];
    PyObject *box, *shape, *strides;
    int ok = PyArg_ParseTuple(spec_d, "iiiiOOO", &x->tensor, &x->elem_type, &x->elem_size, &x->swizzle, &box,
                              &shape, &strides);
    if (ok) {
      for (int r = 0; r < RANK && ok; ++r) {
        int64_t bx;
        ok = as_i64(box, r, &bx) == 0 && as_i64(shape, r, &x->shape[r]) == 0 &&
             as_i64(strides, r, &x->strides[r]) == 0;
        x->box[r] = (cuuint32_t)bx;
      }
    }
    Py_DECREF(spec_d);
    if (!ok) goto done;
  }
  status = 0;
done:
  free(values);
  return status;
}

static PyObject *make(PyObject *self, PyObject *args) {
  PyObject *specs;
  if (!PyArg_ParseTuple(args, "O", &specs)) return NULL;
  Py_ssize_t n = PySequence_Size(specs);
  if (n < 1 || n > 2) {
    PyErr_SetString(PyExc_ValueError, "one or two launches");
    return NULL;
  }
  State *s = calloc(1, sizeof(State));
  if (!s) return PyErr_NoMemory();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *spec = PySequence_GetItem(specs, i);
    int bad = !spec || build(&s->launches[i], spec) != 0;
    Py_XDECREF(spec);
    s->n = (int)i + 1;  /* freed below on failure, the failed one included */
    if (bad) {
      free_launches(s);
      return NULL;
    }
  }
  PyObject *capsule = PyCapsule_New(s, CAPSULE, free_state);
  if (!capsule) free_launches(s);
  return capsule;
}

static void set_cuda_error(const char *what, CUresult r) {
  const char *str = NULL;
  if (error_string_fn) error_string_fn(r, &str);
  PyErr_Format(PyExc_RuntimeError, "hopper_flash: %s failed: %s (CUresult %d)", what, str ? str : "unknown", (int)r);
}

/* launch(state, stream, q, k, v, out, lse, o_part, lse_part, seqlen_k, sched, k_strides, v_strides[, cache]):
   addresses as ints (lse and sched may be None), the strides as tuples; a KV
   cache's call (plan.PreparedForward for flash_attn_with_kvcache) adds the
   addresses of its lengths, cache rows, page table and left pads as a
   4-tuple (None where absent). seqlen_k is the K/V descriptors' length and,
   where the template has its slot, the kernel's key length (a paged cache's
   key length, the table's extent, is a constant of the template; a
   contiguous cache's is its length, as for flash_attn_func). */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 13 && nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "launch takes 13 or 14 arguments");
    return NULL;
  }
  State *s = (State *)PyCapsule_GetPointer(args[0], CAPSULE);
  if (!s) return NULL;
  CUstream stream = (CUstream)(uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
  uint64_t addr[4];
  for (int i = 0; i < 4; ++i) addr[i] = PyLong_AsUnsignedLongLong(args[2 + i]);
  uint64_t values[N_VALUES];
  values[0] = addr[3];
  values[1] = args[6] == Py_None ? 0 : PyLong_AsUnsignedLongLong(args[6]);
  values[2] = PyLong_AsUnsignedLongLong(args[7]);
  values[3] = PyLong_AsUnsignedLongLong(args[8]);
  int64_t seqlen_k = PyLong_AsLongLong(args[9]);
  values[4] = (uint64_t)seqlen_k;
  values[5] = args[10] == Py_None ? 0 : PyLong_AsUnsignedLongLong(args[10]);
  values[6] = values[7] = values[8] = values[9] = 0;
  values[10] = addr[0];
  if (nargs == 14) {
    PyObject *cache = args[13];
    if (!PyTuple_Check(cache) || PyTuple_GET_SIZE(cache) != 4) {
      PyErr_SetString(PyExc_TypeError, "the cache addresses must be a 4-tuple");
      return NULL;
    }
    for (int i = 0; i < 4; ++i) {
      PyObject *a = PyTuple_GET_ITEM(cache, i);
      values[6 + i] = a == Py_None ? 0 : PyLong_AsUnsignedLongLong(a);
    }
  }
  int64_t kv_strides[2][RANK];
  for (int t = 0; t < 2; ++t) {
    PyObject *st = args[11 + t];
    if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != RANK) {
      PyErr_SetString(PyExc_TypeError, "k and v strides must be 4-tuples");
      return NULL;
    }
    for (int r = 0; r < RANK; ++r) kv_strides[t][r] = PyLong_AsLongLong(PyTuple_GET_ITEM(st, r));
  }
  if (PyErr_Occurred()) return NULL;
  if (!encode_fn || !launch_fn) {
    PyErr_SetString(PyExc_RuntimeError, "hopper_flash: prepared_launch.init was not called");
    return NULL;
  }

  for (int li = 0; li < s->n; ++li) {
    Launch *l = &s->launches[li];
    _Alignas(128) unsigned char storage[STORAGE_MAX];
    void *ptrs[MAX_PARAMS + 2];
    CUdeviceptr scratch[2] = {0, 0};  /* Triton's global and profile scratch parameters: null */
    memcpy(storage, l->storage, l->size);
    /* This call's shapes and TMA strides per descriptor. */
    int64_t shape[MAX_DESCS][RANK], strides[MAX_DESCS][RANK];
    for (int d = 0; d < l->n_descs; ++d) {
      Desc *x = &l->descs[d];
      memcpy(shape[d], x->shape, sizeof(shape[d]));
      memcpy(strides[d], x->strides, sizeof(strides[d]));
      if (x->tensor == 1 || x->tensor == 2) {
        shape[d][1] = seqlen_k;
        memcpy(strides[d], kv_strides[x->tensor - 1], sizeof(strides[d]));
        /* launcher.tma_strides: an extent-1 axis is never stepped; give it the contiguous stride. */
        for (int r = RANK - 2; r >= 0; --r)
          if (shape[d][r] == 1) strides[d][r] = strides[d][r + 1] * shape[d][r + 1];
      }
    }
    for (int i = 0; i < l->n_params; ++i) {
      Param *q = &l->params[i];
      unsigned char *dst = storage + q->offset;
      ptrs[i] = dst;
      if (q->kind == P_VALUE) {
        memcpy(dst, &values[q->a], q->size);
      } else if (q->kind == P_DIM) {
        int32_t v = (int32_t)shape[q->a][q->b];
        memcpy(dst, &v, q->size < 4 ? q->size : 4);
      } else if (q->kind == P_STRIDE) {
        int64_t v = strides[q->a][q->b];
        memcpy(dst, &v, q->size);
      } else if (q->kind == P_MAP) {
        /* Triton's fill_tma_descriptor: innermost axis first, byte strides of
           all but the innermost, unit element strides, no interleave, 128-byte
           L2 promotion, no out-of-bounds NaN fill. */
        Desc *x = &l->descs[q->a];
        cuuint64_t dims[RANK], bstrides[RANK];
        cuuint32_t box[RANK], unit[RANK] = {1, 1, 1, 1};
        for (int r = 0; r < RANK; ++r) {
          dims[RANK - 1 - r] = (cuuint64_t)shape[q->a][r];
          box[RANK - 1 - r] = x->box[r];
        }
        for (int r = 0; r + 1 < RANK; ++r) bstrides[RANK - 2 - r] = (cuuint64_t)(x->elem_size * strides[q->a][r]);
        bstrides[RANK - 1] = dims[RANK - 1] * bstrides[RANK - 2];
        CUresult r = encode_fn((CUtensorMap *)dst, (CUtensorMapDataType)x->elem_type, RANK,
                               (void *)(uintptr_t)addr[x->tensor], dims, bstrides, box, unit,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, (CUtensorMapSwizzle)x->swizzle,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) {
          set_cuda_error("cuTensorMapEncodeTiled", r);
          return NULL;
        }
      }
    }
    ptrs[l->n_params] = &scratch[0];
    ptrs[l->n_params + 1] = &scratch[1];
    CUlaunchAttribute attrs[2];
    CUlaunchConfig config;
    memset(&config, 0, sizeof(config));
    config.gridDimX = l->grid[0], config.gridDimY = l->grid[1], config.gridDimZ = l->grid[2];
    config.blockDimX = l->block, config.blockDimY = 1, config.blockDimZ = 1;
    config.sharedMemBytes = l->shared;
    config.hStream = stream;
    config.attrs = attrs;
    if (l->pdl) {
      attrs[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[config.numAttrs].value.programmaticStreamSerializationAllowed = 1;
      ++config.numAttrs;
    }
    if (l->cooperative) {
      attrs[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs[config.numAttrs].value.cooperative = 1;
      ++config.numAttrs;
    }
    CUresult r;
    Py_BEGIN_ALLOW_THREADS;
    r = launch_fn(&config, l->function, ptrs, NULL);
    Py_END_ALLOW_THREADS;
    if (r != CUDA_SUCCESS) {
      set_cuda_error("cuLaunchKernelEx", r);
      return NULL;
    }
    memcpy(l->last, storage, l->size);
  }
  Py_RETURN_NONE;
}

/* params(state, i): launch i's parameters as bytes, in order, as the last call passed them (tests). */
static PyObject *params(PyObject *self, PyObject *args) {
  PyObject *capsule;
  int i;
  if (!PyArg_ParseTuple(args, "Oi", &capsule, &i)) return NULL;
  State *s = (State *)PyCapsule_GetPointer(capsule, CAPSULE);
  if (!s) return NULL;
  if (i < 0 || i >= s->n) {
    PyErr_SetString(PyExc_IndexError, "no such launch");
    return NULL;
  }
  Launch *l = &s->launches[i];
  PyObject *out = PyList_New(l->n_params);
  if (!out) return NULL;
  for (int p = 0; p < l->n_params; ++p) {
    Param *q = &l->params[p];
    Py_ssize_t size = q->kind == P_MAP ? (Py_ssize_t)sizeof(CUtensorMap) : q->size;
    PyObject *b = PyBytes_FromStringAndSize((const char *)l->last + q->offset, size);
    if (!b) { Py_DECREF(out); return NULL; }
    PyList_SET_ITEM(out, p, b);
  }
  return out;
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, "init(libcuda_path) -> bool"},
    {"make", make, METH_VARARGS, "make(launch specs) -> state"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch one prepared call"},
    {"params", params, METH_VARARGS, "params(state, i) -> list of bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hopper_flash_prepared_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_hopper_flash_prepared_launch(void) { return PyModule_Create(&module); }

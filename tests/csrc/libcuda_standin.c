/* A stand-in for libcuda's three entry points that hopper_flash's
   csrc/prepared_launch.c calls, for CPU tests (tests/test_c_launch_cpu.py):
   cuTensorMapEncodeTiled writes its arguments into the map (struct Encoded),
   cuLaunchKernelEx records its configuration, and each of them can be made
   to fail. */
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef struct {
  int32_t elem_type, rank;
  uint64_t address;
  uint64_t dims[4];
  uint64_t strides[3];
  uint32_t box[4];
  int32_t unit_element_strides, interleave, swizzle, l2_promotion, oob_fill;
} Encoded; /* 116 bytes: fits the 128-byte map */

typedef struct {
  uint32_t grid[3], block[3], shared;
  uint64_t stream, function;
  uint32_t n_attrs;
  uint32_t attr_ids[4];
  int32_t attr_values[4];
  uint64_t params;
} Recorded;

typedef struct {
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void *hStream;
  struct { int id; char pad[4]; union { char raw[64]; int value; void *align; } value; } *attrs;
  unsigned numAttrs;
} Config; /* CUlaunchConfig's layout on x86-64 (CUlaunchAttribute: id, padding, a 64-byte value) */

static Recorded launches[16];
static int n_launches;
static int fail_encode, fail_launch;

CUresult cuTensorMapEncodeTiled(void *map, int elem_type, uint32_t rank, void *address, const uint64_t *dims,
                                const uint64_t *strides, const uint32_t *box, const uint32_t *element_strides,
                                int interleave, int swizzle, int l2_promotion, int oob_fill) {
  if (fail_encode) return 1;
  Encoded e;
  memset(&e, 0, sizeof(e));
  e.elem_type = elem_type, e.rank = (int32_t)rank, e.address = (uint64_t)(uintptr_t)address;
  e.unit_element_strides = 1;
  for (uint32_t i = 0; i < rank && i < 4; ++i) {
    e.dims[i] = dims[i], e.box[i] = box[i];
    if (element_strides[i] != 1) e.unit_element_strides = 0;
    if (i + 1 < rank) e.strides[i] = strides[i];
  }
  e.interleave = interleave, e.swizzle = swizzle, e.l2_promotion = l2_promotion, e.oob_fill = oob_fill;
  memset(map, 0, 128);
  memcpy(map, &e, sizeof(e));
  return 0;
}

CUresult cuLaunchKernelEx(const Config *config, void *function, void **params, void **extra) {
  if (fail_launch) return 2;
  Recorded *r = &launches[n_launches++ % 16];  /* the first 16 after a reset are read back */
  r->grid[0] = config->gridDimX, r->grid[1] = config->gridDimY, r->grid[2] = config->gridDimZ;
  r->block[0] = config->blockDimX, r->block[1] = config->blockDimY, r->block[2] = config->blockDimZ;
  r->shared = config->sharedMemBytes;
  r->stream = (uint64_t)(uintptr_t)config->hStream, r->function = (uint64_t)(uintptr_t)function;
  r->n_attrs = config->numAttrs;
  for (unsigned i = 0; i < config->numAttrs && i < 4; ++i)
    r->attr_ids[i] = (uint32_t)config->attrs[i].id, r->attr_values[i] = config->attrs[i].value.value;
  r->params = (uint64_t)(uintptr_t)params;
  return extra == 0 ? 0 : 4;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
  *str = error == 1 ? "encode refused (stand-in)" : "launch refused (stand-in)";
  return 0;
}

int standin_launches(Recorded *out, int max) {
  int n = n_launches < max ? n_launches : max;
  if (n > 16) n = 16;
  memcpy(out, launches, n * sizeof(Recorded));
  return n;
}

void standin_reset(int encode_fails, int launch_fails) {
  n_launches = 0, fail_encode = encode_fails, fail_launch = launch_fails;
}

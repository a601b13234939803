/*
 * A fake libcuda.so.1 for machines without a GPU: "device" memory is host
 * memory, copies are memcpy, events report NOT_READY on their first query.
 * It lets scripts/fake-cuda-check.sh drive every kvwire CUDA code path
 * (loading, probe, DeviceBuffer, streams/events, pinned copies, dma-buf
 * export as a memfd, VramPages, the registration chain) without hardware.
 * It checks kvwire's calls, not the driver: a real GPU run is still needed
 * (docs/GPU.md).
 *
 * Env: FAKE_CUDA_DMABUF=0 clears CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED;
 *      FAKE_CUDA_BUS_ID sets the PCIe bus id (default 0000:3B:00.0).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, INVALID_DEVICE = 101, NOT_READY = 600 };

static int inited;
static int ctx_token;
#define MAX_ALLOCS 4096
static struct { uintptr_t base; size_t len; } allocs[MAX_ALLOCS];

CUresult cuInit(unsigned flags) { inited = (flags == 0); return inited ? OK : INVALID_VALUE; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "CUDA_ERROR_FAKE"; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!inited) return NOT_INITIALIZED; *n = 1; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal != 0) return INVALID_DEVICE; *d = 0; return OK; }
CUresult cuDeviceGetName(char *name, int len, int dev) { (void)dev; strncpy(name, "kvwire fake GPU", len); name[len - 1] = 0; return OK; }
CUresult cuDeviceGetPCIBusId(char *bus, int len, int dev) {
    (void)dev;
    const char *b = getenv("FAKE_CUDA_BUS_ID");
    strncpy(bus, b ? b : "0000:3B:00.0", len); bus[len - 1] = 0; return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) { (void)dev; *bytes = (size_t)1 << 34; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev;
    const char *d = getenv("FAKE_CUDA_DMABUF");
    if (attr == 124) *v = !(d && d[0] == '0');
    else if (attr == 116) *v = 1;
    else *v = 0;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; *ctx = &ctx_token; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == &ctx_token ? OK : INVALID_VALUE; }
CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) { (void)target; (void)scope; return OK; }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t len) {
    void *m = aligned_alloc(2 << 20, len);
    if (!m) return 2; /* OUT_OF_MEMORY */
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!allocs[i].base) { allocs[i].base = (uintptr_t)m; allocs[i].len = len; *p = (uintptr_t)m; return OK; }
    free(m); return 2;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].base == p) { allocs[i].base = 0; free((void *)(uintptr_t)p); return OK; }
    return INVALID_VALUE;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *len, CUdeviceptr p) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].base && p >= allocs[i].base && p < allocs[i].base + allocs[i].len) {
            *base = allocs[i].base; *len = allocs[i].len; return OK;
        }
    return INVALID_VALUE;
}
CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t len, int type, unsigned long long flags) {
    CUdeviceptr base; size_t alen;
    if (type != 1 || flags != 0 || p % 4096 || len % 4096) return INVALID_VALUE;
    if (cuMemGetAddressRange_v2(&base, &alen, p) || p + len > base + alen) return INVALID_VALUE;
    int fd = memfd_create("fake-dmabuf", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)len)) return INVALID_VALUE;
    *(int *)handle = fd;
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *s) { (void)s; memset((void *)(uintptr_t)p, v, n); return OK; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) { (void)s; memcpy((void *)(uintptr_t)d, h, n); return OK; }
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) { (void)s; memcpy(h, (void *)(uintptr_t)d, n); return OK; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { (void)flags; *p = malloc(n); return *p ? OK : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return OK; }

CUresult cuStreamCreate(void **s, unsigned flags) { (void)flags; *s = malloc(8); return OK; }
CUresult cuStreamDestroy_v2(void *s) { free(s); return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; return OK; }
CUresult cuEventCreate(void **e, unsigned flags) { (void)flags; *e = calloc(1, sizeof(int)); return OK; }
CUresult cuEventRecord(void *e, void *s) { (void)s; *(int *)e = 0; return OK; }
CUresult cuEventQuery(void *e) { return (*(int *)e)++ ? OK : NOT_READY; }
CUresult cuEventSynchronize(void *e) { *(int *)e = 1; return OK; }
CUresult cuEventDestroy_v2(void *e) { free(e); return OK; }

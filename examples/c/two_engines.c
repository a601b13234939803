/* The smallest kvwire C program: two engines (agents) in one process, one
 * WRITE of 4 KiB with a notification, over shm (the default transport).
 * In a real deployment the engines live in different processes or hosts and
 * the metadata bytes travel over your own channel (ZMQ, HTTP, a file).
 *
 * Build and run (scripts/capi-tests.sh does exactly this):
 *   cargo build --release --manifest-path capi/Cargo.toml
 *   gcc -std=c11 -Iinclude examples/c/two_engines.c -Lcapi/target/release -lkvwire_c \
 *       -Wl,-rpath,capi/target/release -o two_engines && ./two_engines
 * Across hosts: create both with "tcp" and options such as
 * "listen=10.0.0.2:0,peer_timeout_ms=2000" (docs/CAPI.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvwire.h"

#define TRY(call)                                                              \
    do {                                                                       \
        if ((call) != KVW_OK) {                                                \
            fprintf(stderr, "error: %s: %s\n", #call, kvw_last_error());       \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

static void on_notif(void *user, const char *agent, const uint8_t *msg, size_t len) {
    printf("notification from %s: %.*s\n", agent, (int)len, (const char *)msg);
    *(int *)user = 1;
}

int main(void) {
    static uint8_t src[4096], dst[4096];
    memset(src, 0xab, sizeof src);

    KvwEngine *decode = NULL, *prefill = NULL;
    TRY(kvw_engine_create_with_options("decode", "shm", "peer_timeout_ms=2000", &decode));
    TRY(kvw_engine_create("prefill", "shm", &prefill));
    uint64_t reg_dst, reg_src;
    TRY(kvw_register(decode, (uint64_t)(uintptr_t)dst, sizeof dst, &reg_dst));
    TRY(kvw_register(prefill, (uint64_t)(uintptr_t)src, sizeof src, &reg_src));

    /* decode's metadata (taken after registering) -> prefill connects */
    size_t len = 0;
    kvw_metadata_get(decode, NULL, 0, &len); /* KVW_ERR_BUFFER_TOO_SMALL, len set */
    uint8_t *md = malloc(len);
    TRY(kvw_metadata_get(decode, md, len, &len));
    TRY(kvw_metadata_load(prefill, md, len));
    free(md);

    KvwDesc local = {(uint64_t)(uintptr_t)src, sizeof src};
    KvwDesc remote = {(uint64_t)(uintptr_t)dst, sizeof dst};
    uint64_t xfer;
    TRY(kvw_post(prefill, KVW_OP_WRITE, &local, 1, "decode", &remote, 1, (const uint8_t *)"req-1", 5, &xfer));
    KvwXferState state;
    TRY(kvw_wait(prefill, xfer, KVW_WAIT_FOREVER, &state, NULL));
    if (state != KVW_XFER_DONE) {
        fprintf(stderr, "error: transfer failed: %s\n", kvw_last_error());
        return 1;
    }
    TRY(kvw_release(prefill, xfer));

    int got = 0;
    while (!got) TRY(kvw_get_notifs(decode, on_notif, &got, NULL));
    printf("%s\n", memcmp(src, dst, sizeof dst) == 0 ? "4096 bytes arrived intact" : "MISMATCH");

    kvw_engine_destroy(prefill);
    kvw_engine_destroy(decode);
    return memcmp(src, dst, sizeof dst) != 0;
}

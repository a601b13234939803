/* Two hosts, one transfer, through kvwire's C ABI over the tcp transport.
 *
 *   remote target    FILE [OPTIONS]   # host B: register 1 MiB, publish it in FILE, wait
 *   remote initiator FILE [OPTIONS]   # host A: read FILE, WRITE 1 MiB with a notification
 *
 * FILE carries what the initiator needs from the target: the address and
 * length of the target's buffer and the target engine's metadata. Here it is
 * a file on a shared directory; an engine sends the same bytes over its own
 * channel (ZMQ, HTTP). OPTIONS are kvw_engine_create_with_options options,
 * e.g. "listen=10.0.0.2:0,peer_timeout_ms=5000". The target exits 0 once all
 * 1 MiB arrived intact and the notification came; the initiator once its
 * transfer is done. Each side says what it waits for and gives up after
 * WAIT_S (60) seconds: the target for the WRITE, the initiator for FILE and
 * for its transfer. scripts/netns-tests.sh runs both between two network
 * namespaces; build as docs/CAPI.md shows. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* How long each side waits for the other (the metadata file, the WRITE). */
#define WAIT_S 60

#include "kvwire.h"

enum { LEN = 1 << 20 };

static void fail(const char *what) {
    fprintf(stderr, "error: %s: %s\n", what, kvw_last_error());
    exit(1);
}
#define TRY(call) \
    do {          \
        if ((call) != KVW_OK) fail(#call); \
    } while (0)

static uint8_t pattern(size_t i) { return (uint8_t)(i * 131 + 7); }

static void on_notif(void *user, const char *agent, const uint8_t *msg, size_t len) {
    printf("target: notification from %s: %.*s\n", agent, (int)len, (const char *)msg);
    *(int *)user = 1;
}

static int target(const char *file, const char *options) {
    uint8_t *buf = calloc(1, LEN);
    KvwEngine *e = NULL;
    TRY(kvw_engine_create_with_options("c-target", "tcp", options, &e));
    uint64_t reg;
    TRY(kvw_register(e, (uint64_t)(uintptr_t)buf, LEN, &reg));
    size_t len = 0;
    kvw_metadata_get(e, NULL, 0, &len);
    uint8_t *md = malloc(len);
    TRY(kvw_metadata_get(e, md, len, &len));
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    FILE *f = fopen(tmp, "wb");
    uint64_t head[3] = {(uint64_t)(uintptr_t)buf, LEN, len};
    if (!f || fwrite(head, sizeof head, 1, f) != 1 || fwrite(md, len, 1, f) != 1 || fclose(f) != 0 ||
        rename(tmp, file) != 0) {
        perror("error: writing the metadata file");
        return 1;
    }
    printf("target: %d bytes registered, metadata in %s; waiting up to %d s for the initiator's WRITE and its notification\n",
           LEN, file, WAIT_S);
    fflush(stdout);
    int got = 0;
    time_t until = time(NULL) + WAIT_S;
    while (!got && time(NULL) < until) {
        TRY(kvw_get_notifs(e, on_notif, &got, NULL));
        usleep(1000);
    }
    if (!got) {
        fprintf(stderr, "error: no notification within %d s: did `remote initiator %s` run on the other host?\n", WAIT_S, file);
        return 1;
    }
    size_t bad = 0;
    for (size_t i = 0; i < LEN; i++) bad += buf[i] != pattern(i);
    printf("target: %s\n", bad ? "MISMATCH" : "1048576 bytes verified");
    kvw_engine_destroy(e);
    free(md);
    free(buf);
    return bad != 0;
}

static int initiator(const char *file, const char *options) {
    FILE *f = fopen(file, "rb");
    if (!f) {
        printf("initiator: waiting up to %d s for %s (written by `remote target %s`)\n", WAIT_S, file, file);
        fflush(stdout);
    }
    for (int i = 0; i < WAIT_S * 10 && !f; i++) {
        usleep(100000);
        f = fopen(file, "rb");
    }
    if (!f) {
        fprintf(stderr, "error: %s did not appear within %d s: start `remote target %s` first\n", file, WAIT_S, file);
        return 1;
    }
    uint64_t head[3];
    if (fread(head, sizeof head, 1, f) != 1 || head[2] > (64u << 20)) {
        fprintf(stderr, "error: cannot read %s\n", file);
        return 1;
    }
    uint8_t *md = malloc(head[2]);
    if (fread(md, head[2], 1, f) != 1) {
        fprintf(stderr, "error: %s is truncated\n", file);
        return 1;
    }
    fclose(f);
    uint8_t *buf = malloc(LEN);
    for (size_t i = 0; i < LEN; i++) buf[i] = pattern(i);
    KvwEngine *e = NULL;
    TRY(kvw_engine_create_with_options("c-initiator", "tcp", options, &e));
    uint64_t reg;
    TRY(kvw_register(e, (uint64_t)(uintptr_t)buf, LEN, &reg));
    TRY(kvw_metadata_load(e, md, head[2]));
    KvwDesc local = {(uint64_t)(uintptr_t)buf, LEN};
    KvwDesc remote = {head[0], head[1] < LEN ? head[1] : LEN};
    uint64_t x;
    TRY(kvw_post(e, KVW_OP_WRITE, &local, 1, "c-target", &remote, 1, (const uint8_t *)"done", 4, &x));
    KvwXferState st = KVW_XFER_IN_PROGRESS;
    time_t until = time(NULL) + WAIT_S;
    while (st == KVW_XFER_IN_PROGRESS && time(NULL) < until) {
        TRY(kvw_status(e, x, &st));
        if (st == KVW_XFER_IN_PROGRESS) usleep(100);
    }
    if (st == KVW_XFER_IN_PROGRESS) {
        fprintf(stderr, "error: the WRITE to the target did not complete within %d s\n", WAIT_S);
        return 1;
    }
    if (st != KVW_XFER_DONE) fail("transfer");
    TRY(kvw_release(e, x));
    printf("initiator: wrote %d bytes\n", LEN);
    kvw_engine_destroy(e);
    free(md);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s target|initiator FILE [OPTIONS]\n", argv[0]);
        return 2;
    }
    const char *options = argc == 4 ? argv[3] : NULL;
    if (strcmp(argv[1], "target") == 0) return target(argv[2], options);
    if (strcmp(argv[1], "initiator") == 0) return initiator(argv[2], options);
    fprintf(stderr, "error: the first argument must be target or initiator\n");
    return 2;
}

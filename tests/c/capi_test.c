/* Two kvwire engines in one process moving bytes over shm through the C ABI,
 * plus its error paths. Built and run by scripts/capi-tests.sh. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvwire.h"

static int failures = 0, passed = 0;
#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (cond) {                                                                            \
            passed++;                                                                          \
        } else {                                                                               \
            failures++;                                                                        \
            fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #cond, \
                    kvw_last_error());                                                         \
        }                                                                                      \
    } while (0)

struct notifs {
    int count;
    char agent[64];
    char msg[64];
};

static void on_notif(void *user, const char *agent, const uint8_t *msg, size_t len) {
    struct notifs *n = user;
    n->count++;
    snprintf(n->agent, sizeof n->agent, "%s", agent);
    snprintf(n->msg, sizeof n->msg, "%.*s", (int)len, (const char *)msg);
}

/* Two engines on `transport` (options `opts`) named `tname` and `iname`,
   each with one buffer registered (the target's registration in *treg), the
   initiator connected to the target. */
static void connected_pair_on(const char *transport, const char *opts, const char *tname, uint8_t *tbuf, size_t tlen,
                              const char *iname, uint8_t *ibuf, size_t ilen, KvwEngine **t, KvwEngine **i,
                              uint64_t *treg) {
    uint64_t ireg = 0;
    size_t len = 0;
    CHECK(kvw_engine_create_with_options(tname, transport, opts, t) == KVW_OK);
    CHECK(kvw_engine_create_with_options(iname, transport, opts, i) == KVW_OK);
    CHECK(kvw_register(*t, (uint64_t)(uintptr_t)tbuf, tlen, treg) == KVW_OK);
    CHECK(kvw_register(*i, (uint64_t)(uintptr_t)ibuf, ilen, &ireg) == KVW_OK);
    CHECK(kvw_metadata_get(*t, NULL, 0, &len) == KVW_ERR_BUFFER_TOO_SMALL);
    uint8_t *md = malloc(len);
    CHECK(kvw_metadata_get(*t, md, len, &len) == KVW_OK);
    CHECK(kvw_metadata_load(*i, md, len) == KVW_OK);
    free(md);
}

/* connected_pair_on shm with default options. */
static void connected_pair(const char *tname, uint8_t *tbuf, size_t tlen, const char *iname, uint8_t *ibuf,
                           size_t ilen, KvwEngine **t, KvwEngine **i, uint64_t *treg) {
    connected_pair_on("shm", NULL, tname, tbuf, tlen, iname, ibuf, ilen, t, i, treg);
}

static int wait_done(KvwEngine *e, uint64_t h) {
    KvwXferState st = KVW_XFER_IN_PROGRESS;
    for (long i = 0; i < 50000000L && st == KVW_XFER_IN_PROGRESS; i++) {
        if (kvw_status(e, h, &st) != KVW_OK) return -1;
    }
    return st == KVW_XFER_DONE ? 0 : -1;
}

int main(void) {
    /* SIGPIPE's default action (terminate), whatever the runner set: the
       tcp test below checks that kvwire never raises it. */
    signal(SIGPIPE, SIG_DFL);
    enum { LEN = 1 << 20 };
    uint8_t *src = malloc(LEN), *dst = calloc(1, LEN);
    for (size_t i = 0; i < LEN; i++) src[i] = (uint8_t)(i * 7 + 3);

    KvwEngine *target = NULL, *initiator = NULL;
    CHECK(kvw_engine_create("c-decode", "shm", &target) == KVW_OK);
    CHECK(kvw_engine_create("c-prefill", NULL, &initiator) == KVW_OK);
    uint64_t rdst = 0, rsrc = 0;
    CHECK(kvw_register(target, (uint64_t)(uintptr_t)dst, LEN, &rdst) == KVW_OK);
    CHECK(kvw_register(initiator, (uint64_t)(uintptr_t)src, LEN, &rsrc) == KVW_OK);

    /* metadata: size query, then copy, then load (connect) */
    size_t md_len = 0;
    CHECK(kvw_metadata_get(target, NULL, 0, &md_len) == KVW_ERR_BUFFER_TOO_SMALL);
    CHECK(md_len > 0);
    uint8_t *md = malloc(md_len);
    CHECK(kvw_metadata_get(target, md, md_len, &md_len) == KVW_OK);
    CHECK(kvw_metadata_load(initiator, md, md_len) == KVW_OK);
    CHECK(kvw_metadata_load(initiator, md, md_len) == KVW_ERR_STATE); /* already connected */

    /* WRITE two ranges with a notification */
    KvwDesc l[2] = {{(uint64_t)(uintptr_t)src, 4096}, {(uint64_t)(uintptr_t)(src + 8192), 65536}};
    KvwDesc r[2] = {{(uint64_t)(uintptr_t)(dst + 100), 4096}, {(uint64_t)(uintptr_t)(dst + 200000), 65536}};
    uint64_t h = 0;
    CHECK(kvw_post(initiator, KVW_OP_WRITE, l, 2, "c-decode", r, 2, (const uint8_t *)"xfer-1", 6, &h) == KVW_OK);
    CHECK(wait_done(initiator, h) == 0);
    CHECK(kvw_release(initiator, h) == KVW_OK);
    CHECK(memcmp(dst + 100, src, 4096) == 0);
    CHECK(memcmp(dst + 200000, src + 8192, 65536) == 0);
    CHECK(dst[99] == 0 && dst[100 + 4096] == 0);

    struct notifs n = {0};
    KvwStatus nrc = KVW_OK;
    for (long i = 0; i < 50000000L && n.count == 0 && nrc == KVW_OK; i++) nrc = kvw_get_notifs(target, on_notif, &n, NULL);
    CHECK(nrc == KVW_OK);
    CHECK(n.count == 1);
    CHECK(strcmp(n.agent, "c-prefill") == 0);
    CHECK(strcmp(n.msg, "xfer-1") == 0);

    /* READ back into another local range, no notification */
    KvwDesc lr = {(uint64_t)(uintptr_t)(src + 500000), 4096};
    KvwDesc rr = {(uint64_t)(uintptr_t)(dst + 100), 4096};
    memset(src + 500000, 0, 4096);
    CHECK(kvw_post(initiator, KVW_OP_READ, &lr, 1, "c-decode", &rr, 1, NULL, 0, &h) == KVW_OK);
    CHECK(wait_done(initiator, h) == 0);
    CHECK(kvw_release(initiator, h) == KVW_OK);
    CHECK(memcmp(src + 500000, src, 4096) == 0);

    /* kvw_wait: sleeps until the transfer ends (1 MiB READ, no polling) */
    {
        memset(src, 0, LEN);
        KvwDesc la = {(uint64_t)(uintptr_t)src, LEN}, ra = {(uint64_t)(uintptr_t)dst, LEN};
        CHECK(kvw_post(initiator, KVW_OP_READ, &la, 1, "c-decode", &ra, 1, (const uint8_t *)"w", 1, &h) == KVW_OK);
        KvwXferState ws = KVW_XFER_FAILED;
        KvwStatus wc = KVW_ERR_PANIC;
        CHECK(kvw_wait(initiator, h, KVW_WAIT_FOREVER, &ws, &wc) == KVW_OK);
        CHECK(ws == KVW_XFER_DONE);
        CHECK(wc == KVW_OK);
        CHECK(memcmp(src, dst, LEN) == 0);
        ws = KVW_XFER_FAILED;
        CHECK(kvw_wait(initiator, h, 0, &ws, NULL) == KVW_OK); /* 0: one check, of a finished transfer */
        CHECK(ws == KVW_XFER_DONE);
        CHECK(kvw_wait(initiator, h, 1000, NULL, NULL) == KVW_ERR_INVALID_ARG);
        CHECK(kvw_release(initiator, h) == KVW_OK);
        CHECK(kvw_wait(initiator, h, 1000, &ws, NULL) == KVW_ERR_NOT_FOUND);
        CHECK(kvw_wait(NULL, h, 1000, &ws, NULL) == KVW_ERR_INVALID_ARG);
        for (size_t i = 0; i < LEN; i++) src[i] = (uint8_t)(i * 7 + 3);
        n.count = 0;
        for (long i = 0; i < 50000000L && n.count == 0; i++) kvw_get_notifs(target, on_notif, &n, NULL);
        CHECK(n.count == 1 && strcmp(n.msg, "w") == 0);
    }

    /* error paths */
    KvwDesc oob = {(uint64_t)(uintptr_t)(dst + LEN - 10), 4096};
    CHECK(kvw_post(initiator, KVW_OP_WRITE, l, 1, "c-decode", &oob, 1, NULL, 0, &h) == KVW_ERR_BAD_DESC);
    CHECK(strlen(kvw_last_error()) > 0);
    CHECK(kvw_post(initiator, KVW_OP_WRITE, l, 2, "c-decode", r, 1, NULL, 0, &h) == KVW_ERR_BAD_DESC);
    CHECK(kvw_post(initiator, KVW_OP_WRITE, l, 1, "nobody", r, 1, NULL, 0, &h) == KVW_ERR_NOT_FOUND);
    CHECK(kvw_post(initiator, 7, l, 1, "c-decode", r, 1, NULL, 0, &h) == KVW_ERR_INVALID_ARG);
    CHECK(kvw_post(initiator, KVW_OP_WRITE, NULL, 1, "c-decode", r, 1, NULL, 0, &h) == KVW_ERR_INVALID_ARG);
    KvwXferState st;
    CHECK(kvw_status(initiator, 123456, &st) == KVW_ERR_NOT_FOUND);
    CHECK(kvw_release(initiator, 123456) == KVW_ERR_NOT_FOUND);
    CHECK(kvw_deregister(initiator, 999) == KVW_ERR_NOT_FOUND);
    CHECK(kvw_metadata_load(initiator, (const uint8_t *)"junk", 4) == KVW_ERR_METADATA);
    /* a range inside a registration is a registration of its own (NIXL accepts overlaps) */
    {
        uint64_t inner = 0;
        CHECK(kvw_register(initiator, (uint64_t)(uintptr_t)(src + 10), 100, &inner) == KVW_OK);
        CHECK(kvw_deregister(initiator, inner) == KVW_OK);
    }
    CHECK(kvw_engine_create("x", "carrier-pigeon", &target) == KVW_ERR_INVALID_ARG);
    CHECK(kvw_engine_create(NULL, NULL, &target) == KVW_ERR_INVALID_ARG);
    CHECK(kvw_register(NULL, 0, 1, &rsrc) == KVW_ERR_INVALID_ARG);

    /* a failed transfer's category: the target deregistered the memory the
       initiator still holds a key for -> KVW_ERR_REMOTE_ACCESS */
    {
        KvwEngine *t2 = NULL, *i2 = NULL;
        uint8_t *buf2 = calloc(1, 65536);
        uint64_t r2 = 0;
        connected_pair("c-gone", buf2, 65536, "c-poster", src, LEN, &t2, &i2, &r2);
        CHECK(kvw_deregister(t2, r2) == KVW_OK);
        KvwDesc ls = {(uint64_t)(uintptr_t)src, 4096}, rs = {(uint64_t)(uintptr_t)buf2, 4096};
        uint64_t h2 = 0;
        CHECK(kvw_post(i2, KVW_OP_WRITE, &ls, 1, "c-gone", &rs, 1, NULL, 0, &h2) == KVW_OK);
        KvwXferState s2 = KVW_XFER_IN_PROGRESS;
        KvwStatus code = KVW_OK;
        for (long i = 0; i < 50000000L && s2 == KVW_XFER_IN_PROGRESS; i++) {
            if (kvw_status_code(i2, h2, &s2, &code) != KVW_OK) break;
        }
        CHECK(s2 == KVW_XFER_FAILED);
        CHECK(code == KVW_ERR_REMOTE_ACCESS);
        CHECK(strlen(kvw_last_error()) > 0);
        CHECK(kvw_release(i2, h2) == KVW_OK);
        /* the same failure through kvw_wait, its message replacing another */
        CHECK(kvw_post(i2, KVW_OP_WRITE, &ls, 1, "c-gone", &rs, 1, NULL, 0, &h2) == KVW_OK);
        CHECK(kvw_status(i2, 987654, &s2) == KVW_ERR_NOT_FOUND);
        CHECK(strstr(kvw_last_error(), "rkey") == NULL);
        s2 = KVW_XFER_IN_PROGRESS;
        code = KVW_OK;
        CHECK(kvw_wait(i2, h2, 10000000, &s2, &code) == KVW_OK);
        CHECK(s2 == KVW_XFER_FAILED);
        CHECK(code == KVW_ERR_REMOTE_ACCESS);
        CHECK(strstr(kvw_last_error(), "rkey") != NULL);
        CHECK(kvw_release(i2, h2) == KVW_OK);
        CHECK(kvw_status_code(i2, h2, &s2, NULL) == KVW_ERR_INVALID_ARG);
        kvw_engine_destroy(i2);
        kvw_engine_destroy(t2);
        free(buf2);
    }

    /* kvw_wait's timeout: 1 µs cannot see a 64 MiB copy end; no limit does */
    {
        enum { BIG = 64 << 20 };
        KvwEngine *t3 = NULL, *i3 = NULL;
        uint8_t *from = malloc(BIG), *to = calloc(1, BIG);
        for (size_t i = 0; i < BIG; i += 4096) from[i] = (uint8_t)(i >> 12);
        uint64_t r3 = 0, h3 = 0;
        connected_pair("c-big-target", to, BIG, "c-big-initiator", from, BIG, &t3, &i3, &r3);
        KvwDesc lb = {(uint64_t)(uintptr_t)from, BIG}, rb = {(uint64_t)(uintptr_t)to, BIG};
        CHECK(kvw_post(i3, KVW_OP_WRITE, &lb, 1, "c-big-target", &rb, 1, NULL, 0, &h3) == KVW_OK);
        KvwXferState s3 = KVW_XFER_FAILED;
        KvwStatus c3 = KVW_ERR_PANIC;
        CHECK(kvw_wait(i3, h3, 1, &s3, &c3) == KVW_OK);
        CHECK(s3 == KVW_XFER_IN_PROGRESS); /* timed out: the handle stays valid */
        CHECK(c3 == KVW_OK);
        CHECK(kvw_wait(i3, h3, KVW_WAIT_FOREVER, &s3, &c3) == KVW_OK);
        CHECK(s3 == KVW_XFER_DONE);
        CHECK(memcmp(from, to, BIG) == 0);
        CHECK(kvw_release(i3, h3) == KVW_OK);
        kvw_engine_destroy(i3);
        kvw_engine_destroy(t3);
        free(from);
        free(to);
    }

    /* a tcp target that goes away in the middle of a WRITE: the transfer
       fails (PEER_DIED) and this process lives on. C programs keep SIGPIPE's
       default action (terminate), so a send into the closed socket must not
       raise it. Several rounds: the close has to land mid-stream, and a send
       into a reset socket may first fail with ECONNRESET (no signal), so a
       kvwire without MSG_NOSIGNAL dies in some rounds, not every one. */
    {
        enum { MID = 128 << 20 };
        uint8_t *a = malloc(MID), *b = calloc(1, MID);
        memset(a, 7, MID);
        int failed = 0;
        for (int round = 0; round < 6; round++) {
            KvwEngine *t4 = NULL, *i4 = NULL;
            uint64_t r4 = 0, h4 = 0;
            connected_pair_on("tcp", "listen=127.0.0.1:0", "c-tcp-gone", b, MID, "c-tcp-writer", a, MID, &t4, &i4, &r4);
            KvwDesc la = {(uint64_t)(uintptr_t)a, MID}, rb = {(uint64_t)(uintptr_t)b, MID};
            CHECK(kvw_post(i4, KVW_OP_WRITE, &la, 1, "c-tcp-gone", &rb, 1, NULL, 0, &h4) == KVW_OK);
            KvwXferState s4 = KVW_XFER_IN_PROGRESS;
            KvwStatus c4 = KVW_OK;
            CHECK(kvw_wait(i4, h4, 2000, &s4, NULL) == KVW_OK);
            kvw_engine_destroy(t4);
            CHECK(kvw_wait(i4, h4, KVW_WAIT_FOREVER, &s4, &c4) == KVW_OK);
            CHECK(s4 != KVW_XFER_IN_PROGRESS);
            if (s4 == KVW_XFER_FAILED) {
                failed++;
                CHECK(c4 == KVW_ERR_PEER_DIED);
            }
            CHECK(kvw_release(i4, h4) == KVW_OK);
            kvw_engine_destroy(i4);
        }
        CHECK(failed > 0); /* at least one close landed mid-stream */
        free(a);
        free(b);
    }

    /* kvw_metadata_load_as: connect, re-load unchanged, update with a new
       region, refuse another agent's metadata; kvw_notify (genNotif) */
    {
        enum { N = 65536 };
        uint8_t *a = calloc(1, N), *b = calloc(1, N), *c = malloc(N);
        for (size_t k = 0; k < N; k++) c[k] = (uint8_t)(k * 13 + 1);
        KvwEngine *lt = NULL, *li = NULL;
        uint64_t ra = 0, rb = 0, rc = 0;
        CHECK(kvw_engine_create("c-load-t", "shm", &lt) == KVW_OK);
        CHECK(kvw_engine_create("c-load-i", "shm", &li) == KVW_OK);
        CHECK(kvw_register(lt, (uint64_t)(uintptr_t)a, N, &ra) == KVW_OK);
        CHECK(kvw_register(li, (uint64_t)(uintptr_t)c, N, &rc) == KVW_OK);
        size_t l1 = 0, l2 = 0;
        kvw_metadata_get(lt, NULL, 0, &l1);
        uint8_t *md1 = malloc(l1);
        CHECK(kvw_metadata_get(lt, md1, l1, &l1) == KVW_OK);
        int32_t outcome = -1;
        CHECK(kvw_metadata_load_as(li, "someone-else", md1, l1, &outcome) == KVW_ERR_METADATA);
        CHECK(strstr(kvw_last_error(), "someone-else") != NULL);
        CHECK(outcome == -1);
        CHECK(kvw_metadata_load_as(li, "c-load-t", md1, l1, &outcome) == KVW_OK);
        CHECK(outcome == KVW_LOAD_CONNECTED);
        CHECK(kvw_metadata_load_as(li, NULL, md1, l1, &outcome) == KVW_OK);
        CHECK(outcome == KVW_LOAD_UNCHANGED);
        /* b is not in the loaded metadata yet: a WRITE to it is refused */
        KvwDesc lc = {(uint64_t)(uintptr_t)c, N}, rbd = {(uint64_t)(uintptr_t)b, N};
        uint64_t h2 = 0;
        CHECK(kvw_post(li, KVW_OP_WRITE, &lc, 1, "c-load-t", &rbd, 1, NULL, 0, &h2) == KVW_ERR_BAD_DESC);
        CHECK(kvw_register(lt, (uint64_t)(uintptr_t)b, N, &rb) == KVW_OK);
        kvw_metadata_get(lt, NULL, 0, &l2);
        uint8_t *md2 = malloc(l2);
        CHECK(kvw_metadata_get(lt, md2, l2, &l2) == KVW_OK);
        CHECK(kvw_metadata_load_as(li, "c-load-t", md2, l2, &outcome) == KVW_OK);
        CHECK(outcome == KVW_LOAD_UPDATED);
        /* the older snapshot does not take the new region away */
        CHECK(kvw_metadata_load_as(li, "c-load-t", md1, l1, &outcome) == KVW_OK);
        CHECK(outcome == KVW_LOAD_UNCHANGED);
        CHECK(kvw_post(li, KVW_OP_WRITE, &lc, 1, "c-load-t", &rbd, 1, NULL, 0, &h2) == KVW_OK);
        CHECK(wait_done(li, h2) == 0);
        CHECK(kvw_release(li, h2) == KVW_OK);
        CHECK(memcmp(b, c, N) == 0);
        /* malformed metadata and NULL arguments */
        CHECK(kvw_metadata_load_as(li, NULL, (const uint8_t *)"junk", 4, NULL) == KVW_ERR_METADATA);
        CHECK(kvw_metadata_load_as(NULL, NULL, md1, l1, NULL) == KVW_ERR_INVALID_ARG);
        /* kvw_notify: delivered with its sender's name, binary-safe */
        const uint8_t payload[5] = {'n', 0, 't', 'f', 0};
        CHECK(kvw_notify(li, "c-load-t", payload, sizeof payload) == KVW_OK);
        CHECK(kvw_notify(li, "nobody", payload, sizeof payload) == KVW_ERR_NOT_FOUND);
        uint8_t *big = calloc(1, (64 << 10) + 1);
        CHECK(kvw_notify(li, "c-load-t", big, (64 << 10) + 1) == KVW_ERR_TRANSPORT);
        free(big);
        struct notifs nn = {0};
        size_t got = 0;
        for (long k = 0; k < 50000000L && nn.count == 0; k++) kvw_get_notifs(lt, on_notif, &nn, &got);
        CHECK(nn.count == 1);
        CHECK(strcmp(nn.agent, "c-load-i") == 0);
        CHECK(nn.msg[0] == 'n' && nn.msg[1] == 0);
        kvw_engine_destroy(li);
        kvw_engine_destroy(lt);
        free(md1);
        free(md2);
        free(a);
        free(b);
        free(c);
    }

    /* kvw_register_mem: DRAM as kvw_register; VRAM refused by the CPU-copy
       backends (shm, tcp) with a message; unknown memory types refused */
    {
        enum { N = 8192 };
        uint8_t *m = calloc(1, N);
        KvwEngine *me = NULL;
        uint64_t r1 = 0, r2 = 0;
        CHECK(kvw_engine_create("c-mem", "shm", &me) == KVW_OK);
        CHECK(kvw_register_mem(me, (uint64_t)(uintptr_t)m, N / 2, KVW_MEM_DRAM, 7, &r1) == KVW_OK);
        CHECK(kvw_register_mem(me, (uint64_t)(uintptr_t)(m + N / 2), N / 2, KVW_MEM_VRAM, 0, &r2) == KVW_ERR_TRANSPORT);
        CHECK(strstr(kvw_last_error(), "DRAM") != NULL); /* "moves host (DRAM) memory only" */
        CHECK(kvw_register_mem(me, (uint64_t)(uintptr_t)(m + N / 2), N / 2, 5, 0, &r2) == KVW_ERR_INVALID_ARG);
        CHECK(kvw_register_mem(me, (uint64_t)(uintptr_t)(m + N / 2), N / 2, KVW_MEM_DRAM, 0, NULL) == KVW_ERR_INVALID_ARG);
        CHECK(kvw_deregister(me, r1) == KVW_OK);
        kvw_engine_destroy(me);
        KvwEngine *te = NULL;
        CHECK(kvw_engine_create_with_options("c-mem-tcp", "tcp", "listen=127.0.0.1:0", &te) == KVW_OK);
        CHECK(kvw_register_mem(te, (uint64_t)(uintptr_t)m, N, KVW_MEM_VRAM, 0, &r2) == KVW_ERR_TRANSPORT);
        kvw_engine_destroy(te);
        free(m);
    }

    /* engine options: engine keys, backend keys, refusals naming the key */
    KvwEngine *opt = NULL;
    CHECK(kvw_engine_create_with_options("c-opt", "shm", "copy_threads=1, peer_timeout_ms=2000", &opt) == KVW_OK);
    kvw_engine_destroy(opt);
    opt = NULL;
    CHECK(kvw_engine_create_with_options("c-tcp", "tcp", "listen=127.0.0.1:0", &opt) == KVW_OK);
    kvw_engine_destroy(opt);
    opt = NULL;
    CHECK(kvw_engine_create_with_options("c-opt", "shm", NULL, &opt) == KVW_OK);
    kvw_engine_destroy(opt);
    opt = NULL;
    CHECK(kvw_engine_create_with_options("c-bad", "shm", "copy_threads", &opt) == KVW_ERR_INVALID_ARG);
    CHECK(strstr(kvw_last_error(), "copy_threads") != NULL);
    CHECK(kvw_engine_create_with_options("c-bad", "shm", "peer_timeout_ms=-1", &opt) == KVW_ERR_INVALID_ARG);
    CHECK(strstr(kvw_last_error(), "peer_timeout_ms") != NULL);
    CHECK(kvw_engine_create_with_options("c-bad", "shm", "copy_threads=0", &opt) == KVW_ERR_INVALID_ARG);
    CHECK(opt == NULL);

    CHECK(kvw_disconnect(initiator, "c-decode") == KVW_OK);
    CHECK(kvw_disconnect(initiator, "c-decode") == KVW_ERR_NOT_FOUND);
    CHECK(kvw_deregister(target, rdst) == KVW_OK);
    kvw_engine_destroy(initiator);
    kvw_engine_destroy(target);
    kvw_engine_destroy(NULL);
    free(md);
    free(src);
    free(dst);

    printf("%d passed, %d failed\n", passed, failures);
    return failures ? 1 : 0;
}

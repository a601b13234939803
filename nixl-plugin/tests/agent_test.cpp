/*
 * NIXL's C++ agent API (the nixl-cu12==1.5.1 wheel's libnixl.so) driving
 * kvwire's plugin: two agents with backend KVWIRE, register, exchange
 * metadata, WRITE and READ with notifications (bytes checked), genNotif,
 * release of a transfer in flight, refused options, then teardown.
 * Built and run by scripts/nixl-plugin-tests.sh with NIXL_PLUGIN_DIR set.
 *
 * Usage: agent_test TRANSPORT   (shm or tcp)
 */
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "nixl_agent_abi.h"

static int failures = 0, passed = 0;
#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (cond) {                                                                        \
            passed++;                                                                      \
        } else {                                                                           \
            failures++;                                                                    \
            std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
        }                                                                                  \
    } while (0)

static std::vector<uint8_t> pattern(size_t n, unsigned seed) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; i++) v[i] = static_cast<uint8_t>((i * seed + 7) % 251);
    return v;
}

static nixl_reg_dlist_t reg_list(const void *p, size_t len) {
    nixl_reg_dlist_t l(DRAM_SEG);
    nixlBlobDesc d;
    d.addr = reinterpret_cast<uintptr_t>(p);
    d.len = len;
    d.devId = 0;
    l.addDesc(d);
    return l;
}

/* `count` descriptors of `blk` bytes from `p` */
static nixl_xfer_dlist_t xfer_list(const void *p, size_t blk, size_t count) {
    nixl_xfer_dlist_t l(DRAM_SEG);
    for (size_t i = 0; i < count; i++) {
        nixlBasicDesc d;
        d.addr = reinterpret_cast<uintptr_t>(p) + i * blk;
        d.len = blk;
        d.devId = 0;
        l.addDesc(d);
    }
    return l;
}

static nixl_status_t wait_xfer(nixlAgent &a, nixlXferReqH *h) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    nixl_status_t st = NIXL_IN_PROG;
    while (st == NIXL_IN_PROG && std::chrono::steady_clock::now() < deadline) st = a.getXferStatus(h);
    return st;
}

/* Wait for notification `msg` from `from`; every notification seen goes to `seen`. */
static bool wait_notif(nixlAgent &a, const std::string &from, const std::string &msg,
                       std::vector<std::string> &seen, int ms = 20000) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < deadline) {
        nixl_notifs_t n;
        if (a.getNotifs(n) != NIXL_SUCCESS) return false;
        bool found = false;
        for (auto &m : n[from]) {
            seen.push_back(m);
            if (m == msg) found = true;
        }
        if (found) return true;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return false;
}

int main(int argc, char **argv) {
    /* agent_test TRANSPORT [DEVICE_A DEVICE_B]: the devices (verbs, NIXL's
       device_list) of agents a and b, rxe0 and rxe1 in the Soft-RoCE guest */
    const std::string transport = argc > 1 ? argv[1] : "shm";
    const std::string dev_a = argc > 3 ? argv[2] : "", dev_b = argc > 3 ? argv[3] : "";
    const std::string an = "cxx-a-" + transport, bn = "cxx-b-" + transport;
    nixlAgentConfig cfg;
    nixlAgent a(an, cfg), b(bn, cfg);

    std::vector<nixl_backend_t> plugins;
    CHECK(a.getAvailPlugins(plugins) == NIXL_SUCCESS);
    bool listed = false;
    for (auto &p : plugins) listed |= p == "KVWIRE";
    CHECK(listed);

    nixlBackendH *ha = nullptr, *hb = nullptr;
    CHECK(a.createBackend("KVWIRE", {{"kvwire_transport", transport}, {"bogus", "1"}}, ha) == NIXL_ERR_BACKEND);
    nixl_b_params_t pa = {{"kvwire_transport", transport}, {"peer_timeout_ms", "3000"}};
    nixl_b_params_t pb = {{"kvwire_transport", transport}};
    if (!dev_a.empty()) pa["device_list"] = dev_a;
    if (!dev_b.empty()) pb["device_list"] = dev_b;
    CHECK(a.createBackend("KVWIRE", pa, ha) == NIXL_SUCCESS);
    CHECK(b.createBackend("KVWIRE", pb, hb) == NIXL_SUCCESS);
    CHECK(ha != nullptr && hb != nullptr);

    const size_t n = 4 << 20, half = n / 2;
    std::vector<uint8_t> abuf = pattern(n, 31), bbuf(n, 0);
    const std::vector<uint8_t> bsecond = pattern(half, 17);
    std::memcpy(bbuf.data() + half, bsecond.data(), half);
    const nixl_reg_dlist_t areg = reg_list(abuf.data(), n), breg = reg_list(bbuf.data(), n);
    CHECK(a.registerMem(areg) == NIXL_SUCCESS);
    CHECK(b.registerMem(breg) == NIXL_SUCCESS);

    nixl_blob_t amd, bmd;
    CHECK(a.getLocalMD(amd) == NIXL_SUCCESS);
    CHECK(b.getLocalMD(bmd) == NIXL_SUCCESS);
    std::string name;
    CHECK(a.loadRemoteMD(bmd, name) == NIXL_SUCCESS && name == bn);
    CHECK(b.loadRemoteMD(amd, name) == NIXL_SUCCESS && name == an);

    std::vector<std::string> seen;
    /* WRITE a's first half into b's first half, 64 KiB descriptors, with a notification */
    {
        const size_t blk = 64 << 10;
        nixl_opt_args_t opt;
        opt.notif = std::string("write-done");
        nixlXferReqH *h = nullptr;
        CHECK(a.createXferReq(NIXL_WRITE, xfer_list(abuf.data(), blk, half / blk), xfer_list(bbuf.data(), blk, half / blk),
                              bn, h, &opt) == NIXL_SUCCESS);
        const nixl_status_t posted = a.postXferReq(h);
        CHECK(posted == NIXL_IN_PROG || posted == NIXL_SUCCESS);
        CHECK(wait_xfer(a, h) == NIXL_SUCCESS);
        CHECK(wait_notif(b, an, "write-done", seen));
        CHECK(std::memcmp(bbuf.data(), abuf.data(), half) == 0);
        CHECK(a.releaseXferReq(h) == NIXL_SUCCESS);
    }
    /* READ b's second half into a's second half, with a notification */
    {
        std::memset(abuf.data() + half, 0, half);
        nixl_opt_args_t opt;
        opt.notif = std::string("read-done");
        nixlXferReqH *h = nullptr;
        CHECK(a.createXferReq(NIXL_READ, xfer_list(abuf.data() + half, half, 1), xfer_list(bbuf.data() + half, half, 1), bn,
                              h, &opt) == NIXL_SUCCESS);
        const nixl_status_t posted = a.postXferReq(h);
        CHECK(posted == NIXL_IN_PROG || posted == NIXL_SUCCESS);
        CHECK(wait_xfer(a, h) == NIXL_SUCCESS);
        CHECK(std::memcmp(abuf.data() + half, bsecond.data(), half) == 0);
        CHECK(wait_notif(b, an, "read-done", seen));
        CHECK(a.releaseXferReq(h) == NIXL_SUCCESS);
    }
    /* genNotif, both ways */
    CHECK(a.genNotif(bn, "from-a") == NIXL_SUCCESS);
    CHECK(wait_notif(b, an, "from-a", seen));
    CHECK(b.genNotif(an, std::string("from-b\0bin", 10)) == NIXL_SUCCESS);
    CHECK(wait_notif(a, bn, std::string("from-b\0bin", 10), seen));
    CHECK(a.genNotif("nobody", "x") != NIXL_SUCCESS);

    /* Release in flight: a scattered 4 MiB WRITE (4 KiB descriptors) released
       while NIXL still reports it in progress. kvwire cancels it: its
       notification arrives only if the transfer had finished all its data
       first (a release can race the last bytes), and the memory deregisters
       right after. */
    {
        int in_flight_releases = 0;
        for (int round = 0; round < 20 && in_flight_releases == 0; round++) {
            const size_t blk = 4096;
            nixl_opt_args_t opt;
            opt.notif = "cancelled-" + std::to_string(round);
            nixlXferReqH *h = nullptr;
            CHECK(a.createXferReq(NIXL_WRITE, xfer_list(abuf.data(), blk, n / blk), xfer_list(bbuf.data(), blk, n / blk), bn,
                                  h, &opt) == NIXL_SUCCESS);
            a.postXferReq(h);
            if (a.getXferStatus(h) == NIXL_IN_PROG) in_flight_releases++;
            CHECK(a.releaseXferReq(h) == NIXL_SUCCESS);
            if (in_flight_releases) {
                /* a later transfer's notification arrives; the cancelled one never does */
                nixl_opt_args_t after;
                after.notif = std::string("after-cancel");
                nixlXferReqH *h2 = nullptr;
                CHECK(a.createXferReq(NIXL_WRITE, xfer_list(abuf.data(), 4096, 1), xfer_list(bbuf.data(), 4096, 1), bn, h2,
                                      &after) == NIXL_SUCCESS);
                a.postXferReq(h2);
                CHECK(wait_xfer(a, h2) == NIXL_SUCCESS);
                CHECK(a.releaseXferReq(h2) == NIXL_SUCCESS);
                seen.clear();
                CHECK(wait_notif(b, an, "after-cancel", seen));
                /* The release raced the end of the transfer when its
                   notification still arrives: then (and only then) every
                   byte of it must have landed before it. */
                for (auto &m : seen)
                    if (m == opt.notif.value()) CHECK(std::memcmp(abuf.data(), bbuf.data(), n) == 0);
            }
        }
        CHECK(in_flight_releases == 1);
    }

    /* Teardown: a forgets b, b's memory deregisters, a's too. */
    CHECK(a.invalidateRemoteMD(bn) == NIXL_SUCCESS);
    CHECK(b.deregisterMem(breg) == NIXL_SUCCESS);
    CHECK(a.deregisterMem(areg) == NIXL_SUCCESS);

    std::printf("nixl agent test (%s): %d passed, %d failed\n", transport.c_str(), passed, failures);
    return failures ? 1 : 0;
}

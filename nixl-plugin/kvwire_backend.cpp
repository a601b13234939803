/*
 * libplugin_KVWIRE.so: a NIXL backend plugin over kvwire's C ABI
 * (include/kvwire.h). A thin layer: every transfer, registration,
 * metadata and notification call is one kvw_* call; this file only maps
 * NIXL's objects and status codes onto kvwire's. See docs/NIXL.md
 * ("kvwire inside real NIXL") and nixl_abi.h for the ABI it implements.
 *
 * Mapping:
 * - getConnInfo: the kvwire agent metadata taken when the backend is
 *   created (name, transport, connection info; no regions yet).
 * - registerMem + getPublicData: kvw_register, then the agent metadata
 *   taken after it (a full snapshot holding every region registered so
 *   far; kvwire metadata carries a generation).
 * - loadRemoteConnInfo / loadRemoteMD: kvw_metadata_load_as (connect a new
 *   agent, or update a known one with a newer snapshot; bounded decoding
 *   and validation by kvwire, the agent name checked against NIXL's).
 * - prep/post/check/releaseReqH: kvw_post / kvw_status_code / kvw_release
 *   (release of a transfer in flight cancels it and returns once no copy
 *   can touch its buffers).
 * - getNotifs / genNotif: kvw_get_notifs / kvw_notify.
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <mutex>
#include <thread>
#include <set>
#include <string>
#include <vector>

#include "kvwire.h"
#include "nixl_abi.h"

#define KVWIRE_NIXL_PLUGIN_VERSION "0.1.0"

namespace {

void log_error(const std::string &agent, const std::string &what) {
    std::fprintf(stderr, "KVWIRE backend (agent %s): %s\n", agent.c_str(), what.c_str());
}

/* A registration of this agent (NIXL's local metadata, freed by
   deregisterMem). */
struct LocalMD : nixlBackendMD {
    uint64_t reg = 0;
    LocalMD() : nixlBackendMD(true) {}
};

/* loadLocalMD's output: this agent as the target of its own transfers
   (kvwire's loopback). An object of its own, freed by unloadMD: NIXL's
   agent destructor unloads it after the local registration is gone. */
struct SelfMD : nixlBackendMD {
    SelfMD() : nixlBackendMD(false) {}
};

/* A region of a remote agent (kvwire validates addresses against the
   regions it loaded, so only the agent's name is kept). */
struct RemoteMD : nixlBackendMD {
    std::string agent;
    explicit RemoteMD(std::string a) : nixlBackendMD(false), agent(std::move(a)) {}
};

struct ReqH : nixlBackendReqH {
    int32_t op = KVW_OP_WRITE;
    std::string agent;
    std::vector<KvwDesc> local, remote;
    uint64_t handle = 0;
    bool posted = false;
};

nixl_status_t status_of_failure(KvwStatus code) {
    switch (code) {
    case KVW_ERR_PEER_DIED:
    case KVW_ERR_PEER_TIMEOUT:
        return NIXL_ERR_REMOTE_DISCONNECT;
    case KVW_ERR_CANCELLED:
        return NIXL_ERR_CANCELED;
    case KVW_ERR_REMOTE_ACCESS:
        return NIXL_ERR_INVALID_PARAM;
    default:
        return NIXL_ERR_BACKEND;
    }
}

class KvwireEngine : public nixlBackendEngine {
public:
    explicit KvwireEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init) {
        std::string transport, options, why;
        if (!parse(*init->customParams, transport, options, why)) {
            log_error(localAgent, why);
            initErr = true;
            return;
        }
        KvwStatus rc;
        if (transport == "auto") {
            /* verbs where an RDMA device opens, else tcp (both reach other hosts). */
            rc = kvw_engine_create_with_options(localAgent.c_str(), "verbs", options.c_str(), &engine_);
            if (rc != KVW_OK && options == tcpOptions_) { /* no device asked for: fall back */
                transport = "tcp";
                rc = kvw_engine_create_with_options(localAgent.c_str(), "tcp", tcpOptions_.c_str(), &engine_);
            } else if (rc == KVW_OK) {
                transport = "verbs";
            }
        } else {
            rc = kvw_engine_create_with_options(localAgent.c_str(), transport.c_str(), options.c_str(), &engine_);
        }
        if (rc != KVW_OK) {
            log_error(localAgent, "cannot create the kvwire " + transport + " engine: " + kvw_last_error());
            engine_ = nullptr;
            initErr = true;
            return;
        }
        transport_ = transport;
        size_t len = 0;
        if (!metadata(connInfo_, len)) {
            log_error(localAgent, std::string("cannot take kvwire metadata: ") + kvw_last_error());
            initErr = true;
        }
    }

    ~KvwireEngine() override { kvw_engine_destroy(engine_); }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    /* GPU memory only where the NIC reaches it: shm and tcp copy with the CPU. */
    nixl_mem_list_t getSupportedMems() const override {
        if (transport_ == "verbs") return {DRAM_SEG, VRAM_SEG};
        return {DRAM_SEG};
    }

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) override {
        if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) {
            log_error(localAgent, "only DRAM_SEG and VRAM_SEG memory can be registered");
            return NIXL_ERR_NOT_SUPPORTED;
        }
        std::lock_guard<std::mutex> g(mu_);
        auto *md = new LocalMD();
        const KvwStatus rc = kvw_register_mem(engine_, mem.addr, mem.len, nixl_mem == VRAM_SEG ? KVW_MEM_VRAM : KVW_MEM_DRAM,
                                              static_cast<uint32_t>(mem.devId), &md->reg);
        if (rc != KVW_OK) {
            log_error(localAgent, std::string("registerMem: ") + kvw_last_error());
            delete md;
            if (rc == KVW_ERR_BAD_DESC) return NIXL_ERR_INVALID_PARAM;
            return nixl_mem == VRAM_SEG ? NIXL_ERR_NOT_SUPPORTED : NIXL_ERR_BACKEND;
        }
        out = md;
        return NIXL_SUCCESS;
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        auto *md = dynamic_cast<LocalMD *>(meta);
        if (!md) return NIXL_ERR_INVALID_PARAM;
        std::lock_guard<std::mutex> g(mu_);
        const KvwStatus rc = kvw_deregister(engine_, md->reg);
        if (rc != KVW_OK) {
            log_error(localAgent, std::string("deregisterMem: ") + kvw_last_error());
            return rc == KVW_ERR_IN_USE ? NIXL_ERR_NOT_ALLOWED : NIXL_ERR_BACKEND;
        }
        delete md;
        return NIXL_SUCCESS;
    }

    nixl_status_t connect(const std::string &remote_agent) override {
        if (remote_agent == localAgent) return NIXL_SUCCESS; /* kvwire's loopback */
        std::lock_guard<std::mutex> g(mu_);
        if (known_.count(remote_agent)) return NIXL_SUCCESS; /* kvwire connects when it loads metadata */
        return NIXL_ERR_NOT_FOUND;
    }

    nixl_status_t disconnect(const std::string &remote_agent) override {
        if (remote_agent == localAgent) return NIXL_SUCCESS;
        std::lock_guard<std::mutex> g(mu_);
        const bool known = known_.erase(remote_agent) + dead_.erase(remote_agent) > 0;
        const KvwStatus rc = kvw_disconnect(engine_, remote_agent.c_str());
        if (rc == KVW_OK) return NIXL_SUCCESS;
        /* kvwire already dropped a peer it found dead */
        return known ? NIXL_SUCCESS : NIXL_ERR_NOT_FOUND;
    }

    /* Only ever given what loadRemoteMD / loadLocalMD made. */
    nixl_status_t unloadMD(nixlBackendMD *input) override {
        delete input;
        return NIXL_SUCCESS;
    }

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override {
        if (!dynamic_cast<const LocalMD *>(meta)) return NIXL_ERR_INVALID_PARAM;
        std::lock_guard<std::mutex> g(mu_);
        size_t len = 0;
        return metadata(str, len) ? NIXL_SUCCESS : NIXL_ERR_BACKEND;
    }

    nixl_status_t getConnInfo(std::string &str) const override {
        str = connInfo_;
        return NIXL_SUCCESS;
    }

    nixl_status_t loadRemoteConnInfo(const std::string &remote_agent, const std::string &info) override {
        std::lock_guard<std::mutex> g(mu_);
        return load(remote_agent, info);
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &nixl_mem, const std::string &remote_agent,
                               nixlBackendMD *&output) override {
        if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
        std::lock_guard<std::mutex> g(mu_);
        const nixl_status_t st = load(remote_agent, input.metaInfo);
        if (st != NIXL_SUCCESS) return st;
        output = new RemoteMD(remote_agent);
        return NIXL_SUCCESS;
    }

    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override {
        if (!dynamic_cast<LocalMD *>(input)) return NIXL_ERR_INVALID_PARAM;
        output = new SelfMD();
        return NIXL_SUCCESS;
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent, nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *) const override {
        if (operation != NIXL_READ && operation != NIXL_WRITE) return NIXL_ERR_INVALID_PARAM;
        auto mem_ok = [](nixl_mem_t m) { return m == DRAM_SEG || m == VRAM_SEG; };
        if (!mem_ok(local.getType()) || !mem_ok(remote.getType())) return NIXL_ERR_NOT_SUPPORTED;
        if (local.descCount() != remote.descCount() || local.descCount() == 0) return NIXL_ERR_INVALID_PARAM;
        {
            /* A peer found dead stays loaded until NIXL disconnects it (as UCX
               behaves in NIXL 1.5.1): preparing against it works, posting fails. */
            std::lock_guard<std::mutex> g(mu_);
            if (remote_agent != localAgent && !known_.count(remote_agent) && !dead_.count(remote_agent)) {
                return NIXL_ERR_NOT_FOUND;
            }
        }
        auto *req = new ReqH();
        req->op = operation == NIXL_READ ? KVW_OP_READ : KVW_OP_WRITE;
        req->agent = remote_agent;
        const size_t n = local.descCount();
        req->local.resize(n);
        req->remote.resize(n);
        for (size_t i = 0; i < n; i++) {
            req->local[i] = KvwDesc{local[i].addr, local[i].len};
            req->remote[i] = KvwDesc{remote[i].addr, remote[i].len};
        }
        handle = req;
        return NIXL_SUCCESS;
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &, const nixl_meta_dlist_t &,
                           const std::string &, nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt_args) const override {
        auto *req = dynamic_cast<ReqH *>(handle);
        if (!req) return NIXL_ERR_INVALID_PARAM;
        const bool notif = opt_args && opt_args->hasNotif;
        std::lock_guard<std::mutex> g(mu_);
        if (dead_.count(req->agent)) return NIXL_ERR_REMOTE_DISCONNECT;
        if (req->posted) {
            KvwXferState st = KVW_XFER_IN_PROGRESS;
            KvwStatus code = KVW_OK;
            if (kvw_status_code(engine_, req->handle, &st, &code) == KVW_OK && st == KVW_XFER_IN_PROGRESS) {
                return NIXL_ERR_REPOST_ACTIVE;
            }
            kvw_release(engine_, req->handle);
            req->posted = false;
        }
        const KvwStatus rc = kvw_post(engine_, req->op, req->local.data(), req->local.size(), req->agent.c_str(),
                                      req->remote.data(), req->remote.size(),
                                      notif ? reinterpret_cast<const uint8_t *>(opt_args->notifMsg.data()) : nullptr,
                                      notif ? opt_args->notifMsg.size() : 0, &req->handle);
        if (rc != KVW_OK) {
            log_error(localAgent, std::string("postXfer to ") + req->agent + ": " + kvw_last_error());
            switch (rc) {
            case KVW_ERR_BAD_DESC:
                return NIXL_ERR_INVALID_PARAM;
            case KVW_ERR_NOT_FOUND:
            case KVW_ERR_TRANSPORT:
            case KVW_ERR_PEER_DIED:
            case KVW_ERR_PEER_TIMEOUT:
                /* kvwire drops a peer it finds dead; one NIXL loaded is a disconnect */
                if (known_.count(req->agent) || dead_.count(req->agent)) {
                    markDead(req->agent);
                    return NIXL_ERR_REMOTE_DISCONNECT;
                }
                return rc == KVW_ERR_NOT_FOUND ? NIXL_ERR_NOT_FOUND : NIXL_ERR_BACKEND;
            default:
                return NIXL_ERR_BACKEND;
            }
        }
        req->posted = true;
        return NIXL_IN_PROG;
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        auto *req = dynamic_cast<ReqH *>(handle);
        if (!req) return NIXL_ERR_INVALID_PARAM;
        if (!req->posted) return NIXL_ERR_NOT_POSTED;
        KvwXferState st = KVW_XFER_IN_PROGRESS;
        KvwStatus code = KVW_OK;
        {
            std::lock_guard<std::mutex> g(mu_);
            if (kvw_status_code(engine_, req->handle, &st, &code) != KVW_OK) return NIXL_ERR_BACKEND;
        }
        if (st == KVW_XFER_IN_PROGRESS) {
            /* NIXL's users poll checkXfer back to back (UCX progresses inside
               it); kvwire copies on its own threads, which such a loop starves
               where cores are few. After kSpinPolls in-progress answers in a
               row, give the core away once per call, as kvwire's `nixl`
               package does (python/src/nixl.rs, SPIN_POLLS). */
            if (busyPolls_.fetch_add(1, std::memory_order_relaxed) >= kSpinPolls) std::this_thread::yield();
            return NIXL_IN_PROG;
        }
        busyPolls_.store(0, std::memory_order_relaxed);
        std::lock_guard<std::mutex> g(mu_);
        switch (st) {
        case KVW_XFER_DONE:
            return NIXL_SUCCESS;
        default:
            log_error(localAgent, std::string("transfer to ") + req->agent + " failed: " + kvw_last_error());
            if (code == KVW_ERR_PEER_DIED || code == KVW_ERR_PEER_TIMEOUT) markDead(req->agent);
            return status_of_failure(code);
        }
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        auto *req = dynamic_cast<ReqH *>(handle);
        if (!req) return NIXL_ERR_INVALID_PARAM;
        nixl_status_t st = NIXL_SUCCESS;
        if (req->posted) {
            std::lock_guard<std::mutex> g(mu_);
            /* cancels a transfer in flight; returns once no copy touches its buffers */
            if (kvw_release(engine_, req->handle) != KVW_OK) st = NIXL_ERR_BACKEND;
        }
        delete req;
        return st;
    }

    nixl_status_t getNotifs(notif_list_t &notif_list) override {
        std::lock_guard<std::mutex> g(mu_);
        const KvwStatus rc = kvw_get_notifs(
            engine_,
            [](void *user, const char *agent, const uint8_t *msg, size_t len) {
                static_cast<notif_list_t *>(user)->emplace_back(std::string(agent),
                                                                std::string(reinterpret_cast<const char *>(msg), len));
            },
            &notif_list, nullptr);
        return rc == KVW_OK ? NIXL_SUCCESS : NIXL_ERR_BACKEND;
    }

    nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const override {
        std::lock_guard<std::mutex> g(mu_);
        if (dead_.count(remote_agent)) return NIXL_ERR_REMOTE_DISCONNECT;
        const KvwStatus rc = kvw_notify(engine_, remote_agent.c_str(), reinterpret_cast<const uint8_t *>(msg.data()),
                                        msg.size());
        if (rc == KVW_OK) return NIXL_SUCCESS;
        log_error(localAgent, std::string("genNotif to ") + remote_agent + ": " + kvw_last_error());
        if (rc == KVW_ERR_NOT_FOUND || rc == KVW_ERR_TRANSPORT) {
            if (known_.count(remote_agent) || dead_.count(remote_agent)) {
                markDead(remote_agent);
                return NIXL_ERR_REMOTE_DISCONNECT;
            }
            return rc == KVW_ERR_NOT_FOUND ? NIXL_ERR_NOT_FOUND : NIXL_ERR_BACKEND;
        }
        return NIXL_ERR_BACKEND;
    }

private:
    /* Turn NIXL's backend parameters into a kvwire transport and option
       string; false (with `why`) on an unknown key or a bad value. */
    bool parse(const nixl_b_params_t &params, std::string &transport, std::string &options, std::string &why) {
        const char *env = std::getenv("KVWIRE_TRANSPORT"); /* as kvwire's `nixl` package reads it */
        transport = env && *env ? env : "auto";
        std::string devices, threads, timeout, extra;
        for (const auto &[k, v] : params) {
            if (k == "kvwire_transport") {
                if (!v.empty()) transport = v;
            } else if (k == "device_list") {
                devices = v;
            } else if (k == "num_threads") {
                threads = v;
            } else if (k == "peer_timeout_ms") {
                timeout = v;
            } else if (k == "kvwire_options") {
                if (!v.empty()) extra += (extra.empty() ? "" : ",") + v;
            } else if (k.rfind("kvwire.", 0) == 0 && k.size() > 7) {
                /* kvwire.<key>=<value>: one kvwire transport option, as in kvwire's `nixl` package */
                extra += (extra.empty() ? "" : ",") + k.substr(7) + "=" + v;
            } else {
                why = "unknown backend parameter '" + k + "' (valid: kvwire_transport, device_list, num_threads, "
                      "peer_timeout_ms, kvwire_options, kvwire.<option>)";
                return false;
            }
        }
        if (transport != "shm" && transport != "tcp" && transport != "verbs" && transport != "auto") {
            why = "kvwire_transport='" + transport + "': expected shm, tcp, verbs or auto";
            return false;
        }
        std::string common;
        auto add = [](std::string &s, const std::string &kv) { s += (s.empty() ? "" : ",") + kv; };
        if (!threads.empty() && threads != "0") {
            if (threads.find_first_not_of("0123456789") != std::string::npos) {
                why = "num_threads='" + threads + "': expected a number";
                return false;
            }
            add(common, "copy_threads=" + threads);
        }
        if (!timeout.empty()) {
            if (timeout.find_first_not_of("0123456789") != std::string::npos) {
                why = "peer_timeout_ms='" + timeout + "': expected a number of milliseconds";
                return false;
            }
            add(common, "peer_timeout_ms=" + timeout);
        }
        std::string device;
        if (!devices.empty()) {
            if (transport == "shm" || transport == "tcp") {
                why = "device_list applies to kvwire_transport=verbs (or auto); this backend is " + transport;
                return false;
            }
            if (devices.find(',') != std::string::npos) {
                why = "device_list='" + devices + "': kvwire drives one RDMA device per agent; name one";
                return false;
            }
            device = devices.substr(0, devices.find(':')); /* UCX style "mlx5_0:1" */
        }
        if (!extra.empty()) add(common, extra);
        tcpOptions_ = common;
        options = common;
        if (!device.empty()) add(options, "device=" + device);
        return true;
    }

    bool metadata(std::string &out, size_t &len) const {
        len = 0;
        if (kvw_metadata_get(engine_, nullptr, 0, &len) != KVW_ERR_BUFFER_TOO_SMALL) return false;
        out.assign(len, '\0');
        return kvw_metadata_get(engine_, reinterpret_cast<uint8_t *>(out.data()), out.size(), &len) == KVW_OK;
    }

    /* with mu_ held */
    nixl_status_t load(const std::string &agent, const std::string &md) {
        if (agent == localAgent) return NIXL_ERR_INVALID_PARAM;
        int32_t outcome = 0;
        const KvwStatus rc = kvw_metadata_load_as(engine_, agent.c_str(), reinterpret_cast<const uint8_t *>(md.data()),
                                                  md.size(), &outcome);
        if (rc != KVW_OK) {
            log_error(localAgent, "loading metadata of " + agent + ": " + kvw_last_error());
            switch (rc) {
            case KVW_ERR_METADATA:
            case KVW_ERR_INVALID_ARG:
                return NIXL_ERR_MISMATCH;
            case KVW_ERR_STATE:
                return NIXL_ERR_NOT_ALLOWED;
            default:
                return NIXL_ERR_BACKEND;
            }
        }
        known_.insert(agent);
        dead_.erase(agent);
        return NIXL_SUCCESS;
    }

    /* with mu_ held */
    void markDead(const std::string &agent) const {
        known_.erase(agent);
        dead_.insert(agent);
    }

    KvwEngine *engine_ = nullptr;
    std::string transport_, connInfo_, tcpOptions_;
    mutable std::mutex mu_;
    /* in-progress answers of checkXfer in a row (see checkXfer) */
    mutable std::atomic<unsigned> busyPolls_{0};
    static constexpr unsigned kSpinPolls = 16;
    mutable std::set<std::string> known_, dead_;
};

nixlBackendEngine *create_engine(const nixlBackendInitParams *init) {
    try {
        return new KvwireEngine(init);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "KVWIRE backend: creation failed: %s\n", e.what());
        return nullptr;
    }
}

void destroy_engine(nixlBackendEngine *engine) { delete engine; }

const char *plugin_name() { return "KVWIRE"; }
const char *plugin_version() { return KVWIRE_NIXL_PLUGIN_VERSION; }

nixl_b_params_t backend_options() {
    return {{"kvwire_transport", ""}, {"device_list", ""}, {"num_threads", "0"}, {"peer_timeout_ms", ""},
            {"kvwire_options", ""}};
}

/* VRAM_SEG with kvwire_transport=verbs (or auto picking verbs) only: each
   engine's getSupportedMems says what it takes. */
nixl_mem_list_t backend_mems() { return {DRAM_SEG, VRAM_SEG}; }

nixlBackendPlugin plugin = {NIXL_PLUGIN_API_VERSION, create_engine, destroy_engine, plugin_name,
                            plugin_version,          backend_options, backend_mems};

} // namespace

extern "C" {
nixlBackendPlugin *nixl_plugin_init() { return &plugin; }
void nixl_plugin_fini() {}
}

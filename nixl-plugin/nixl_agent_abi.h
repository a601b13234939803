/*
 * kvwire's own declaration of the part of NIXL 1.5.1's C++ agent API that
 * nixl-plugin/tests/agent_test.cpp calls (the `nixl-cu12==1.5.1` wheel's
 * libnixl.so and libnixl_build.so export these symbols). Mirrors, by hand:
 *   src/api/cpp/nixl_params.h  (nixlAgentConfig)
 *   src/api/cpp/nixl.h         (nixlAgent: the methods below, same
 *                               signatures, so the same mangled names)
 *   src/api/cpp/nixl_descriptors.h via nixl_abi.h (nixlDescList's
 *                               constructor and addDesc, from libnixl_build.so)
 * of github.com/ai-dynamo/nixl. Only what the test uses is declared.
 */
#ifndef KVWIRE_NIXL_AGENT_ABI_H
#define KVWIRE_NIXL_AGENT_ABI_H

#include <chrono>
#include <memory>

#include "nixl_abi.h"

class nixlAgentData;
class nixlXferReqH;

/* ---- src/api/cpp/nixl_params.h (NIXL 1.5.1) ---- */
struct nixlAgentConfig {
    bool useProgThread = false;
    bool useListenThread = false;
    uint16_t listenPort = default_comm_port;
    nixl_thread_sync_t syncMode = nixl_thread_sync_t::NIXL_THREAD_SYNC_DEFAULT;
    bool captureTelemetry = false;
    uint64_t pthrDelay = 0;
    uint64_t lthrDelay = 100000;
    std::chrono::microseconds etcdWatchTimeout = std::chrono::microseconds(5000000);
};
static_assert(sizeof(nixlAgentConfig) == 40, "nixlAgentConfig layout");

/* ---- src/api/cpp/nixl.h (NIXL 1.5.1) ---- */
class nixlAgent {
private:
    const std::unique_ptr<nixlAgentData> data;

public:
    nixlAgent(const std::string &name, const nixlAgentConfig &cfg);
    ~nixlAgent();
    nixlAgent(nixlAgent &&) noexcept = delete;
    nixlAgent &operator=(nixlAgent &&) noexcept = delete;

    nixl_status_t getAvailPlugins(std::vector<nixl_backend_t> &plugins);
    nixl_status_t createBackend(const nixl_backend_t &type, const nixl_b_params_t &params, nixlBackendH *&backend);
    nixl_status_t registerMem(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t deregisterMem(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t createXferReq(const nixl_xfer_op_t &operation, const nixl_xfer_dlist_t &local_descs,
                                const nixl_xfer_dlist_t &remote_descs, const std::string &remote_agent,
                                nixlXferReqH *&req_hndl, const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t postXferReq(nixlXferReqH *req_hndl, const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t getXferStatus(nixlXferReqH *req_hndl) const;
    nixl_status_t releaseXferReq(nixlXferReqH *req_hndl) const;
    nixl_status_t getNotifs(nixl_notifs_t &notif_map, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t genNotif(const std::string &remote_agent, const nixl_blob_t &msg,
                           const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t getLocalMD(nixl_blob_t &str) const;
    nixl_status_t loadRemoteMD(const nixl_blob_t &remote_metadata, std::string &agent_name);
    nixl_status_t invalidateRemoteMD(const std::string &remote_agent);
};

#endif /* KVWIRE_NIXL_AGENT_ABI_H */

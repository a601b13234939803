/*
 * kvwire's own declaration of the subset of NIXL's C++ backend-plugin ABI
 * that libplugin_KVWIRE.so implements (as src/verbs/ffi.rs mirrors
 * libibverbs). NIXL's headers are not on any registry this project builds
 * from, so every declaration below restates, by hand, the class layout,
 * virtual-method order and enum values of NIXL 1.5.1 (the `nixl-cu12==1.5.1`
 * wheel's libnixl.so, C++20, libstdc++ with the C++11 string ABI). Each
 * block names the public NIXL file (github.com/ai-dynamo/nixl) it mirrors.
 *
 * How it was checked against the binary (scripts/nixl-plugin-build.sh
 * repeats the vtable check on every build): the wheel's in-tree plugins
 * (.nixl_cu12.mesonpy.libs/plugins/libplugin_POSIX.so, libplugin_UCX.so)
 * carry `vtable for nixlBackendEngine` of 232 bytes (offset-to-top,
 * typeinfo, 27 slots) whose relocations name the methods in exactly the
 * order declared below; their nixl_plugin_init stores api_version 1; the
 * POSIX engine's constructor reads nixlBackendInitParams::type at +0x20
 * and ::customParams at +0x40 and writes the base members at the offsets
 * the static_asserts below pin (customParams +0x28, telemetry vector +0x60,
 * localAgent +0xa8).
 *
 * Only layout matters: nothing here calls into libnixl.so, so the plugin
 * links against nothing of NIXL's.
 */
#ifndef KVWIRE_NIXL_ABI_H
#define KVWIRE_NIXL_ABI_H

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(_GLIBCXX_USE_CXX11_ABI) || !_GLIBCXX_USE_CXX11_ABI
#error "NIXL 1.5.1's libnixl.so uses libstdc++'s C++11 ABI (std::__cxx11::basic_string)"
#endif

/* ---- src/api/cpp/nixl_types.h (NIXL 1.5.1) ---- */

class nixlBackendH;

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };

enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };

enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12
};

enum class nixl_thread_sync_t {
    NIXL_THREAD_SYNC_NONE,
    NIXL_THREAD_SYNC_STRICT,
    NIXL_THREAD_SYNC_RW,
    NIXL_THREAD_SYNC_DEFAULT = NIXL_THREAD_SYNC_NONE,
};

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_notifs_t = std::unordered_map<std::string, std::vector<nixl_blob_t>>;

inline constexpr uint16_t default_comm_port = 8888;

enum class nixl_cost_t {
    ANALYTICAL_BACKEND = 0,
};

using nixl_query_resp_t = std::optional<nixl_b_params_t>;

struct nixlAgentOptionalArgs {
    std::vector<nixlBackendH *> backends;
    std::optional<nixl_blob_t> notif;
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    bool skipDescMerge = false;
    bool includeConnInfo = false;
    std::string ipAddr;
    int port = default_comm_port;
    std::string metadataLabel;
    nixl_blob_t customParam;
};
using nixl_opt_args_t = nixlAgentOptionalArgs;

using nixlMemViewH = void *;

/* ---- src/api/cpp/nixl_descriptors.h (NIXL 1.5.1) ---- */

class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;

    nixlBasicDesc() {}
};

class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;
};

/* The descriptor list: a vtable (virtual ~, resize, addDesc, getIndex,
   defined in libnixl.so), the memory type, then the std::vector. Only the
   inline read accessors are declared; the plugin never builds one. */
template <class T> class nixlDescList {
protected:
    nixl_mem_t type;
    std::vector<T> descs;

public:
    nixlDescList(const nixl_mem_t &type, const int &init_size = 0);
    virtual ~nixlDescList() = default;

    inline nixl_mem_t getType() const { return type; }
    inline int descCount() const { return descs.size(); }
    bool isEmpty() const noexcept { return descs.empty(); }
    const T &operator[](size_t index) const { return descs[index]; }
    inline typename std::vector<T>::const_iterator begin() const { return descs.begin(); }
    inline typename std::vector<T>::const_iterator end() const { return descs.end(); }

    virtual void resize(const size_t &count);
    virtual void addDesc(const T &desc);
    virtual int getIndex(const nixlBasicDesc &query) const;
};

using nixl_xfer_dlist_t = nixlDescList<nixlBasicDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;

/* ---- src/core/telemetry/telemetry_event.h (NIXL 1.5.1; a member type of
   nixlBackendEngine, so part of its layout) ---- */

enum class nixl_telemetry_event_type_t : uint32_t {};

struct nixlTelemetryEvent {
    nixl_telemetry_event_type_t eventType_;
    uint64_t value_;
};

/* ---- src/api/cpp/backend/backend_aux.h (NIXL 1.5.1) ---- */

typedef std::vector<std::pair<std::string, std::string>> notif_list_t;

struct nixlBackendOptionalArgs {
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

class nixlBackendInitParams {
public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0; /* nixlTime::us_t (src/utils/common/nixl_time.h) */
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_ = false;
};

class nixlBackendReqH {
public:
    nixlBackendReqH() {}
    virtual ~nixlBackendReqH() {}
};

class nixlBackendMD {
protected:
    bool isPrivateMD;

public:
    nixlBackendMD(bool isPrivate) { isPrivateMD = isPrivate; }
    virtual ~nixlBackendMD() {}
};

class nixlMetaDesc : public nixlBasicDesc {
public:
    nixlBackendMD *metadataP;
};

struct nixlRemoteMetaDesc : public nixlMetaDesc {
    std::string remoteAgent;
};

typedef nixlDescList<nixlMetaDesc> nixl_meta_dlist_t;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;

/* ---- src/api/cpp/backend/backend_engine.h (NIXL 1.5.1) ----
   Virtual methods in NIXL's declaration order: the vtable slots. */

class nixlBackendEngine {
private:
    nixl_backend_t backendType;
    nixl_b_params_t customParams;
    std::vector<nixlTelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;

public:
    explicit nixlBackendEngine(const nixlBackendInitParams *init_params)
        : backendType(init_params->type),
          customParams(*init_params->customParams),
          localAgent(init_params->localAgent),
          enableTelemetry_(init_params->enableTelemetry_) {}

    nixlBackendEngine(nixlBackendEngine &&) = delete;
    nixlBackendEngine(const nixlBackendEngine &) = delete;
    void operator=(nixlBackendEngine &&) = delete;
    void operator=(const nixlBackendEngine &) = delete;

    /* slots 0, 1 */
    virtual ~nixlBackendEngine() = default;

    bool getInitErr() const noexcept { return initErr; }
    const nixl_backend_t &getType() const noexcept { return backendType; }
    const nixl_b_params_t &getCustomParams() const noexcept { return customParams; }

    /* slots 2..5 */
    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual nixl_mem_list_t getSupportedMems() const = 0;

    /* slots 6..14 */
    virtual nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) = 0;
    virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;

    /* slots 15..17 */
    virtual nixl_status_t prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                      const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &,
                                      const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(nixlMemViewH) const {}

    /* slots 18..21 */
    virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &, const std::string &,
                                       nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }

    /* slot 22 */
    virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) { return NIXL_ERR_BACKEND; }

    /* slots 23, 24 */
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const { return NIXL_ERR_BACKEND; }

    /* slots 25, 26 */
    virtual nixl_status_t queryMem(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                                           const nixl_meta_dlist_t &, const std::string &,
                                           nixlBackendReqH *const &, std::chrono::microseconds &,
                                           std::chrono::microseconds &, nixl_cost_t &,
                                           const nixl_opt_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

/* ---- src/api/cpp/backend/backend_plugin.h (NIXL 1.5.1) ---- */

#define NIXL_PLUGIN_API_VERSION 1

class nixlBackendPlugin {
public:
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

extern "C" {
__attribute__((visibility("default"))) nixlBackendPlugin *nixl_plugin_init();
__attribute__((visibility("default"))) void nixl_plugin_fini();
}

/* ---- layout pins: the offsets read from the 1.5.1 binaries (see top) ---- */
static_assert(sizeof(nixlBackendInitParams) == 96, "nixlBackendInitParams layout");
static_assert(sizeof(nixlBackendEngine) == 208, "nixlBackendEngine layout");
static_assert(sizeof(nixlBasicDesc) == 24, "nixlBasicDesc layout");
static_assert(sizeof(nixlBlobDesc) == 56, "nixlBlobDesc layout");
static_assert(sizeof(nixlMetaDesc) == 32, "nixlMetaDesc layout");
static_assert(sizeof(nixlDescList<nixlMetaDesc>) == 40, "nixlDescList layout");
static_assert(sizeof(nixlBackendOptionalArgs) == 72, "nixlBackendOptionalArgs layout");
static_assert(sizeof(nixlBackendPlugin) == 56, "nixlBackendPlugin layout");

#endif /* KVWIRE_NIXL_ABI_H */

/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1, for tests on machines without a GPU.
 *
 * It exports the NVML entry points the node agent reaches through the official `pynvml` binding
 * (nvidia-ml-py 13.615.71), with the exact argument and struct layouts that binding passes, and
 * serves scripted per-device values. A control API (functions prefixed `standin_`) lets a test
 * set values, make values ramp from read to read, inject NVML error codes per function and device,
 * lose a GPU, add processes, count calls, and delay calls (a slow driver call). tests/node/nvml_stand_in.py wraps it for Python.
 *
 * Build: cc -shared -fPIC -O2 -Wall -Werror -Wl,-soname,libnvidia-ml.so.1 -pthread \
 *            -o DIR/libnvidia-ml.so.1 fake_nvml.c
 *
 * Behaviour that follows real NVML: every function but nvmlErrorString and nvmlGpmSampleFree
 * returns NVML_ERROR_UNINITIALIZED before nvmlInit (init is reference-counted, nvmlShutdown
 * decrements); handles are pointers that stay valid for the life of the process; the two-call
 * buffer protocols answer NVML_ERROR_INSUFFICIENT_SIZE with the needed count; process
 * utilisation answers NVML_ERROR_NOT_FOUND when no sample is newer than the timestamp given.
 *
 * Precedence of failures in a per-device call: uninitialised, global injected error (device -1),
 * invalid handle, lost GPU, injected error for that device, invalid argument.
 *
 * One mutex guards all state: a sampler thread and a test thread may call concurrently.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- NVML types, laid out as pynvml 13.615.71 declares them ---------------------------- */

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

/* Opaque to callers; a handle is the address of one of the static entries below. */
struct nvmlDevice_st {
    unsigned int index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

struct nvmlGpmSample_st {
    unsigned int magic;
    int taken;
    unsigned int device;
    unsigned long long time_ns;
};
typedef struct nvmlGpmSample_st *nvmlGpmSample_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* nvmlMemory_v2 = sizeof(nvmlMemory_v2_t) | 2 << 24 */
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* c_nvmlProcessInfo_v3_t is c_nvmlProcessInfo_v2_t in pynvml. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

#define NVML_GPM_SUPPORT_VERSION 1u
#define NVML_GPM_METRICS_GET_VERSION 1u
/* pynvml's NVML_GPM_METRIC_MAX: the length of the metrics array in its c_nvmlGpmMetricsGet_t. */
#define STANDIN_GPM_METRIC_MAX 477u
#define NVML_GPM_METRIC_DRAM_BW_UTIL 10u

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct {
        char *shortName;
        char *longName;
        char *unit;
    } metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[STANDIN_GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;

#define NVML_CLOCK_GRAPHICS 0u
#define NVML_CLOCK_SM 1u
#define NVML_CLOCK_MEM 2u
#define NVML_CLOCK_VIDEO 3u
#define NVML_TEMPERATURE_GPU 0u
#define NVML_PCIE_UTIL_TX_BYTES 0u
#define NVML_PCIE_UTIL_RX_BYTES 1u
/* Reported for the MIG instance ids of a process when MIG is off. */
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

/* ---- Stand-in state ------------------------------------------------------------------- */

#define STANDIN_MAX_DEVICES 16
#define STANDIN_MAX_PROCESSES 64
#define STANDIN_DEFAULT_DEVICE_COUNT 2
#define STANDIN_DEVICE_COUNT_ENV "NVML_STAND_IN_DEVICE_COUNT"
#define STANDIN_GPM_SAMPLE_MAGIC 0x47504d53u
#define STANDIN_DRIVER_VERSION "570.124.06"
#define STANDIN_DEVICE_NAME "Stand-in H100"
#define GIB (1024.0 * 1024.0 * 1024.0)

/* Every NVML entry point, so that errors can be injected into and calls counted for each. */
#define STANDIN_FUNCTIONS(X)                                   \
    X(FN_INIT_WITH_FLAGS, "nvmlInitWithFlags")                 \
    X(FN_INIT_V2, "nvmlInit_v2")                               \
    X(FN_SHUTDOWN, "nvmlShutdown")                             \
    X(FN_ERROR_STRING, "nvmlErrorString")                      \
    X(FN_DRIVER_VERSION, "nvmlSystemGetDriverVersion")         \
    X(FN_COUNT_V2, "nvmlDeviceGetCount_v2")                    \
    X(FN_HANDLE_BY_INDEX, "nvmlDeviceGetHandleByIndex_v2")     \
    X(FN_HANDLE_BY_UUID, "nvmlDeviceGetHandleByUUID")          \
    X(FN_UUID, "nvmlDeviceGetUUID")                            \
    X(FN_NAME, "nvmlDeviceGetName")                            \
    X(FN_INDEX, "nvmlDeviceGetIndex")                          \
    X(FN_UTILIZATION, "nvmlDeviceGetUtilizationRates")         \
    X(FN_MEMORY, "nvmlDeviceGetMemoryInfo")                    \
    X(FN_MEMORY_V2, "nvmlDeviceGetMemoryInfo_v2")              \
    X(FN_POWER, "nvmlDeviceGetPowerUsage")                     \
    X(FN_CLOCK, "nvmlDeviceGetClockInfo")                      \
    X(FN_MAX_CLOCK, "nvmlDeviceGetMaxClockInfo")               \
    X(FN_BUS_WIDTH, "nvmlDeviceGetMemoryBusWidth")             \
    X(FN_TEMPERATURE, "nvmlDeviceGetTemperature")              \
    X(FN_PCIE, "nvmlDeviceGetPcieThroughput")                  \
    X(FN_PROCESSES, "nvmlDeviceGetComputeRunningProcesses_v3") \
    X(FN_PROCESS_UTIL, "nvmlDeviceGetProcessUtilization")      \
    X(FN_GPM_SUPPORT, "nvmlGpmQueryDeviceSupport")             \
    X(FN_GPM_ALLOC, "nvmlGpmSampleAlloc")                      \
    X(FN_GPM_FREE, "nvmlGpmSampleFree")                        \
    X(FN_GPM_GET, "nvmlGpmSampleGet")                          \
    X(FN_GPM_METRICS, "nvmlGpmMetricsGet")

#define AS_ENUM(id, name) id,
#define AS_NAME(id, name) name,
enum function_id { STANDIN_FUNCTIONS(AS_ENUM) FN_COUNT };
static const char *const function_names[FN_COUNT] = {STANDIN_FUNCTIONS(AS_NAME)};

/* Scriptable per-device values; each read yields start + step * reads. */
#define STANDIN_FIELDS(X)                      \
    X(F_GPU_UTIL, "gpu_util", 50)              \
    X(F_MEM_UTIL, "mem_util", 30)              \
    X(F_MEM_USED, "mem_used", 10 * GIB)        \
    X(F_MEM_TOTAL, "mem_total", 80 * GIB)      \
    X(F_MEM_RESERVED, "mem_reserved", 0)       \
    X(F_POWER_MW, "power_mw", 300000)          \
    X(F_SM_CLOCK, "sm_clock", 1755)            \
    X(F_MEM_CLOCK, "mem_clock", 2619)          \
    X(F_MAX_MEM_CLOCK, "max_mem_clock", 2619)  \
    X(F_MAX_SM_CLOCK, "max_sm_clock", 1980)    \
    X(F_BUS_WIDTH, "bus_width", 5120)          \
    X(F_TEMPERATURE, "temperature", 55)        \
    X(F_PCIE_TX_KBPS, "pcie_tx_kbps", 1000)    \
    X(F_PCIE_RX_KBPS, "pcie_rx_kbps", 2000)    \
    X(F_DRAM_BW_UTIL, "dram_bw_util", 40.0)

#define FIELD_ENUM(id, name, dflt) id,
#define FIELD_NAME(id, name, dflt) name,
#define FIELD_DEFAULT(id, name, dflt) (double)(dflt),
enum field_id { STANDIN_FIELDS(FIELD_ENUM) F_COUNT };
static const char *const field_names[F_COUNT] = {STANDIN_FIELDS(FIELD_NAME)};
static const double field_defaults[F_COUNT] = {STANDIN_FIELDS(FIELD_DEFAULT)};

struct field_state {
    double start;
    double step;
    unsigned long long reads;
};

struct process {
    unsigned int pid;
    unsigned long long used_memory;
    unsigned int sm_util;
    unsigned int mem_util;
};

struct device_state {
    struct field_state fields[F_COUNT];
    nvmlReturn_t errors[FN_COUNT];
    int lost;
    int gpm_supported;
    unsigned int process_count;
    struct process processes[STANDIN_MAX_PROCESSES];
    char uuid[96];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct nvmlDevice_st g_handles[STANDIN_MAX_DEVICES];
static struct device_state g_devices[STANDIN_MAX_DEVICES];
static unsigned int g_device_count;
static unsigned int g_init_count;
static nvmlReturn_t g_init_error;
static nvmlReturn_t g_global_errors[FN_COUNT];
static unsigned long long g_calls[FN_COUNT];
static long long g_gpm_samples_live;
static unsigned long long g_last_process_sample_us;
/* Per-function delay (µs) before the call takes the lock: a slow driver call (PCIe throughput
 * takes ~21 ms on an H100) that does not block other threads' calls. Read without the lock. */
static unsigned int g_delay_us[FN_COUNT];

/* ---- Helpers (all called with g_lock held) --------------------------------------------- */

static void reset_device(unsigned int index) {
    struct device_state *dev = &g_devices[index];
    memset(dev, 0, sizeof(*dev));
    for (int f = 0; f < F_COUNT; f++) dev->fields[f].start = field_defaults[f];
    dev->gpm_supported = 1;
    /* Shaped like a real UUID, unique per index. */
    snprintf(dev->uuid, sizeof(dev->uuid), "GPU-00000000-0000-0000-0000-%012u", index);
}

static void reset_all(int device_count) {
    g_device_count = (unsigned int)device_count;
    g_init_count = 0;
    g_init_error = NVML_SUCCESS;
    memset(g_global_errors, 0, sizeof(g_global_errors));
    memset(g_calls, 0, sizeof(g_calls));
    for (int f = 0; f < FN_COUNT; f++) __atomic_store_n(&g_delay_us[f], 0, __ATOMIC_RELAXED);
    for (unsigned int i = 0; i < STANDIN_MAX_DEVICES; i++) {
        g_handles[i].index = i;
        reset_device(i);
    }
}

static double read_field(unsigned int index, enum field_id field) {
    struct field_state *state = &g_devices[index].fields[field];
    double value = state->start + state->step * (double)state->reads;
    state->reads++;
    return value;
}

static unsigned long long as_ull(double value) {
    if (!(value > 0.0)) return 0; /* negatives and NaN */
    if (value >= 18446744073709551615.0) return UINT64_MAX;
    return (unsigned long long)(value + 0.5); /* round half up */
}

static unsigned int as_uint(double value) {
    unsigned long long wide = as_ull(value);
    return wide > UINT32_MAX ? UINT32_MAX : (unsigned int)wide;
}

static unsigned int read_uint(unsigned int index, enum field_id field) {
    return as_uint(read_field(index, field));
}

static nvmlReturn_t leave(nvmlReturn_t ret) {
    pthread_mutex_unlock(&g_lock);
    return ret;
}

/* Sleeps for the function's scripted delay (with the lock free), as a slow driver call would. */
static void delay(enum function_id fn) {
    unsigned int us = __atomic_load_n(&g_delay_us[fn], __ATOMIC_RELAXED);
    if (us == 0) return;
    struct timespec wait = {.tv_sec = us / 1000000, .tv_nsec = (long)(us % 1000000) * 1000};
    while (nanosleep(&wait, &wait) != 0) {
    }
}

/* Locks, counts the call; then the failures shared by every entry point but the init ones. */
static nvmlReturn_t enter(enum function_id fn, int needs_init) {
    delay(fn);
    pthread_mutex_lock(&g_lock);
    g_calls[fn]++;
    if (needs_init && g_init_count == 0) return NVML_ERROR_UNINITIALIZED;
    return g_global_errors[fn];
}

/* The failures of one device: lost, or an error injected for this function and device. */
static nvmlReturn_t device_gate(enum function_id fn, unsigned int index) {
    if (g_devices[index].lost) return NVML_ERROR_GPU_IS_LOST;
    return g_devices[index].errors[fn];
}

static int handle_index(nvmlDevice_t device, unsigned int *index) {
    uintptr_t base = (uintptr_t)g_handles;
    uintptr_t address = (uintptr_t)device;
    if (address < base || address >= base + sizeof(g_handles)) return 0;
    if ((address - base) % sizeof(g_handles[0]) != 0) return 0;
    *index = (unsigned int)((address - base) / sizeof(g_handles[0]));
    return *index < g_device_count;
}

static nvmlReturn_t enter_device(enum function_id fn, nvmlDevice_t device, unsigned int *index) {
    nvmlReturn_t ret = enter(fn, 1);
    if (ret != NVML_SUCCESS) return ret;
    if (!handle_index(device, index)) return NVML_ERROR_INVALID_ARGUMENT;
    return device_gate(fn, *index);
}

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *value) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    size_t needed = strlen(value) + 1;
    if (length < needed) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, needed);
    return NVML_SUCCESS;
}

static unsigned long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
}

static unsigned long long monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

static int lookup(const char *const *names, int count, const char *name) {
    if (name == NULL) return -1;
    for (int i = 0; i < count; i++)
        if (strcmp(names[i], name) == 0) return i;
    return -1;
}

static int valid_device_or_all(int device) {
    return device == -1 || (device >= 0 && device < STANDIN_MAX_DEVICES);
}

__attribute__((constructor)) static void standin_load(void) {
    int count = STANDIN_DEFAULT_DEVICE_COUNT;
    const char *configured = getenv(STANDIN_DEVICE_COUNT_ENV);
    if (configured != NULL && *configured != '\0') {
        char *end = NULL;
        long parsed = strtol(configured, &end, 10);
        if (end != NULL && *end == '\0' && parsed >= 0 && parsed <= STANDIN_MAX_DEVICES)
            count = (int)parsed;
    }
    reset_all(count);
}

/* ---- NVML: library ---------------------------------------------------------------------- */

static nvmlReturn_t init_common(enum function_id fn) {
    nvmlReturn_t ret = enter(fn, 0);
    if (ret == NVML_SUCCESS) ret = g_init_error;
    if (ret == NVML_SUCCESS) g_init_count++;
    return leave(ret);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return init_common(FN_INIT_WITH_FLAGS);
}

nvmlReturn_t nvmlInit_v2(void) { return init_common(FN_INIT_V2); }

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t ret = enter(FN_SHUTDOWN, 1);
    if (ret == NVML_SUCCESS) g_init_count--;
    return leave(ret);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    pthread_mutex_lock(&g_lock);
    g_calls[FN_ERROR_STRING]++;
    pthread_mutex_unlock(&g_lock);
    switch (result) {
        case NVML_SUCCESS: return "Success";
        case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
        case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
        case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
        case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
        case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
        case NVML_ERROR_NOT_FOUND: return "Not Found";
        case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
        case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
        case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
        case NVML_ERROR_TIMEOUT: return "Timeout";
        case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
        case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
        case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
        case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
        case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
        case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
        case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
        case NVML_ERROR_LIB_RM_VERSION_MISMATCH:
            return "RM has detected an NVML/RM version mismatch.";
        case NVML_ERROR_IN_USE: return "In use by another client";
        case NVML_ERROR_MEMORY: return "Insufficient Memory";
        case NVML_ERROR_NO_DATA: return "No data";
        case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
            return "The requested vgpu operation is not available on target device, because "
                   "ECC is enabled";
        case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
        case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
        case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
        case NVML_ERROR_DEPRECATED: return "Deprecated";
        case NVML_ERROR_NOT_READY: return "Not ready";
        case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
        case NVML_ERROR_INVALID_STATE: return "Invalid state";
        default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t ret = enter(FN_DRIVER_VERSION, 1);
    if (ret == NVML_SUCCESS) ret = copy_string(version, length, STANDIN_DRIVER_VERSION);
    return leave(ret);
}

/* ---- NVML: device discovery -------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t ret = enter(FN_COUNT_V2, 1);
    if (ret == NVML_SUCCESS) {
        if (count == NULL)
            ret = NVML_ERROR_INVALID_ARGUMENT;
        else
            *count = g_device_count;
    }
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t ret = enter(FN_HANDLE_BY_INDEX, 1);
    if (ret == NVML_SUCCESS && (device == NULL || index >= g_device_count))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) ret = device_gate(FN_HANDLE_BY_INDEX, index);
    if (ret == NVML_SUCCESS) *device = &g_handles[index];
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t ret = enter(FN_HANDLE_BY_UUID, 1);
    if (ret == NVML_SUCCESS && (uuid == NULL || device == NULL)) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        ret = NVML_ERROR_NOT_FOUND;
        for (unsigned int i = 0; i < g_device_count; i++) {
            if (strcmp(g_devices[i].uuid, uuid) == 0) {
                ret = device_gate(FN_HANDLE_BY_UUID, i);
                if (ret == NVML_SUCCESS) *device = &g_handles[i];
                break;
            }
        }
    }
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_UUID, device, &index);
    if (ret == NVML_SUCCESS) ret = copy_string(uuid, length, g_devices[index].uuid);
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_NAME, device, &index);
    if (ret == NVML_SUCCESS) ret = copy_string(name, length, STANDIN_DEVICE_NAME);
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *out) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_INDEX, device, &index);
    if (ret == NVML_SUCCESS) {
        if (out == NULL)
            ret = NVML_ERROR_INVALID_ARGUMENT;
        else
            *out = index;
    }
    return leave(ret);
}

/* ---- NVML: per-device readings ----------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_UTILIZATION, device, &index);
    if (ret == NVML_SUCCESS) {
        if (utilization == NULL) {
            ret = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            utilization->gpu = read_uint(index, F_GPU_UTIL);
            utilization->memory = read_uint(index, F_MEM_UTIL);
        }
    }
    return leave(ret);
}

/* mem_used is what the v1 struct reports as used (it includes the reserved memory). */
static void read_memory(unsigned int index, unsigned long long *total, unsigned long long *used,
                        unsigned long long *free_bytes) {
    *total = as_ull(read_field(index, F_MEM_TOTAL));
    *used = as_ull(read_field(index, F_MEM_USED));
    *free_bytes = *total > *used ? *total - *used : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_MEMORY, device, &index);
    if (ret == NVML_SUCCESS) {
        if (memory == NULL)
            ret = NVML_ERROR_INVALID_ARGUMENT;
        else
            read_memory(index, &memory->total, &memory->used, &memory->free);
    }
    return leave(ret);
}

/* v2 splits the driver's reservation out of used: total = free + used + reserved. */
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_MEMORY_V2, device, &index);
    if (ret == NVML_SUCCESS && memory == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && memory->version != NVML_MEMORY_V2_VERSION)
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (ret == NVML_SUCCESS) {
        unsigned long long used_with_reserved = 0;
        read_memory(index, &memory->total, &used_with_reserved, &memory->free);
        unsigned long long reserved = as_ull(read_field(index, F_MEM_RESERVED));
        if (reserved > used_with_reserved) reserved = used_with_reserved;
        memory->reserved = reserved;
        memory->used = used_with_reserved - reserved;
    }
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_POWER, device, &index);
    if (ret == NVML_SUCCESS) {
        if (power == NULL)
            ret = NVML_ERROR_INVALID_ARGUMENT;
        else
            *power = read_uint(index, F_POWER_MW);
    }
    return leave(ret);
}

/* Graphics and SM clocks are one clock on the data-centre parts this stands in for. */
static nvmlReturn_t clock_field(unsigned int type, int max, enum field_id *field) {
    switch (type) {
        case NVML_CLOCK_GRAPHICS:
        case NVML_CLOCK_SM: *field = max ? F_MAX_SM_CLOCK : F_SM_CLOCK; return NVML_SUCCESS;
        case NVML_CLOCK_MEM: *field = max ? F_MAX_MEM_CLOCK : F_MEM_CLOCK; return NVML_SUCCESS;
        case NVML_CLOCK_VIDEO: return NVML_ERROR_NOT_SUPPORTED;
        default: return NVML_ERROR_INVALID_ARGUMENT;
    }
}

static nvmlReturn_t get_clock(enum function_id fn, nvmlDevice_t device, unsigned int type,
                              unsigned int *clock, int max) {
    unsigned int index = 0;
    enum field_id field = F_SM_CLOCK;
    nvmlReturn_t ret = enter_device(fn, device, &index);
    if (ret == NVML_SUCCESS && clock == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) ret = clock_field(type, max, &field);
    if (ret == NVML_SUCCESS) *clock = read_uint(index, field);
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type, unsigned int *clock) {
    return get_clock(FN_CLOCK, device, type, clock, 0);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, unsigned int type,
                                       unsigned int *clock) {
    return get_clock(FN_MAX_CLOCK, device, type, clock, 1);
}

nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t device, unsigned int *bus_width) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_BUS_WIDTH, device, &index);
    if (ret == NVML_SUCCESS) {
        if (bus_width == NULL)
            ret = NVML_ERROR_INVALID_ARGUMENT;
        else
            *bus_width = read_uint(index, F_BUS_WIDTH);
    }
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor,
                                      unsigned int *temperature) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_TEMPERATURE, device, &index);
    if (ret == NVML_SUCCESS && (temperature == NULL || sensor != NVML_TEMPERATURE_GPU))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) *temperature = read_uint(index, F_TEMPERATURE);
    return leave(ret);
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, unsigned int counter,
                                         unsigned int *value) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_PCIE, device, &index);
    if (ret == NVML_SUCCESS && (value == NULL || counter > NVML_PCIE_UTIL_RX_BYTES))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *value = read_uint(index, counter == NVML_PCIE_UTIL_TX_BYTES ? F_PCIE_TX_KBPS
                                                                     : F_PCIE_RX_KBPS);
    return leave(ret);
}

/* ---- NVML: processes (two-call protocol: ask for the count, then pass a buffer) ---------- */

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_PROCESSES, device, &index);
    if (ret == NVML_SUCCESS && count == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        const struct device_state *dev = &g_devices[index];
        unsigned int needed = dev->process_count;
        if (needed > 0 && (infos == NULL || *count < needed)) {
            ret = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            for (unsigned int i = 0; i < needed; i++) {
                infos[i].pid = dev->processes[i].pid;
                infos[i].usedGpuMemory = dev->processes[i].used_memory;
                infos[i].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
                infos[i].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            }
        }
        *count = needed;
    }
    return leave(ret);
}

/*
 * The driver samples running processes continuously: every query sees one fresh sample per
 * process, stamped with the query time (CLOCK_REALTIME microseconds, strictly increasing), and
 * keeps it only if it is newer than last_seen.
 */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long last_seen) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_PROCESS_UTIL, device, &index);
    if (ret == NVML_SUCCESS && count == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        const struct device_state *dev = &g_devices[index];
        unsigned long long stamp = now_us();
        if (stamp <= g_last_process_sample_us) stamp = g_last_process_sample_us + 1;
        g_last_process_sample_us = stamp;
        unsigned int available = stamp > last_seen ? dev->process_count : 0;
        if (available == 0) {
            ret = NVML_ERROR_NOT_FOUND;
            *count = 0;
        } else if (samples == NULL || *count < available) {
            ret = NVML_ERROR_INSUFFICIENT_SIZE;
            *count = available;
        } else {
            for (unsigned int i = 0; i < available; i++) {
                samples[i].pid = dev->processes[i].pid;
                samples[i].timeStamp = stamp;
                samples[i].smUtil = dev->processes[i].sm_util;
                samples[i].memUtil = dev->processes[i].mem_util;
                samples[i].encUtil = 0;
                samples[i].decUtil = 0;
            }
            *count = available;
        }
    }
    return leave(ret);
}

/* ---- NVML: GPM (GPU performance metrics, Hopper and later) ------------------------------- */

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_GPM_SUPPORT, device, &index);
    if (ret == NVML_SUCCESS && support == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && support->version != NVML_GPM_SUPPORT_VERSION)
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (ret == NVML_SUCCESS) support->isSupportedDevice = g_devices[index].gpm_supported ? 1 : 0;
    return leave(ret);
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    nvmlReturn_t ret = enter(FN_GPM_ALLOC, 1);
    if (ret == NVML_SUCCESS && sample == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        nvmlGpmSample_t allocated = calloc(1, sizeof(*allocated));
        if (allocated == NULL) {
            ret = NVML_ERROR_MEMORY;
        } else {
            allocated->magic = STANDIN_GPM_SAMPLE_MAGIC;
            *sample = allocated;
            g_gpm_samples_live++;
        }
    }
    return leave(ret);
}

static int valid_sample(nvmlGpmSample_t sample) {
    return sample != NULL && sample->magic == STANDIN_GPM_SAMPLE_MAGIC;
}

/* Frees even after nvmlShutdown, so that shutdown paths cannot leak samples. */
nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    nvmlReturn_t ret = enter(FN_GPM_FREE, 0);
    if (ret == NVML_SUCCESS && !valid_sample(sample)) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        sample->magic = 0;
        free(sample);
        g_gpm_samples_live--;
    }
    return leave(ret);
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample) {
    unsigned int index = 0;
    nvmlReturn_t ret = enter_device(FN_GPM_GET, device, &index);
    if (ret == NVML_SUCCESS && !g_devices[index].gpm_supported) ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS && !valid_sample(sample)) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        sample->taken = 1;
        sample->device = index;
        sample->time_ns = monotonic_ns();
    }
    return leave(ret);
}

static char k_dram_short[] = "dram_bw_util";
static char k_dram_long[] = "DRAM bandwidth utilization";
static char k_percent[] = "%";

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *request) {
    nvmlReturn_t ret = enter(FN_GPM_METRICS, 1);
    if (ret == NVML_SUCCESS && request == NULL) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && request->version != NVML_GPM_METRICS_GET_VERSION)
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (ret == NVML_SUCCESS &&
        (request->numMetrics > STANDIN_GPM_METRIC_MAX || !valid_sample(request->sample1) ||
         !valid_sample(request->sample2) || !request->sample1->taken ||
         !request->sample2->taken || request->sample1->device != request->sample2->device ||
         request->sample1->device >= g_device_count))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) ret = device_gate(FN_GPM_METRICS, request->sample1->device);
    if (ret == NVML_SUCCESS && !g_devices[request->sample1->device].gpm_supported)
        ret = NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS) {
        unsigned int index = request->sample1->device;
        for (unsigned int i = 0; i < request->numMetrics; i++) {
            nvmlGpmMetric_t *metric = &request->metrics[i];
            if (metric->metricId == NVML_GPM_METRIC_DRAM_BW_UTIL) {
                metric->nvmlReturn = NVML_SUCCESS;
                metric->value = read_field(index, F_DRAM_BW_UTIL);
                metric->metricInfo.shortName = k_dram_short;
                metric->metricInfo.longName = k_dram_long;
                metric->metricInfo.unit = k_percent;
            } else {
                metric->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
                metric->value = 0.0;
                metric->metricInfo.shortName = NULL;
                metric->metricInfo.longName = NULL;
                metric->metricInfo.unit = NULL;
            }
        }
    }
    return leave(ret);
}

/* ---- Control API for tests ----------------------------------------------------------------
 * Device -1 means every device (and, for set_error, also functions that take no device).
 * Returns 0 on success, -1 for an unknown field or function name, -2 for a bad device or count.
 */

int standin_reset(int device_count) {
    if (device_count < 0 || device_count > STANDIN_MAX_DEVICES) return -2;
    pthread_mutex_lock(&g_lock);
    reset_all(device_count);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

int standin_set_ramp(int device, const char *field, double start, double step) {
    int f = lookup(field_names, F_COUNT, field);
    if (f < 0) return -1;
    if (!valid_device_or_all(device)) return -2;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STANDIN_MAX_DEVICES; i++) {
        if (device != -1 && i != device) continue;
        g_devices[i].fields[f] = (struct field_state){.start = start, .step = step, .reads = 0};
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

int standin_set(int device, const char *field, double value) {
    return standin_set_ramp(device, field, value, 0.0);
}

int standin_set_error(int device, const char *function_name, int nvml_return) {
    int fn = lookup(function_names, FN_COUNT, function_name);
    if (fn < 0) return -1;
    if (!valid_device_or_all(device)) return -2;
    pthread_mutex_lock(&g_lock);
    if (device == -1)
        g_global_errors[fn] = (nvmlReturn_t)nvml_return;
    else
        g_devices[device].errors[fn] = (nvmlReturn_t)nvml_return;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Every later call of the function sleeps `us` microseconds first (0 clears; reset clears all). */
int standin_set_call_delay_us(const char *function_name, unsigned int us) {
    int fn = lookup(function_names, FN_COUNT, function_name);
    if (fn < 0) return -1;
    __atomic_store_n(&g_delay_us[fn], us, __ATOMIC_RELAXED);
    return 0;
}

int standin_set_gpm_supported(int device, int supported) {
    if (!valid_device_or_all(device)) return -2;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STANDIN_MAX_DEVICES; i++)
        if (device == -1 || i == device) g_devices[i].gpm_supported = supported != 0;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

int standin_lose_gpu(int device) {
    if (!valid_device_or_all(device)) return -2;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < STANDIN_MAX_DEVICES; i++)
        if (device == -1 || i == device) g_devices[i].lost = 1;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

void standin_set_init_error(int nvml_return) {
    pthread_mutex_lock(&g_lock);
    g_init_error = (nvmlReturn_t)nvml_return;
    pthread_mutex_unlock(&g_lock);
}

/* Adds a process, or updates it when the pid is already there; -3 when the table is full. */
int standin_add_process(int device, unsigned int pid, unsigned long long used_memory_bytes,
                        unsigned int sm_util, unsigned int mem_util) {
    if (device < 0 || device >= STANDIN_MAX_DEVICES) return -2;
    int ret = 0;
    pthread_mutex_lock(&g_lock);
    struct device_state *dev = &g_devices[device];
    unsigned int slot = 0;
    while (slot < dev->process_count && dev->processes[slot].pid != pid) slot++;
    if (slot == STANDIN_MAX_PROCESSES) {
        ret = -3;
    } else {
        if (slot == dev->process_count) dev->process_count++;
        dev->processes[slot] = (struct process){
            .pid = pid, .used_memory = used_memory_bytes, .sm_util = sm_util, .mem_util = mem_util};
    }
    pthread_mutex_unlock(&g_lock);
    return ret;
}

/* How often an NVML function was called since the last reset, over all devices; -1 if unknown. */
long long standin_calls(const char *function_name) {
    int fn = lookup(function_names, FN_COUNT, function_name);
    if (fn < 0) return -1;
    pthread_mutex_lock(&g_lock);
    long long calls = (long long)g_calls[fn];
    pthread_mutex_unlock(&g_lock);
    return calls;
}

/* GPM samples allocated and not yet freed (not cleared by reset: samples outlive it). */
long long standin_gpm_samples_live(void) {
    pthread_mutex_lock(&g_lock);
    long long live = g_gpm_samples_live;
    pthread_mutex_unlock(&g_lock);
    return live;
}

unsigned int standin_gpm_metric_max(void) { return STANDIN_GPM_METRIC_MAX; }

/* sizeof of the C structs, so that tests can compare them with pynvml's ctypes layouts. */
long long standin_struct_size(const char *name) {
    static const struct {
        const char *name;
        size_t size;
    } sizes[] = {
        {"c_nvmlUtilization_t", sizeof(nvmlUtilization_t)},
        {"c_nvmlMemory_t", sizeof(nvmlMemory_t)},
        {"c_nvmlMemory_v2_t", sizeof(nvmlMemory_v2_t)},
        {"c_nvmlProcessInfo_v3_t", sizeof(nvmlProcessInfo_t)},
        {"c_nvmlProcessUtilizationSample_t", sizeof(nvmlProcessUtilizationSample_t)},
        {"c_nvmlGpmSupport_t", sizeof(nvmlGpmSupport_t)},
        {"c_nvmlGpmMetric_t", sizeof(nvmlGpmMetric_t)},
        {"c_nvmlGpmMetricsGet_t", sizeof(nvmlGpmMetricsGet_t)},
    };
    if (name == NULL) return -1;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        if (strcmp(sizes[i].name, name) == 0) return (long long)sizes[i].size;
    return -1;
}

/*
 * libcuda_emu -- an emulated CUDA driver (libcuda.so.1) that runs ringtrain's
 * PTX kernels on the SIMT emulator of scripts/ptx-emu, so the GPU test
 * binaries can run on machines without an NVIDIA GPU.  Built by
 * scripts/emu-cuda/build; use it with LD_LIBRARY_PATH=.tools/emu-cuda/lib64.
 *
 * The device
 * ----------
 * One device, "NVIDIA H100 (ringtrain PTX emulator)", compute capability 9.0,
 * 132 multiprocessors, 80 GiB of memory.  Every context (the primary one and
 * those made by cuCtxCreate) shares one device address space and one set of
 * streams; the per-thread current-context stack is kept as the driver API
 * describes, and calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT
 * when the calling thread has none.
 *
 * Device memory
 * -------------
 * One sparse file of EMU_SPAN bytes (created in $LIBCUDA_EMU_DIR, /dev/shm or
 * $TMPDIR and unlinked at once, so nothing is left behind) is mapped by this
 * library and by the kernel server.  Device address = EMU_DEV_BASE + file
 * offset; EMU_DEV_BASE is not a host mapping, so host code that dereferences
 * a device pointer crashes as it would with a real driver.  Allocations are
 * page aligned, placed first-fit and separated by unmapped guard gaps of at
 * least EMU_GUARD bytes; every copy and memset is checked against the live
 * allocation it starts in (CUDA_ERROR_INVALID_VALUE otherwise), and the
 * kernel server knows each allocation's exact size, so a kernel access one
 * byte past the end is reported.  New allocations are filled with 0xFF
 * (NaN for every float type) so reads of memory nobody wrote show up; set
 * LIBCUDA_EMU_FILL=none to leave them zero, or =0xNN for another byte.
 * Freed ranges are given back to the system (hole punching).  Pinned host
 * memory (cuMemAllocHost, cuMemHostAlloc, cuMemHostRegister) is ordinary
 * host memory here.
 *
 * Kernels
 * -------
 * cuModuleLoadData(Ex) hands the PTX text to a Python server process
 * (scripts/emu-cuda/server.py, started on the first module load with the
 * interpreter of .tools/pyenv; LIBCUDA_EMU_SERVER and LIBCUDA_EMU_PYTHON
 * override both paths) that parses it with ptx_emu.py.  A launch runs the
 * whole grid there, one block after another (in an order shuffled with
 * LIBCUDA_EMU_SEED, default 0, plus the launch's sequence number), with
 * approximate instructions perturbed within their documented error.  By
 * default (LIBCUDA_EMU_APPROX=hash) the error is a fixed function of the exact
 * result and LIBCUDA_EMU_SEED, so equal inputs give equal outputs in every
 * launch, as on hardware; =random draws new errors per launch, =exact rounds
 * the exact value.  Runs are reproducible.  When the emulator reports an
 * error (race, out-of-bounds access, unsupported instruction...) its message,
 * which names the entry, the PTX line and the instruction, is printed to
 * stderr after "libcuda-emu:" and the call that ran the launch returns
 * CUDA_ERROR_LAUNCH_FAILED.  Unlike a real device the error is not sticky:
 * later work still runs, so one failing test does not fail every later one.
 *
 * Streams: deferred execution
 * ---------------------------
 * Nothing queued on a stream runs when it is queued.  Launches, async copies,
 * async memsets, event records, stream-wait-event dependencies and host
 * functions join their stream's FIFO queue, numbered by one global issue
 * counter, and run only when the host must observe them:
 *   - cuStreamSynchronize(s) runs s's queue;
 *   - cuEventSynchronize(e) runs e's stream up to e's latest record;
 *   - a cuStreamWaitEvent(s2, e) entry, when s2 reaches it, first runs e's
 *     stream up to the record that was latest when the wait was queued;
 *   - cuCtxSynchronize runs every queue;
 *   - cuEventQuery / cuStreamQuery on unfinished work return
 *     CUDA_ERROR_NOT_READY and then run that work, so the next query
 *     succeeds and polling loops make progress;
 *   - synchronous calls (cuMemcpy*, cuMemset* without Async, module unload,
 *     cuMemFreeHost, cuMemHostUnregister) first run the legacy default stream
 *     and every stream created without CU_STREAM_NON_BLOCKING; cuMemFree runs
 *     every queue;
 *   - legacy default-stream ordering: an entry of the NULL stream first runs
 *     the earlier-issued work of every blocking stream, and an entry of a
 *     blocking stream first runs the earlier-issued work of the NULL stream.
 *     CU_STREAM_PER_THREAD is treated as the NULL stream.
 * Running one stream never runs another stream's work except through these
 * rules, so a copy on stream B that does not wait for stream A's event reads
 * the data as it was before A's kernels, as it can on hardware.  Async copies
 * read or write their host memory when they run, not when they are queued
 * (the pinned-memory contract, also applied to pageable memory).
 *
 * Schedules (LIBCUDA_EMU_SCHEDULE):
 *   - "lazy" (default): the rules above, nothing more.  Work on another stream
 *     runs as early as its dependencies allow relative to the stream the host
 *     waits for, so a missing cuStreamWaitEvent (read-after-write across
 *     streams) shows up as stale data.
 *   - "late": before the host observes a stream or event (cuStreamSynchronize,
 *     cuStreamQuery, cuEventSynchronize, cuEventQuery), every other stream's
 *     queue runs to its end first, then the observed stream.  Work queued on
 *     other streams AFTER a cross-stream copy then runs before that copy, so a
 *     kernel that overwrites data a pending copy still has to read
 *     (write-after-read across streams) shows up as wrong data.
 *   Both orders are legal executions of the same queued work.
 *
 * Events record the host's monotonic clock when their record entry runs, so
 * cuEventElapsedTime is the host time the emulator spent between the two
 * records (at least 0.001 ms); it measures emulation, not GPU speed.
 *
 * Every other cu* entry point of the driver API exists and prints
 * "libcuda-emu: <name> is not emulated" and returns CUDA_ERROR_NOT_SUPPORTED.
 * All entry points take one process-wide lock.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "emu_errors.h" /* generated by the build script: emu_error_names[] */

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct emu_ctx *CUcontext;
typedef struct emu_stream *CUstream;
typedef struct emu_event *CUevent;
typedef struct emu_module *CUmodule;
typedef struct emu_function *CUfunction;
typedef void (*CUhostFn)(void *user_data);

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define EMU_DEV_BASE 0x100000000000ULL /* 16 TiB: device address of file offset 0 */
#define EMU_SPAN (1ULL << 40)          /* size of the sparse device-memory file */
#define EMU_TOTAL_MEM_DEFAULT (80ULL << 30) /* device memory unless LIBCUDA_EMU_TOTAL_MEM says */
#define EMU_PAGE 4096ULL
#define EMU_GUARD (64ULL << 10)        /* unmapped bytes after every allocation */
#define EMU_FILL_LIMIT (256ULL << 20)  /* larger allocations are not filled */
#define EMU_SM_COUNT 132
#define EMU_SHARED_PER_BLOCK 49152
#define EMU_SHARED_PER_BLOCK_OPTIN 232448
#define EMU_DEVICE_NAME "NVIDIA H100 (ringtrain PTX emulator)"

#define CU_STREAM_NON_BLOCKING 0x1u
#define CU_EVENT_DISABLE_TIMING 0x2u
#define STREAM_LEGACY_HANDLE ((CUstream)(uintptr_t)0x1)
#define STREAM_PER_THREAD_HANDLE ((CUstream)(uintptr_t)0x2)

#ifndef EMU_SERVER_PATH
#define EMU_SERVER_PATH "server.py"
#endif
#ifndef EMU_PYTHON
#define EMU_PYTHON "python3"
#endif

/* ------------------------------------------------------------------------ */
/* Objects                                                                  */
/* ------------------------------------------------------------------------ */

#define MAGIC_CTX 0x43545831u
#define MAGIC_STREAM 0x53545231u
#define MAGIC_EVENT 0x45564e31u
#define MAGIC_MODULE 0x4d4f4431u
#define MAGIC_FUNCTION 0x46554e31u

struct emu_ctx {
    uint32_t magic;
    unsigned flags;
    int primary;
};

enum op_kind { OP_KERNEL, OP_COPY_HTOD, OP_COPY_DTOH, OP_COPY_DTOD, OP_MEMSET, OP_RECORD, OP_WAIT, OP_HOSTFN };

struct emu_op {
    struct emu_op *next;
    uint64_t seq;
    enum op_kind kind;
    union {
        struct {
            struct emu_function *fn;
            unsigned grid[3], block[3], shared;
            uint64_t seed;
            size_t nbytes;
            unsigned char *params;
        } kernel;
        struct {
            CUdeviceptr dev, dev_src;
            void *host;
            const void *host_src;
            size_t bytes;
        } copy;
        struct {
            CUdeviceptr dev;
            uint32_t value;
            unsigned elem;
            size_t count;
        } memset;
        struct {
            struct emu_event *event;
        } record;
        struct {
            struct emu_stream *stream; /* stream holding the awaited record (NULL: done) */
            uint64_t seq;              /* the awaited record's issue number */
        } wait;
        struct {
            CUhostFn fn;
            void *data;
        } hostfn;
    } u;
};

struct emu_stream {
    uint32_t magic;
    unsigned flags;
    int priority;
    int legacy;
    struct emu_op *head, *tail;
    struct emu_stream *next_all;
};

struct emu_event {
    uint32_t magic;
    unsigned flags;
    int recorded;               /* recorded at least once */
    struct emu_stream *stream;  /* stream of the latest record */
    uint64_t seq;               /* issue number of the latest record */
    int done;                   /* the latest record has run */
    struct timespec when;       /* host time the latest record ran */
    struct emu_event *next_all;
};

struct emu_function {
    uint32_t magic;
    struct emu_module *module;
    uint32_t server_id;
    unsigned nparams;
    unsigned *sizes;
    unsigned static_shared;
    unsigned max_threads;
    int max_dynamic_shared;
    char *name;
    struct emu_function *next_in_module;
};

struct emu_module {
    uint32_t magic;
    uint32_t server_id;
    struct emu_function *functions;
};

struct emu_alloc {
    uint64_t off;      /* file offset */
    uint64_t size;     /* requested bytes */
    uint64_t reserved; /* bytes reserved in the file, guard included */
};

struct host_range {
    void *ptr;
    size_t size;
    int owned; /* allocated here (cuMemAllocHost / cuMemHostAlloc) vs registered */
};

/* ------------------------------------------------------------------------ */
/* State                                                                    */
/* ------------------------------------------------------------------------ */

static pthread_mutex_t g_lock;
static pthread_once_t g_lock_once = PTHREAD_ONCE_INIT;
static int g_initialized;
static struct emu_ctx g_primary = {MAGIC_CTX, 0, 1};
static int g_primary_refs;
static struct emu_stream g_legacy = {MAGIC_STREAM, 0, 0, 1, NULL, NULL, NULL};
static struct emu_stream *g_streams = &g_legacy; /* every live stream, the legacy one included */
static struct emu_event *g_events;
static uint64_t g_seq;
static uint64_t g_launches;
static uint64_t g_seed_base;
static int g_schedule_late; /* LIBCUDA_EMU_SCHEDULE=late */

static int g_mem_fd = -1;
static unsigned char *g_mem;
static struct emu_alloc *g_allocs;
static size_t g_nallocs, g_cap_allocs;
static uint64_t g_allocated;
static int g_fill_byte = 0xFF;

static struct host_range *g_host;
static size_t g_nhost, g_cap_host;

static int g_sock = -1;
static pid_t g_server_pid;
static int g_server_dead;

static __thread CUcontext t_ctx_stack[64];
static __thread int t_ctx_depth;

static void emu_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emu_msg(const char *fmt, ...)
{
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "libcuda-emu: %s\n", buf);
    fflush(stderr);
}

static void make_lock(void)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    /* recursive: a host function run from a queue may (against the rules) call the API */
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&g_lock, &attr);
    pthread_mutexattr_destroy(&attr);
}

static void lock(void)
{
    pthread_once(&g_lock_once, make_lock);
    pthread_mutex_lock(&g_lock);
}

static void unlock(void) { pthread_mutex_unlock(&g_lock); }

#define LOCKED(expr)                  \
    do {                              \
        CUresult locked_result_;      \
        lock();                       \
        locked_result_ = (expr);      \
        unlock();                     \
        return locked_result_;        \
    } while (0)

/* Called by the generated stand-ins of every entry point that is not emulated. */
int emu_not_emulated(const char *name)
{
    emu_msg("%s is not emulated", name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUcontext current_ctx(void) { return t_ctx_depth > 0 ? t_ctx_stack[t_ctx_depth - 1] : NULL; }

static CUresult need_ctx(void)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    return current_ctx() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* ------------------------------------------------------------------------ */
/* Device memory                                                            */
/* ------------------------------------------------------------------------ */

static CUresult mem_init(void)
{
    const char *dirs[3];
    char path[4096];
    int n = 0;
    const char *env_fill = getenv("LIBCUDA_EMU_FILL");
    if (g_mem)
        return CUDA_SUCCESS;
    if (env_fill) {
        if (strcmp(env_fill, "none") == 0)
            g_fill_byte = -1;
        else
            g_fill_byte = (int)(strtol(env_fill, NULL, 0) & 0xFF);
    }
    if (getenv("LIBCUDA_EMU_DIR"))
        dirs[n++] = getenv("LIBCUDA_EMU_DIR");
    dirs[n++] = "/dev/shm";
    dirs[n++] = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    for (int i = 0; i < n && g_mem_fd < 0; i++) {
        snprintf(path, sizeof path, "%s/libcuda-emu-%ld-XXXXXX", dirs[i], (long)getpid());
        int fd = mkostemp(path, O_CLOEXEC);
        if (fd < 0)
            continue;
        unlink(path);
        if (ftruncate(fd, (off_t)EMU_SPAN) != 0) {
            close(fd);
            continue;
        }
        g_mem_fd = fd;
    }
    if (g_mem_fd < 0) {
        emu_msg("cannot create the device memory file in %s (%s)", dirs[0], strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    void *p = mmap(NULL, EMU_SPAN, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, g_mem_fd, 0);
    if (p == MAP_FAILED) {
        emu_msg("cannot map the device memory file (%s)", strerror(errno));
        close(g_mem_fd);
        g_mem_fd = -1;
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    g_mem = p;
    return CUDA_SUCCESS;
}

/* Index of the allocation containing device address ptr, or -1. */
static long find_alloc(CUdeviceptr ptr)
{
    if (ptr < EMU_DEV_BASE || ptr >= EMU_DEV_BASE + EMU_SPAN)
        return -1;
    uint64_t off = ptr - EMU_DEV_BASE;
    size_t lo = 0, hi = g_nallocs;
    while (lo < hi) { /* first allocation with off > target */
        size_t mid = (lo + hi) / 2;
        if (g_allocs[mid].off <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return -1;
    struct emu_alloc *a = &g_allocs[lo - 1];
    return off < a->off + a->size ? (long)(lo - 1) : -1;
}

/* Checks that [ptr, ptr + bytes) lies inside one live allocation. */
static CUresult check_range(const char *call, const char *what, CUdeviceptr ptr, size_t bytes)
{
    long i = find_alloc(ptr);
    if (i < 0) {
        emu_msg("%s: %s %#llx is not inside a live cuMemAlloc allocation", call, what, ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct emu_alloc *a = &g_allocs[i];
    uint64_t off = ptr - EMU_DEV_BASE;
    if (bytes > a->off + a->size - off) {
        emu_msg("%s: %s range [%#llx, +%zu) runs %llu bytes past the end of its allocation "
                "[%#llx, +%llu)",
                call, what, ptr, bytes, (unsigned long long)(off + bytes - a->off - a->size),
                (unsigned long long)(EMU_DEV_BASE + a->off), (unsigned long long)a->size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

static unsigned char *dev_bytes(CUdeviceptr ptr) { return g_mem + (ptr - EMU_DEV_BASE); }

/* ------------------------------------------------------------------------ */
/* Kernel server                                                            */
/* ------------------------------------------------------------------------ */

enum { SRV_LOAD = 1, SRV_GETFN = 2, SRV_UNLOAD = 3, SRV_ALLOC = 4, SRV_FREE = 5, SRV_LAUNCH = 6 };

static int write_all(int fd, const void *buf, size_t n)
{
    const unsigned char *p = buf;
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t n)
{
    unsigned char *p = buf;
    while (n > 0) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/*
 * One request / reply.  Returns the reply status (0 ok, 1 error, 2 not found)
 * or -1 when the server is gone; *reply (malloc'd, NUL-terminated) receives the
 * payload when reply is not NULL.
 */
static int server_call(uint32_t op, const void *a, size_t alen, const void *b, size_t blen, char **reply,
                       uint32_t *reply_len)
{
    uint32_t head[2] = {op, (uint32_t)(alen + blen)};
    if (g_sock < 0 || g_server_dead)
        return -1;
    if (write_all(g_sock, head, sizeof head) || (alen && write_all(g_sock, a, alen)) ||
        (blen && write_all(g_sock, b, blen)) || read_all(g_sock, head, sizeof head)) {
        g_server_dead = 1;
        emu_msg("the kernel server (pid %ld) is gone; no kernel can run any more", (long)g_server_pid);
        return -1;
    }
    char *body = malloc((size_t)head[1] + 1);
    if (!body || (head[1] && read_all(g_sock, body, head[1]))) {
        free(body);
        g_server_dead = 1;
        emu_msg("lost the kernel server while reading its reply");
        return -1;
    }
    body[head[1]] = 0;
    if (reply_len)
        *reply_len = head[1];
    if (reply)
        *reply = body;
    else
        free(body);
    return (int)head[0];
}

static int server_simple(uint32_t op, const void *a, size_t alen, const char *what)
{
    char *reply = NULL;
    int st = server_call(op, a, alen, NULL, 0, &reply, NULL);
    if (st > 0)
        emu_msg("%s: %s", what, reply);
    free(reply);
    return st;
}

static void notify_alloc(const struct emu_alloc *a)
{
    uint64_t msg[2] = {EMU_DEV_BASE + a->off, a->size};
    if (g_sock >= 0)
        server_simple(SRV_ALLOC, msg, sizeof msg, "registering an allocation with the kernel server");
}

static CUresult server_start(void)
{
    int sv[2];
    if (g_sock >= 0)
        return g_server_dead ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
    const char *server = getenv("LIBCUDA_EMU_SERVER") ? getenv("LIBCUDA_EMU_SERVER") : EMU_SERVER_PATH;
    const char *python = getenv("LIBCUDA_EMU_PYTHON") ? getenv("LIBCUDA_EMU_PYTHON") : EMU_PYTHON;
    if (access(server, R_OK) != 0) {
        emu_msg("kernel server %s not readable (%s); set LIBCUDA_EMU_SERVER", server, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        emu_msg("socketpair failed (%s)", strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    char fd_arg[32], mem_fd_arg[32], size_arg[32], base_arg[32];
    snprintf(fd_arg, sizeof fd_arg, "%d", sv[1]);
    snprintf(mem_fd_arg, sizeof mem_fd_arg, "%d", g_mem_fd);
    snprintf(size_arg, sizeof size_arg, "%llu", (unsigned long long)EMU_SPAN);
    snprintf(base_arg, sizeof base_arg, "%llu", (unsigned long long)EMU_DEV_BASE);
    char *argv[] = {(char *)python, "-u", (char *)server, "--fd", fd_arg, "--mem-fd", mem_fd_arg,
                    "--mem-size", size_arg, "--base", base_arg, NULL};
    pid_t pid = fork();
    if (pid < 0) {
        emu_msg("fork failed (%s)", strerror(errno));
        close(sv[0]);
        close(sv[1]);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (pid == 0) {
        /* child: only async-signal-safe calls until exec */
        fcntl(sv[1], F_SETFD, 0);
        fcntl(g_mem_fd, F_SETFD, 0);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execvp(python, argv);
        static const char msg[] = "libcuda-emu: cannot execute the kernel server's Python interpreter\n";
        ssize_t ignored = write(2, msg, sizeof msg - 1);
        (void)ignored;
        _exit(127);
    }
    close(sv[1]);
    g_sock = sv[0];
    g_server_pid = pid;
    g_server_dead = 0;
    for (size_t i = 0; i < g_nallocs; i++)
        notify_alloc(&g_allocs[i]);
    return g_server_dead ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Queues                                                                   */
/* ------------------------------------------------------------------------ */

static struct emu_stream *resolve_stream(CUstream h, CUresult *err)
{
    *err = CUDA_SUCCESS;
    if (h == NULL || h == STREAM_LEGACY_HANDLE || h == STREAM_PER_THREAD_HANDLE)
        return &g_legacy;
    for (struct emu_stream *s = g_streams; s; s = s->next_all)
        if (s == h && s->magic == MAGIC_STREAM)
            return s;
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
}

static struct emu_op *new_op(enum op_kind kind)
{
    struct emu_op *op = calloc(1, sizeof *op);
    if (op) {
        op->kind = kind;
        op->seq = ++g_seq;
    }
    return op;
}

static void enqueue(struct emu_stream *s, struct emu_op *op)
{
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
}

static CUresult run_until(struct emu_stream *s, uint64_t seq);

static CUresult exec_kernel(struct emu_op *op)
{
    struct emu_function *fn = op->u.kernel.fn;
    struct {
        uint32_t fid, grid[3], block[3], shared;
        uint64_t seed;
    } __attribute__((packed)) head;
    head.fid = fn->server_id;
    memcpy(head.grid, op->u.kernel.grid, sizeof head.grid);
    memcpy(head.block, op->u.kernel.block, sizeof head.block);
    head.shared = op->u.kernel.shared;
    head.seed = op->u.kernel.seed;
    char *reply = NULL;
    int st = server_call(SRV_LAUNCH, &head, sizeof head, op->u.kernel.params, op->u.kernel.nbytes, &reply, NULL);
    if (st == 0) {
        free(reply);
        return CUDA_SUCCESS;
    }
    if (st > 0)
        emu_msg("kernel %s failed: %s", fn->name, reply);
    else
        emu_msg("kernel %s could not run: the kernel server is gone", fn->name);
    free(reply);
    return CUDA_ERROR_LAUNCH_FAILED;
}

static CUresult exec_op(struct emu_stream *s, struct emu_op *op)
{
    CUresult r = CUDA_SUCCESS, r2;
    /* legacy default-stream ordering against the earlier-issued work of blocking streams */
    if (s->legacy) {
        for (struct emu_stream *b = g_streams; b; b = b->next_all)
            if (b != s && !(b->flags & CU_STREAM_NON_BLOCKING) && (r2 = run_until(b, op->seq)) && !r)
                r = r2;
    } else if (!(s->flags & CU_STREAM_NON_BLOCKING)) {
        if ((r2 = run_until(&g_legacy, op->seq)) && !r)
            r = r2;
    }
    switch (op->kind) {
    case OP_KERNEL:
        r2 = exec_kernel(op);
        break;
    case OP_COPY_HTOD:
        memcpy(dev_bytes(op->u.copy.dev), op->u.copy.host_src, op->u.copy.bytes);
        r2 = CUDA_SUCCESS;
        break;
    case OP_COPY_DTOH:
        memcpy(op->u.copy.host, dev_bytes(op->u.copy.dev), op->u.copy.bytes);
        r2 = CUDA_SUCCESS;
        break;
    case OP_COPY_DTOD:
        memmove(dev_bytes(op->u.copy.dev), dev_bytes(op->u.copy.dev_src), op->u.copy.bytes);
        r2 = CUDA_SUCCESS;
        break;
    case OP_MEMSET: {
        unsigned char *p = dev_bytes(op->u.memset.dev);
        if (op->u.memset.elem == 1) {
            memset(p, (int)(op->u.memset.value & 0xFF), op->u.memset.count);
        } else {
            for (size_t i = 0; i < op->u.memset.count; i++) {
                if (op->u.memset.elem == 2) {
                    uint16_t v = (uint16_t)op->u.memset.value;
                    memcpy(p + 2 * i, &v, 2);
                } else {
                    uint32_t v = op->u.memset.value;
                    memcpy(p + 4 * i, &v, 4);
                }
            }
        }
        r2 = CUDA_SUCCESS;
        break;
    }
    case OP_RECORD: {
        struct emu_event *e = op->u.record.event;
        if (e && e->seq == op->seq) {
            e->done = 1;
            clock_gettime(CLOCK_MONOTONIC, &e->when);
        }
        r2 = CUDA_SUCCESS;
        break;
    }
    case OP_WAIT:
        r2 = op->u.wait.stream ? run_until(op->u.wait.stream, op->u.wait.seq) : CUDA_SUCCESS;
        break;
    case OP_HOSTFN:
        op->u.hostfn.fn(op->u.hostfn.data);
        r2 = CUDA_SUCCESS;
        break;
    default:
        r2 = CUDA_SUCCESS;
    }
    return r ? r : r2;
}

static void free_op(struct emu_op *op)
{
    if (op->kind == OP_KERNEL)
        free(op->u.kernel.params);
    free(op);
}

/* Runs s's entries issued at or before seq, in order; the first error is returned. */
static CUresult run_until(struct emu_stream *s, uint64_t seq)
{
    CUresult r = CUDA_SUCCESS;
    while (s->head && s->head->seq <= seq) {
        struct emu_op *op = s->head;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        CUresult r2 = exec_op(s, op);
        free_op(op);
        if (r2 && !r)
            r = r2;
    }
    return r;
}

static CUresult run_stream(struct emu_stream *s) { return run_until(s, UINT64_MAX); }

static CUresult run_all(void)
{
    CUresult r = CUDA_SUCCESS;
    int again = 1;
    while (again) {
        again = 0;
        for (struct emu_stream *s = g_streams; s; s = s->next_all) {
            if (s->head) {
                CUresult r2 = run_stream(s);
                if (r2 && !r)
                    r = r2;
                again = 1;
            }
        }
    }
    return r;
}

/* Late schedule: before the host observes stream s, every other queue runs to its end. */
static CUresult run_others_first(struct emu_stream *s)
{
    CUresult r = CUDA_SUCCESS;
    if (!g_schedule_late)
        return r;
    for (struct emu_stream *o = g_streams; o; o = o->next_all) {
        if (o != s && o->head) {
            CUresult r2 = run_stream(o);
            if (r2 && !r)
                r = r2;
        }
    }
    return r;
}

/* What a synchronous call waits for: the legacy stream and every blocking stream. */
static CUresult run_blocking(void)
{
    CUresult r = run_stream(&g_legacy);
    for (struct emu_stream *s = g_streams; s; s = s->next_all) {
        if (!(s->flags & CU_STREAM_NON_BLOCKING)) {
            CUresult r2 = run_stream(s);
            if (r2 && !r)
                r = r2;
        }
    }
    return r;
}

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

static const char *error_name(CUresult code)
{
    for (size_t i = 0; i < sizeof emu_error_names / sizeof emu_error_names[0]; i++)
        if (emu_error_names[i].code == code)
            return emu_error_names[i].name;
    return NULL;
}

static const char *error_text(CUresult code)
{
    switch (code) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_INVALID_IMAGE: return "device kernel image is invalid";
    case CUDA_ERROR_INVALID_CONTEXT: return "invalid device context";
    case CUDA_ERROR_INVALID_PTX: return "a PTX JIT compilation failed";
    case CUDA_ERROR_OPERATING_SYSTEM: return "OS call failed or operation not supported on this OS";
    case CUDA_ERROR_INVALID_HANDLE: return "invalid resource handle";
    case CUDA_ERROR_NOT_FOUND: return "named symbol not found";
    case CUDA_ERROR_NOT_READY: return "device not ready";
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "too many resources requested for launch";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "part or all of the requested memory range is already mapped";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "pointer does not correspond to a registered memory region";
    case CUDA_ERROR_LAUNCH_FAILED: return "unspecified launch failure";
    case CUDA_ERROR_NOT_SUPPORTED: return "operation not supported";
    default: return NULL;
    }
}

API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    *pStr = error_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    *pStr = error_text(error);
    if (!*pStr)
        *pStr = error_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------ */
/* Initialization and device                                                */
/* ------------------------------------------------------------------------ */

/* What cuMemGetInfo and cuDeviceTotalMem report, and where allocations run out:
   LIBCUDA_EMU_TOTAL_MEM (bytes, or with a K, M or G suffix), else 80 GiB. */
static uint64_t g_total_mem = EMU_TOTAL_MEM_DEFAULT;

/* Parses LIBCUDA_EMU_TOTAL_MEM into g_total_mem; 0 when unset or valid. */
static int parse_total_mem(void)
{
    const char *text = getenv("LIBCUDA_EMU_TOTAL_MEM");
    if (!text || !text[0])
        return 0;
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    unsigned shift = 0;
    if (end && (*end == 'K' || *end == 'k'))
        shift = 10, end++;
    else if (end && (*end == 'M' || *end == 'm'))
        shift = 20, end++;
    else if (end && (*end == 'G' || *end == 'g'))
        shift = 30, end++;
    if (errno || end == text || *end || value == 0 || value > (EMU_SPAN >> shift) / 2) {
        emu_msg("LIBCUDA_EMU_TOTAL_MEM=%s is not a size; give bytes, or a number with K, M or G,"
                " above 0 and at most 512G", text);
        return -1;
    }
    g_total_mem = (uint64_t)value << shift;
    return 0;
}

static CUresult init_locked(unsigned flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (g_initialized)
        return CUDA_SUCCESS;
    if (parse_total_mem())
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = mem_init();
    if (r)
        return r;
    if (getenv("LIBCUDA_EMU_SEED"))
        g_seed_base = strtoull(getenv("LIBCUDA_EMU_SEED"), NULL, 0);
    const char *approx = getenv("LIBCUDA_EMU_APPROX");
    if (approx && approx[0] && strcmp(approx, "hash") != 0 && strcmp(approx, "random") != 0 &&
        strcmp(approx, "exact") != 0) {
        emu_msg("LIBCUDA_EMU_APPROX=%s is not a mode; use hash, random or exact", approx);
        return CUDA_ERROR_INVALID_VALUE;
    }
    const char *schedule = getenv("LIBCUDA_EMU_SCHEDULE");
    if (schedule && strcmp(schedule, "late") == 0) {
        g_schedule_late = 1;
    } else if (schedule && strcmp(schedule, "lazy") != 0 && schedule[0]) {
        emu_msg("LIBCUDA_EMU_SCHEDULE=%s is not a schedule; use lazy or late", schedule);
        return CUDA_ERROR_INVALID_VALUE;
    }
    g_initialized = 1;
    return CUDA_SUCCESS;
}

API CUresult cuInit(unsigned int flags) { LOCKED(init_locked(flags)); }

API CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12020;
    return CUDA_SUCCESS;
}

static CUresult check_device(CUdevice dev)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    return dev == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

API CUresult cuDeviceGetCount(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult r = check_device(dev);
    if (r)
        return r;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", EMU_DEVICE_NAME);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult r = check_device(dev);
    if (r)
        return r;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_total_mem;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    CUresult r = check_device(dev);
    if (r)
        return r;
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    *major = 9;
    *minor = 0;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice dev)
{
    static const unsigned char id[16] = {0x72, 0x69, 0x6e, 0x67, 0x74, 0x72, 0x61, 0x69,
                                         0x6e, 0x2d, 0x70, 0x74, 0x78, 0x65, 0x6d, 0x75};
    CUresult r = check_device(dev);
    if (r)
        return r;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(uuid, id, sizeof id);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

API CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev)
{
    CUresult r = check_device(dev);
    if (r)
        return r;
    if (!bus_id || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(bus_id, (size_t)len, "0000:00:00.0");
    return CUDA_SUCCESS;
}

/* H100 SXM values; attributes not listed are reported as 0 (not supported). */
static int device_attribute(int attr, int *value)
{
    switch (attr) {
    case 1: *value = 1024; return 1;          /* MAX_THREADS_PER_BLOCK */
    case 2: *value = 1024; return 1;          /* MAX_BLOCK_DIM_X */
    case 3: *value = 1024; return 1;          /* MAX_BLOCK_DIM_Y */
    case 4: *value = 64; return 1;            /* MAX_BLOCK_DIM_Z */
    case 5: *value = 2147483647; return 1;    /* MAX_GRID_DIM_X */
    case 6: *value = 65535; return 1;         /* MAX_GRID_DIM_Y */
    case 7: *value = 65535; return 1;         /* MAX_GRID_DIM_Z */
    case 8: *value = EMU_SHARED_PER_BLOCK; return 1;
    case 9: *value = 65536; return 1;         /* TOTAL_CONSTANT_MEMORY */
    case 10: *value = 32; return 1;           /* WARP_SIZE */
    case 11: *value = 2147483647; return 1;   /* MAX_PITCH */
    case 12: *value = 65536; return 1;        /* MAX_REGISTERS_PER_BLOCK */
    case 13: *value = 1980000; return 1;      /* CLOCK_RATE (kHz) */
    case 14: *value = 512; return 1;          /* TEXTURE_ALIGNMENT */
    case 15: *value = 1; return 1;            /* GPU_OVERLAP */
    case 16: *value = EMU_SM_COUNT; return 1; /* MULTIPROCESSOR_COUNT */
    case 17: *value = 0; return 1;            /* KERNEL_EXEC_TIMEOUT */
    case 18: *value = 0; return 1;            /* INTEGRATED */
    case 19: *value = 1; return 1;            /* CAN_MAP_HOST_MEMORY */
    case 20: *value = 0; return 1;            /* COMPUTE_MODE default */
    case 30: *value = 512; return 1;          /* SURFACE_ALIGNMENT */
    case 31: *value = 1; return 1;            /* CONCURRENT_KERNELS */
    case 32: *value = 1; return 1;            /* ECC_ENABLED */
    case 33: *value = 0; return 1;            /* PCI_BUS_ID */
    case 34: *value = 0; return 1;            /* PCI_DEVICE_ID */
    case 35: *value = 0; return 1;            /* TCC_DRIVER */
    case 36: *value = 2619000; return 1;      /* MEMORY_CLOCK_RATE (kHz) */
    case 37: *value = 5120; return 1;         /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: *value = 52428800; return 1;     /* L2_CACHE_SIZE */
    case 39: *value = 2048; return 1;         /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: *value = 3; return 1;            /* ASYNC_ENGINE_COUNT */
    case 41: *value = 1; return 1;            /* UNIFIED_ADDRESSING */
    case 50: *value = 0; return 1;            /* PCI_DOMAIN_ID */
    case 75: *value = 9; return 1;            /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; return 1;            /* COMPUTE_CAPABILITY_MINOR */
    case 78: *value = 1; return 1;            /* STREAM_PRIORITIES_SUPPORTED */
    case 79: *value = 1; return 1;            /* GLOBAL_L1_CACHE_SUPPORTED */
    case 80: *value = 1; return 1;            /* LOCAL_L1_CACHE_SUPPORTED */
    case 81: *value = 233472; return 1;       /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: *value = 65536; return 1;        /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: *value = 0; return 1;            /* MANAGED_MEMORY (not emulated) */
    case 84: *value = 0; return 1;            /* MULTI_GPU_BOARD */
    case 87: *value = 2; return 1;            /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    case 90: *value = 1; return 1;            /* COMPUTE_PREEMPTION_SUPPORTED */
    case 95: *value = 1; return 1;            /* COOPERATIVE_LAUNCH */
    case 97: *value = EMU_SHARED_PER_BLOCK_OPTIN; return 1;
    case 99: *value = 1; return 1;            /* HOST_REGISTER_SUPPORTED */
    case 106: *value = 32; return 1;          /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 111: *value = 1024; return 1;        /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    default:
        if (attr >= 1 && attr < 120) {
            *value = 0;
            return 1;
        }
        return 0;
    }
}

API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    CUresult r = check_device(dev);
    if (r)
        return r;
    if (!pi || !device_attribute(attrib, pi))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Contexts                                                                 */
/* ------------------------------------------------------------------------ */

static int valid_ctx(CUcontext c) { return c && c->magic == MAGIC_CTX; }

static CUresult ctx_push(CUcontext c)
{
    if (t_ctx_depth >= (int)(sizeof t_ctx_stack / sizeof t_ctx_stack[0]))
        return CUDA_ERROR_INVALID_VALUE;
    t_ctx_stack[t_ctx_depth++] = c;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    lock();
    CUresult r = check_device(dev);
    if (!r && !pctx)
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        g_primary_refs++;
        *pctx = &g_primary;
    }
    unlock();
    return r;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    lock();
    CUresult r = check_device(dev);
    if (!r && g_primary_refs <= 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (!r)
        g_primary_refs--;
    unlock();
    return r;
}

API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    lock();
    CUresult r = check_device(dev);
    if (!r)
        r = run_all();
    unlock();
    return r;
}

API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    lock();
    CUresult r = check_device(dev);
    if (!r)
        g_primary.flags = flags;
    unlock();
    return r;
}

API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    lock();
    CUresult r = check_device(dev);
    if (!r && (!flags || !active))
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        *flags = g_primary.flags;
        *active = g_primary_refs > 0;
    }
    unlock();
    return r;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    lock();
    CUresult r = check_device(dev);
    if (!r && !pctx)
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        struct emu_ctx *c = calloc(1, sizeof *c);
        if (!c) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            c->magic = MAGIC_CTX;
            c->flags = flags;
            r = ctx_push(c);
            if (r)
                free(c);
            else
                *pctx = c;
        }
    }
    unlock();
    return r;
}

API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    lock();
    CUresult r = valid_ctx(ctx) && !ctx->primary ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (!r) {
        r = run_all();
        for (int i = 0; i < t_ctx_depth; i++)
            if (t_ctx_stack[i] == ctx) {
                memmove(&t_ctx_stack[i], &t_ctx_stack[i + 1], sizeof(CUcontext) * (size_t)(t_ctx_depth - i - 1));
                t_ctx_depth--;
                i--;
            }
        ctx->magic = 0;
        free(ctx);
    }
    unlock();
    return r;
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL) {
        if (t_ctx_depth > 0)
            t_ctx_depth--;
        return CUDA_SUCCESS;
    }
    if (!valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth == 0)
        return ctx_push(ctx);
    t_ctx_stack[t_ctx_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return ctx_push(ctx);
}

API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (t_ctx_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_ctx_stack[--t_ctx_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *device)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = 0;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    if (ctx && !valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctx && !current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetFlags(unsigned int *flags)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = current_ctx()->flags;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    LOCKED(run_all());
}

API CUresult cuCtxGetLimit(size_t *value, int limit)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    switch (limit) {
    case 0: *value = 1024; return CUDA_SUCCESS;            /* STACK_SIZE */
    case 1: *value = 1048576; return CUDA_SUCCESS;         /* PRINTF_FIFO_SIZE */
    case 2: *value = 8388608; return CUDA_SUCCESS;         /* MALLOC_HEAP_SIZE */
    case 3: *value = 2; return CUDA_SUCCESS;               /* DEV_RUNTIME_SYNC_DEPTH */
    case 4: *value = 2048; return CUDA_SUCCESS;            /* DEV_RUNTIME_PENDING_LAUNCH_COUNT */
    case 5: *value = 32; return CUDA_SUCCESS;              /* MAX_L2_FETCH_GRANULARITY */
    case 6: *value = 0; return CUDA_SUCCESS;               /* PERSISTING_L2_CACHE_SIZE */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

API CUresult cuCtxSetLimit(int limit, size_t value)
{
    CUresult r = need_ctx();
    (void)value;
    if (r)
        return r;
    return limit >= 0 && limit <= 6 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuCtxGetCacheConfig(int *config)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    *config = 0;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCacheConfig(int config)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    return config >= 0 && config <= 3 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuCtxGetSharedMemConfig(int *config)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    *config = 1; /* four-byte banks */
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetSharedMemConfig(int config)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    return config >= 0 && config <= 2 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (least)
        *least = 0;
    if (greatest)
        *greatest = -5;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Memory                                                                   */
/* ------------------------------------------------------------------------ */

static CUresult mem_alloc_locked(CUdeviceptr *dptr, size_t bytes)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (bytes > g_total_mem - g_allocated)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t need = (bytes + EMU_PAGE - 1) / EMU_PAGE * EMU_PAGE + EMU_GUARD;
    /* first fit; offset 0 is left unused so that no device pointer equals the base */
    uint64_t at = EMU_GUARD;
    size_t pos = 0;
    for (; pos < g_nallocs; pos++) {
        if (g_allocs[pos].off >= at + need)
            break;
        at = g_allocs[pos].off + g_allocs[pos].reserved;
    }
    if (at + need > EMU_SPAN)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (g_nallocs == g_cap_allocs) {
        size_t cap = g_cap_allocs ? 2 * g_cap_allocs : 64;
        struct emu_alloc *p = realloc(g_allocs, cap * sizeof *p);
        if (!p)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_allocs = p;
        g_cap_allocs = cap;
    }
    memmove(&g_allocs[pos + 1], &g_allocs[pos], (g_nallocs - pos) * sizeof *g_allocs);
    g_allocs[pos].off = at;
    g_allocs[pos].size = bytes;
    g_allocs[pos].reserved = need;
    g_nallocs++;
    g_allocated += bytes;
    if (g_fill_byte >= 0 && bytes <= EMU_FILL_LIMIT)
        memset(g_mem + at, g_fill_byte, bytes);
    notify_alloc(&g_allocs[pos]);
    *dptr = EMU_DEV_BASE + at;
    return CUDA_SUCCESS;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) { LOCKED(mem_alloc_locked(dptr, bytes)); }

static CUresult mem_free_locked(CUdeviceptr dptr)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (dptr == 0)
        return CUDA_SUCCESS;
    long i = find_alloc(dptr);
    if (i < 0 || EMU_DEV_BASE + g_allocs[i].off != dptr) {
        emu_msg("cuMemFree: %#llx is not the start of a live allocation", dptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    r = run_all();
    struct emu_alloc a = g_allocs[i];
    if (g_sock >= 0) {
        uint64_t msg = dptr;
        server_simple(SRV_FREE, &msg, sizeof msg, "unregistering an allocation");
    }
    memmove(&g_allocs[i], &g_allocs[i + 1], (g_nallocs - (size_t)i - 1) * sizeof *g_allocs);
    g_nallocs--;
    g_allocated -= a.size;
#ifdef FALLOC_FL_PUNCH_HOLE
    {
        uint64_t len = (a.size + EMU_PAGE - 1) / EMU_PAGE * EMU_PAGE;
        if (fallocate(g_mem_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a.off, (off_t)len) != 0)
            memset(g_mem + a.off, 0, a.size);
    }
#endif
    return r;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) { LOCKED(mem_free_locked(dptr)); }

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    lock();
    if (free_bytes)
        *free_bytes = g_total_mem - g_allocated;
    if (total)
        *total = g_total_mem;
    unlock();
    return CUDA_SUCCESS;
}

API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    lock();
    long i = find_alloc(dptr);
    if (i >= 0) {
        if (base)
            *base = EMU_DEV_BASE + g_allocs[i].off;
        if (size)
            *size = g_allocs[i].size;
    }
    unlock();
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* Host memory ("pinned" memory is ordinary host memory here). */

static CUresult host_add(void *p, size_t size, int owned)
{
    for (size_t i = 0; i < g_nhost; i++) {
        char *a = g_host[i].ptr, *b = p;
        if (b < a + g_host[i].size && a < b + size)
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    if (g_nhost == g_cap_host) {
        size_t cap = g_cap_host ? 2 * g_cap_host : 16;
        struct host_range *n = realloc(g_host, cap * sizeof *n);
        if (!n)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_host = n;
        g_cap_host = cap;
    }
    g_host[g_nhost].ptr = p;
    g_host[g_nhost].size = size;
    g_host[g_nhost].owned = owned;
    g_nhost++;
    return CUDA_SUCCESS;
}

static long host_find(void *p, int owned)
{
    for (size_t i = 0; i < g_nhost; i++)
        if (g_host[i].ptr == p && g_host[i].owned == owned)
            return (long)i;
    return -1;
}

static void host_remove(long i)
{
    g_host[i] = g_host[g_nhost - 1];
    g_nhost--;
}

static CUresult host_alloc_locked(void **pp, size_t bytes)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!pp || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = NULL;
    if (posix_memalign(&p, EMU_PAGE, bytes) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = host_add(p, bytes, 1);
    if (r) {
        free(p);
        return r;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

API CUresult cuMemAllocHost_v2(void **pp, size_t bytes) { LOCKED(host_alloc_locked(pp, bytes)); }

API CUresult cuMemHostAlloc(void **pp, size_t bytes, unsigned int flags)
{
    (void)flags; /* portable / mapped / write-combined: all plain host memory here */
    LOCKED(host_alloc_locked(pp, bytes));
}

static CUresult host_free_locked(void *p)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    long i = host_find(p, 1);
    if (i < 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = run_all(); /* queued copies may still use it */
    host_remove(i);
    free(p);
    return r;
}

API CUresult cuMemFreeHost(void *p) { LOCKED(host_free_locked(p)); }

static CUresult host_register_locked(void *p, size_t bytes)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!p || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return host_add(p, bytes, 0);
}

API CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned int flags)
{
    (void)flags;
    LOCKED(host_register_locked(p, bytes));
}

API CUresult cuMemHostRegister(void *p, size_t bytes, unsigned int flags) { return cuMemHostRegister_v2(p, bytes, flags); }

static CUresult host_unregister_locked(void *p)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    long i = host_find(p, 0);
    if (i < 0)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    r = run_blocking();
    host_remove(i);
    return r;
}

API CUresult cuMemHostUnregister(void *p) { LOCKED(host_unregister_locked(p)); }

API CUresult cuMemHostGetFlags(unsigned int *flags, void *p)
{
    lock();
    long i = host_find(p, 1);
    unlock();
    if (i < 0 || !flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    return CUDA_SUCCESS;
}

/* Copies and memsets: queued entries; the synchronous calls drain then run one. */

static CUresult queue_copy(const char *call, enum op_kind kind, CUdeviceptr dst, CUdeviceptr src, void *host,
                           const void *host_src, size_t bytes, CUstream h, int sync)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (bytes == 0)
        return CUDA_SUCCESS;
    if (kind != OP_COPY_DTOH && (r = check_range(call, "destination", dst, bytes)))
        return r;
    if (kind == OP_COPY_DTOH && (r = check_range(call, "source", src, bytes)))
        return r;
    if (kind == OP_COPY_DTOD && (r = check_range(call, "source", src, bytes)))
        return r;
    if ((kind == OP_COPY_HTOD && !host_src) || (kind == OP_COPY_DTOH && !host))
        return CUDA_ERROR_INVALID_VALUE;
    struct emu_op *op = new_op(kind);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->u.copy.dev = kind == OP_COPY_DTOH ? src : dst;
    op->u.copy.dev_src = src;
    op->u.copy.host = host;
    op->u.copy.host_src = host_src;
    op->u.copy.bytes = bytes;
    if (sync) {
        r = run_blocking();
        CUresult r2 = exec_op(&g_legacy, op);
        free_op(op);
        return r ? r : r2;
    }
    enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    LOCKED(queue_copy("cuMemcpyHtoD", OP_COPY_HTOD, dst, 0, NULL, src, n, NULL, 1));
}
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    LOCKED(queue_copy("cuMemcpyDtoH", OP_COPY_DTOH, 0, src, dst, NULL, n, NULL, 1));
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    LOCKED(queue_copy("cuMemcpyDtoD", OP_COPY_DTOD, dst, src, NULL, NULL, n, NULL, 1));
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    LOCKED(queue_copy("cuMemcpyHtoDAsync", OP_COPY_HTOD, dst, 0, NULL, src, n, s, 0));
}
API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    LOCKED(queue_copy("cuMemcpyDtoHAsync", OP_COPY_DTOH, 0, src, dst, NULL, n, s, 0));
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    LOCKED(queue_copy("cuMemcpyDtoDAsync", OP_COPY_DTOD, dst, src, NULL, NULL, n, s, 0));
}

static int is_device(CUdeviceptr p) { return p >= EMU_DEV_BASE && p < EMU_DEV_BASE + EMU_SPAN; }

/* Unified-addressing copies: the direction follows from the addresses. */
static CUresult copy_unified(const char *call, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, int sync)
{
    if (is_device(dst) && is_device(src))
        return queue_copy(call, OP_COPY_DTOD, dst, src, NULL, NULL, n, s, sync);
    if (is_device(dst))
        return queue_copy(call, OP_COPY_HTOD, dst, 0, NULL, (const void *)(uintptr_t)src, n, s, sync);
    if (is_device(src))
        return queue_copy(call, OP_COPY_DTOH, 0, src, (void *)(uintptr_t)dst, NULL, n, s, sync);
    CUresult r = need_ctx();
    if (r)
        return r;
    if (sync)
        r = run_blocking();
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n); /* host to host */
    return r;
}

API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { LOCKED(copy_unified("cuMemcpy", dst, src, n, NULL, 1)); }
API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    LOCKED(copy_unified("cuMemcpyAsync", dst, src, n, s, 0));
}

static CUresult queue_memset(const char *call, CUdeviceptr dst, uint32_t value, unsigned elem, size_t count,
                             CUstream h, int sync)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (count == 0)
        return CUDA_SUCCESS;
    if (dst % elem != 0) {
        emu_msg("%s: destination %#llx is not %u-byte aligned", call, dst, elem);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((r = check_range(call, "destination", dst, count * elem)))
        return r;
    struct emu_op *op = new_op(OP_MEMSET);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->u.memset.dev = dst;
    op->u.memset.value = value;
    op->u.memset.elem = elem;
    op->u.memset.count = count;
    if (sync) {
        r = run_blocking();
        CUresult r2 = exec_op(&g_legacy, op);
        free_op(op);
        return r ? r : r2;
    }
    enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { LOCKED(queue_memset("cuMemsetD8", d, v, 1, n, NULL, 1)); }
API CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { LOCKED(queue_memset("cuMemsetD16", d, v, 2, n, NULL, 1)); }
API CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { LOCKED(queue_memset("cuMemsetD32", d, v, 4, n, NULL, 1)); }
API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s)
{
    LOCKED(queue_memset("cuMemsetD8Async", d, v, 1, n, s, 0));
}
API CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s)
{
    LOCKED(queue_memset("cuMemsetD16Async", d, v, 2, n, s, 0));
}
API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s)
{
    LOCKED(queue_memset("cuMemsetD32Async", d, v, 4, n, s, 0));
}

/* ------------------------------------------------------------------------ */
/* Streams                                                                  */
/* ------------------------------------------------------------------------ */

static CUresult stream_create_locked(CUstream *ph, unsigned flags, int priority)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!ph || (flags & ~CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct emu_stream *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = MAGIC_STREAM;
    s->flags = flags;
    s->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
    s->next_all = g_streams;
    g_streams = s;
    *ph = s;
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreate(CUstream *ph, unsigned int flags) { LOCKED(stream_create_locked(ph, flags, 0)); }
API CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int priority)
{
    LOCKED(stream_create_locked(ph, flags, priority));
}

static CUresult stream_destroy_locked(CUstream h)
{
    CUresult r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (s == &g_legacy)
        return CUDA_ERROR_INVALID_HANDLE;
    r = run_stream(s); /* its queued work still completes */
    /* waits queued elsewhere on this stream's records are satisfied now */
    for (struct emu_stream *o = g_streams; o; o = o->next_all)
        for (struct emu_op *op = o->head; op; op = op->next)
            if (op->kind == OP_WAIT && op->u.wait.stream == s)
                op->u.wait.stream = NULL;
    for (struct emu_event *e = g_events; e; e = e->next_all)
        if (e->stream == s)
            e->stream = NULL;
    for (struct emu_stream **pp = &g_streams; *pp; pp = &(*pp)->next_all)
        if (*pp == s) {
            *pp = s->next_all;
            break;
        }
    s->magic = 0;
    free(s);
    return r;
}

API CUresult cuStreamDestroy_v2(CUstream h) { LOCKED(stream_destroy_locked(h)); }
API CUresult cuStreamDestroy(CUstream h) { return cuStreamDestroy_v2(h); }

static CUresult stream_sync_locked(CUstream h)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    r = run_others_first(s);
    CUresult r2 = run_stream(s);
    return r ? r : r2;
}

API CUresult cuStreamSynchronize(CUstream h) { LOCKED(stream_sync_locked(h)); }

static CUresult stream_query_locked(CUstream h)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (!s->head)
        return CUDA_SUCCESS;
    r = run_others_first(s);
    CUresult r2 = run_stream(s);
    return r ? r : r2 ? r2 : CUDA_ERROR_NOT_READY;
}

API CUresult cuStreamQuery(CUstream h) { LOCKED(stream_query_locked(h)); }

static CUresult stream_flags_locked(CUstream h, unsigned *flags, int *priority)
{
    CUresult r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (flags)
        *flags = s->flags;
    if (priority)
        *priority = s->priority;
    return CUDA_SUCCESS;
}

API CUresult cuStreamGetFlags(CUstream h, unsigned int *flags)
{
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    LOCKED(stream_flags_locked(h, flags, NULL));
}

API CUresult cuStreamGetPriority(CUstream h, int *priority)
{
    if (!priority)
        return CUDA_ERROR_INVALID_VALUE;
    LOCKED(stream_flags_locked(h, NULL, priority));
}

API CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx)
{
    CUresult r;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    lock();
    resolve_stream(h, &r);
    unlock();
    if (!r)
        *pctx = current_ctx() ? current_ctx() : &g_primary;
    return r;
}

static int valid_event(CUevent e)
{
    for (struct emu_event *x = g_events; x; x = x->next_all)
        if (x == e && e->magic == MAGIC_EVENT)
            return 1;
    return 0;
}

static CUresult stream_wait_locked(CUstream h, CUevent e, unsigned flags)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (!valid_event(e))
        return CUDA_ERROR_INVALID_HANDLE;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!e->recorded || e->done || !e->stream)
        return CUDA_SUCCESS; /* nothing to wait for */
    struct emu_op *op = new_op(OP_WAIT);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->u.wait.stream = e->stream;
    op->u.wait.seq = e->seq;
    enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned int flags) { LOCKED(stream_wait_locked(h, e, flags)); }

static CUresult host_fn_locked(CUstream h, CUhostFn fn, void *data)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    struct emu_op *op = new_op(OP_HOSTFN);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->u.hostfn.fn = fn;
    op->u.hostfn.data = data;
    enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void *data) { LOCKED(host_fn_locked(h, fn, data)); }

/* ------------------------------------------------------------------------ */
/* Events                                                                   */
/* ------------------------------------------------------------------------ */

static CUresult event_create_locked(CUevent *ph, unsigned flags)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!ph || (flags & ~0xFu))
        return CUDA_ERROR_INVALID_VALUE;
    struct emu_event *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = flags;
    e->next_all = g_events;
    g_events = e;
    *ph = e;
    return CUDA_SUCCESS;
}

API CUresult cuEventCreate(CUevent *ph, unsigned int flags) { LOCKED(event_create_locked(ph, flags)); }

static CUresult event_destroy_locked(CUevent e)
{
    if (!valid_event(e))
        return CUDA_ERROR_INVALID_HANDLE;
    for (struct emu_stream *s = g_streams; s; s = s->next_all)
        for (struct emu_op *op = s->head; op; op = op->next)
            if (op->kind == OP_RECORD && op->u.record.event == e)
                op->u.record.event = NULL;
    for (struct emu_event **pp = &g_events; *pp; pp = &(*pp)->next_all)
        if (*pp == e) {
            *pp = e->next_all;
            break;
        }
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent e) { LOCKED(event_destroy_locked(e)); }
API CUresult cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }

static CUresult event_record_locked(CUevent e, CUstream h)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (!valid_event(e))
        return CUDA_ERROR_INVALID_HANDLE;
    struct emu_op *op = new_op(OP_RECORD);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->u.record.event = e;
    e->recorded = 1;
    e->done = 0;
    e->stream = s;
    e->seq = op->seq;
    enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent e, CUstream h) { LOCKED(event_record_locked(e, h)); }
API CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned int flags)
{
    if (flags & ~0x1u)
        return CUDA_ERROR_INVALID_VALUE;
    LOCKED(event_record_locked(e, h));
}

static CUresult event_run_locked(CUevent e, int query)
{
    if (!valid_event(e))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded || e->done || !e->stream)
        return CUDA_SUCCESS;
    struct emu_stream *s = e->stream;
    uint64_t seq = e->seq;
    CUresult r = run_others_first(s);
    CUresult r2 = run_until(s, seq);
    if (r || r2)
        return r ? r : r2;
    return query ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

API CUresult cuEventQuery(CUevent e) { LOCKED(event_run_locked(e, 1)); }
API CUresult cuEventSynchronize(CUevent e) { LOCKED(event_run_locked(e, 0)); }

static CUresult elapsed_locked(float *ms, CUevent start, CUevent end)
{
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_event(start) || !valid_event(end))
        return CUDA_ERROR_INVALID_HANDLE;
    if ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!start->recorded || !end->recorded)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!start->done || !end->done)
        return CUDA_ERROR_NOT_READY;
    double d = (double)(end->when.tv_sec - start->when.tv_sec) * 1e3 +
               (double)(end->when.tv_nsec - start->when.tv_nsec) / 1e6;
    if (d >= 0 && d < 1e-3)
        d = 1e-3;
    if (d < 0 && d > -1e-3)
        d = -1e-3;
    *ms = (float)d;
    return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) { LOCKED(elapsed_locked(ms, start, end)); }

/* ------------------------------------------------------------------------ */
/* Modules and launches                                                     */
/* ------------------------------------------------------------------------ */

static CUresult module_load_locked(CUmodule *pm, const void *image)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!pm || !image)
        return CUDA_ERROR_INVALID_VALUE;
    const char *text = image;
    size_t len = strlen(text);
    if (len >= 4 && memcmp(text, "\x7f" "ELF", 4) == 0) {
        emu_msg("cuModuleLoadData: cubin / ELF images are not emulated; pass PTX text");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    if ((r = server_start()))
        return r;
    char *reply = NULL;
    uint32_t reply_len = 0;
    int st = server_call(SRV_LOAD, text, len, NULL, 0, &reply, &reply_len);
    if (st != 0) {
        if (st > 0)
            emu_msg("cuModuleLoadData: %s", reply);
        free(reply);
        return st > 0 ? CUDA_ERROR_INVALID_PTX : CUDA_ERROR_OPERATING_SYSTEM;
    }
    struct emu_module *m = calloc(1, sizeof *m);
    if (!m || reply_len < 4) {
        free(m);
        free(reply);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->magic = MAGIC_MODULE;
    memcpy(&m->server_id, reply, 4);
    free(reply);
    *pm = m;
    return CUDA_SUCCESS;
}

API CUresult cuModuleLoadData(CUmodule *pm, const void *image) { LOCKED(module_load_locked(pm, image)); }

API CUresult cuModuleLoadDataEx(CUmodule *pm, const void *image, unsigned int n, int *options, void **values)
{
    /* JIT options (optimization level, register limits, log buffers) do not apply */
    (void)n;
    (void)options;
    (void)values;
    LOCKED(module_load_locked(pm, image));
}

static CUresult module_unload_locked(CUmodule m)
{
    if (!m || m->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = run_all(); /* queued launches of its kernels must run first */
    server_simple(SRV_UNLOAD, &m->server_id, 4, "cuModuleUnload");
    for (struct emu_function *f = m->functions, *next; f; f = next) {
        next = f->next_in_module;
        f->magic = 0;
        free(f->sizes);
        free(f->name);
        free(f);
    }
    m->magic = 0;
    free(m);
    return r;
}

API CUresult cuModuleUnload(CUmodule m) { LOCKED(module_unload_locked(m)); }

static CUresult get_function_locked(CUfunction *pf, CUmodule m, const char *name)
{
    if (!pf || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    for (struct emu_function *f = m->functions; f; f = f->next_in_module)
        if (strcmp(f->name, name) == 0) {
            *pf = f;
            return CUDA_SUCCESS;
        }
    char *reply = NULL;
    uint32_t len = 0;
    int st = server_call(SRV_GETFN, &m->server_id, 4, name, strlen(name), &reply, &len);
    if (st != 0) {
        if (st == 1)
            emu_msg("cuModuleGetFunction(%s): %s", name, reply);
        free(reply);
        return st == 2 ? CUDA_ERROR_NOT_FOUND : st == 1 ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OPERATING_SYSTEM;
    }
    uint32_t head[4];
    if (len < sizeof head) {
        free(reply);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    memcpy(head, reply, sizeof head);
    struct emu_function *f = calloc(1, sizeof *f);
    if (!f || len < sizeof head + 4 * (size_t)head[3]) {
        free(f);
        free(reply);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    f->magic = MAGIC_FUNCTION;
    f->module = m;
    f->server_id = head[0];
    f->static_shared = head[1];
    f->max_threads = head[2];
    f->nparams = head[3];
    f->sizes = calloc(f->nparams + 1, sizeof *f->sizes);
    f->name = strdup(name);
    if (!f->sizes || !f->name) {
        free(f->sizes);
        free(f->name);
        free(f);
        free(reply);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memcpy(f->sizes, reply + sizeof head, 4 * (size_t)f->nparams);
    free(reply);
    f->max_dynamic_shared = EMU_SHARED_PER_BLOCK - (int)f->static_shared;
    if (f->max_dynamic_shared < 0)
        f->max_dynamic_shared = 0;
    f->next_in_module = m->functions;
    m->functions = f;
    *pf = f;
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(CUfunction *pf, CUmodule m, const char *name) { LOCKED(get_function_locked(pf, m, name)); }

static int valid_function(CUfunction f) { return f && f->magic == MAGIC_FUNCTION; }

API CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f)
{
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    lock();
    int ok = valid_function(f);
    unlock();
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    switch (attrib) {
    case 0: *pi = (int)f->max_threads; break;    /* MAX_THREADS_PER_BLOCK */
    case 1: *pi = (int)f->static_shared; break;  /* SHARED_SIZE_BYTES */
    case 2: *pi = 0; break;                      /* CONST_SIZE_BYTES */
    case 3: *pi = 0; break;                      /* LOCAL_SIZE_BYTES */
    case 4: *pi = 32; break;                     /* NUM_REGS (not known: a typical value) */
    case 5: *pi = 80; break;                     /* PTX_VERSION */
    case 6: *pi = 90; break;                     /* BINARY_VERSION */
    case 7: *pi = 0; break;                      /* CACHE_MODE_CA */
    case 8: *pi = f->max_dynamic_shared; break;  /* MAX_DYNAMIC_SHARED_SIZE_BYTES */
    case 9: *pi = -1; break;                     /* PREFERRED_SHARED_MEMORY_CARVEOUT */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

API CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value)
{
    CUresult r = CUDA_SUCCESS;
    lock();
    if (!valid_function(f))
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (attrib == 8) {
        if (value < 0 || value + (int)f->static_shared > EMU_SHARED_PER_BLOCK_OPTIN)
            r = CUDA_ERROR_INVALID_VALUE;
        else
            f->max_dynamic_shared = value;
    } else if (attrib == 9) {
        r = value >= -1 && value <= 100 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    } else {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    unlock();
    return r;
}

API CUresult cuFuncSetCacheConfig(CUfunction f, int config)
{
    (void)config;
    return valid_function(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuFuncSetSharedMemConfig(CUfunction f, int config)
{
    (void)config;
    return valid_function(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, CUfunction f, int block_size, size_t dyn_shared)
{
    if (!blocks || block_size <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f))
        return CUDA_ERROR_INVALID_HANDLE;
    int warps = (block_size + 31) / 32;
    int n = 64 / warps; /* 64 resident warps per SM */
    if (n > 32)
        n = 32;
    size_t shared = f->static_shared + dyn_shared + 1024;
    if (shared > 0 && (size_t)n * shared > 233472)
        n = (int)(233472 / shared);
    if ((unsigned)block_size > f->max_threads)
        n = 0;
    *blocks = n;
    return CUDA_SUCCESS;
}

static CUresult launch_locked(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned shared,
                              CUstream h, void **params, void **extra)
{
    CUresult r = need_ctx();
    if (r)
        return r;
    if (!valid_function(f))
        return CUDA_ERROR_INVALID_HANDLE;
    struct emu_stream *s = resolve_stream(h, &r);
    if (r)
        return r;
    if (extra) {
        emu_msg("cuLaunchKernel(%s): parameters passed through 'extra' are not emulated", f->name);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || block[0] == 0 || block[1] == 0 || block[2] == 0 ||
        grid[1] > 65535 || grid[2] > 65535 || grid[0] > 2147483647u || block[0] > 1024 || block[1] > 1024 ||
        block[2] > 64 || threads > 1024) {
        emu_msg("cuLaunchKernel(%s): invalid grid (%u,%u,%u) or block (%u,%u,%u)", f->name, grid[0], grid[1],
                grid[2], block[0], block[1], block[2]);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (threads > f->max_threads) {
        emu_msg("cuLaunchKernel(%s): %llu threads per block, the kernel allows %u", f->name, threads, f->max_threads);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((int)shared > f->max_dynamic_shared) {
        emu_msg("cuLaunchKernel(%s): %u bytes of dynamic shared memory, at most %d allowed", f->name, shared,
                f->max_dynamic_shared);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (f->nparams > 0 && !params)
        return CUDA_ERROR_INVALID_VALUE;
    size_t nbytes = 0;
    for (unsigned i = 0; i < f->nparams; i++)
        nbytes += f->sizes[i];
    struct emu_op *op = new_op(OP_KERNEL);
    unsigned char *blob = malloc(nbytes + 1);
    if (!op || !blob) {
        free(op);
        free(blob);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t at = 0;
    for (unsigned i = 0; i < f->nparams; i++) {
        if (!params[i]) {
            free(op);
            free(blob);
            return CUDA_ERROR_INVALID_VALUE;
        }
        memcpy(blob + at, params[i], f->sizes[i]);
        at += f->sizes[i];
    }
    op->u.kernel.fn = f;
    memcpy(op->u.kernel.grid, grid, sizeof op->u.kernel.grid);
    memcpy(op->u.kernel.block, block, sizeof op->u.kernel.block);
    op->u.kernel.shared = shared;
    op->u.kernel.seed = g_seed_base + g_launches++;
    op->u.kernel.nbytes = nbytes;
    op->u.kernel.params = blob;
    enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                            unsigned int by, unsigned int bz, unsigned int shared, CUstream h, void **params,
                            void **extra)
{
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    LOCKED(launch_locked(f, grid, block, shared, h, params, extra));
}

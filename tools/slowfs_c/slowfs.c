/*
 * slowfs-c: a read-only passthrough FUSE mount that behaves like a slow remote volume.
 *
 * The C twin of tools/slowfs.py (same command line, same semantics, same .slowfs_stats
 * JSON), written on the libfuse3 low-level API so that the emulator itself costs a few
 * microseconds of CPU per operation instead of the Python emulator's ~25+.  See README.md beside this
 * file for the semantics, the accuracy measurements and how the benchmark uses it.
 *
 *   slowfs-c SOURCE MOUNTPOINT [--latency-us N] [--threads N] [--cache-timeout S]
 *            [--bandwidth-mb-s MB] [--fail GLOB=ERRNO ...] [--fail-read GLOB=ERRNO ...]
 *            [--foreground] [--log-file PATH] [--clone-fd]
 *
 * Every remote operation (lookup, getattr, readlink, statfs, opendir's listing, open,
 * read) sleeps --latency-us in the libfuse worker thread that serves it, before it touches
 * SOURCE; libfuse starts up to --threads workers, so concurrent operations overlap their
 * delays the way round trips to a real remote do.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 312

#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ROOT_INO FUSE_ROOT_ID          /* 1 */
#define STATS_INO (ROOT_INO + 1)       /* the virtual statistics file */
#define STATS_NAME ".slowfs_stats"
/* A file's inode number is its source st_ino shifted past the root and the stats file
 * (as tools/slowfs.py does), so it keeps its number for the life of the mount even after
 * the kernel forgets it.  Files on another filesystem below SOURCE, or with a huge st_ino,
 * are numbered from FOREIGN_INODES on, never reused. */
#define INODE_SHIFT STATS_INO
#define FOREIGN_INODES (UINT64_C(1) << 62)
/* Remote operations in progress at once (libfuse worker threads): a DataLoader's workers,
 * cubefs-fuse's 32 backend threads and a peer's downloads together stay below it; a
 * sleeping thread costs only its stack. */
#define DEFAULT_THREADS 128
/* How long the detaching parent waits for the daemon's mount (mounting takes ~10 ms). */
#define READY_TIMEOUT_MS 30000
/* Weight 1/32 of a new sample in the running mean of clock_nanosleep's overshoot (as in
 * tools/slowfs.py): averages over the last ~32 delays, follows load changes within a
 * fraction of a second, one late wake-up barely moves it. */
#define OVERSLEEP_DIVISOR 32
/* Errno values counted per operation; Linux's largest is EHWPOISON (133). */
#define ERRNO_SLOTS 256
#define NS_PER_S INT64_C(1000000000)

/* -- options ------------------------------------------------------------------------ */

struct rule {
    char *pattern;
    int errnum;
};

static struct {
    const char *source;
    const char *mount_point;
    double latency_us;
    int64_t latency_ns;
    unsigned threads;
    double cache_timeout;
    double bandwidth_mb_s;
    int foreground;
    const char *log_file;
    int ready_fd;
    int clone_fd;
    struct rule *fail_open;
    size_t n_fail_open;
    struct rule *fail_read;
    size_t n_fail_read;
} opt = {.threads = DEFAULT_THREADS, .ready_fd = -1};

static int root_fd = -1;
static dev_t root_dev;
static ino_t root_ino;

/* -- statistics --------------------------------------------------------------------- */

enum op { OP_GETATTR, OP_LOOKUP, OP_OPEN, OP_READ, OP_READDIR, OP_READLINK, OP_RELEASE, OP_STATFS, N_OPS };
/* In alphabetical order, so that the JSON's keys come out sorted as Python's sort_keys. */
static const char *const op_names[N_OPS] = {
    "getattr", "lookup", "open", "read", "readdir", "readlink", "release", "statfs",
};

static struct {
    atomic_uint_fast64_t ops[N_OPS];
    atomic_uint_fast64_t injected[N_OPS];
    atomic_uint_fast64_t errors[N_OPS][ERRNO_SLOTS];
    atomic_uint_fast64_t bytes_read;
    atomic_int concurrent;
    atomic_int max_concurrent;
    atomic_int sleeping;
    atomic_int max_sleeping;
    atomic_long open_files;
    atomic_int_fast64_t oversleep_ns; /* running mean of how far a sleep overshoots its request */
    pthread_mutex_t delay_lock;       /* guards the three below */
    uint64_t delay_count;
    double delay_total_ns;
    int64_t delay_max_ns;
} stats = {.delay_lock = PTHREAD_MUTEX_INITIALIZER};

static void atomic_max(atomic_int *target, int value)
{
    int current = atomic_load_explicit(target, memory_order_relaxed);
    while (value > current && !atomic_compare_exchange_weak(target, &current, value))
        ;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * NS_PER_S + ts.tv_nsec;
}

static void sleep_until(int64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = deadline_ns / NS_PER_S, .tv_nsec = deadline_ns % NS_PER_S};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static void log_line(const char *fmt, ...)
{
    char when[32];
    time_t t = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime_r(&t, &tm));
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s slowfs-c: ", when);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* -- the latency and the bandwidth cap ------------------------------------------------ */

static __thread int slack_set;

/* Block the calling worker thread for the latency.  The sleep is an absolute
 * clock_nanosleep with the thread's timer slack at 1 ns; the request is shortened by the
 * running mean of the measured overshoot (the wake-up latency), so the mean delay
 * converges to the setting. */
static void delay_wait(void)
{
    if (opt.latency_ns <= 0)
        return;
    if (!slack_set) {
        prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); /* 1 ns; default 50 us */
        slack_set = 1;
    }
    atomic_max(&stats.max_sleeping, atomic_fetch_add(&stats.sleeping, 1) + 1);
    int64_t over = atomic_load_explicit(&stats.oversleep_ns, memory_order_relaxed);
    int64_t request = opt.latency_ns - (over > 0 ? over : 0);
    if (request < 0)
        request = 0;
    int64_t start = now_ns();
    if (request > 0)
        sleep_until(start + request);
    int64_t elapsed = now_ns() - start;
    atomic_fetch_sub(&stats.sleeping, 1);
    pthread_mutex_lock(&stats.delay_lock);
    over = atomic_load_explicit(&stats.oversleep_ns, memory_order_relaxed);
    over += (elapsed - request - over) / OVERSLEEP_DIVISOR;
    atomic_store_explicit(&stats.oversleep_ns, over, memory_order_relaxed);
    stats.delay_count++;
    stats.delay_total_ns += (double)elapsed;
    if (elapsed > stats.delay_max_ns)
        stats.delay_max_ns = elapsed;
    pthread_mutex_unlock(&stats.delay_lock);
}

static pthread_mutex_t link_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t link_free_at; /* CLOCK_MONOTONIC ns at which the link has sent its queued bytes */

/* The shared link of --bandwidth-mb-s: a token bucket without burst.  Each read, after
 * its latency, reserves nbytes / rate on a first-come first-served clock under the mutex
 * and sleeps until its transfer would have finished; only bytes queue, latency overlaps. */
static void link_transfer(size_t nbytes)
{
    if (opt.bandwidth_mb_s <= 0 || nbytes == 0)
        return;
    int64_t cost = (int64_t)((double)nbytes * 1e9 / (opt.bandwidth_mb_s * 1e6));
    pthread_mutex_lock(&link_lock);
    int64_t now = now_ns();
    int64_t done = (link_free_at > now ? link_free_at : now) + cost;
    link_free_at = done;
    pthread_mutex_unlock(&link_lock);
    if (done > now_ns())
        sleep_until(done);
}

/* One remote operation: counted, in flight, delayed.  ``fail``: an injected errno. */
static void remote_begin(enum op op, int fail)
{
    atomic_fetch_add_explicit(&stats.ops[op], 1, memory_order_relaxed);
    atomic_max(&stats.max_concurrent, atomic_fetch_add(&stats.concurrent, 1) + 1);
    if (fail)
        atomic_fetch_add_explicit(&stats.injected[op], 1, memory_order_relaxed);
    delay_wait();
}

static int remote_end(enum op op, int err)
{
    if (err)
        atomic_fetch_add_explicit(&stats.errors[op][err > 0 && err < ERRNO_SLOTS ? err : EIO], 1,
                                  memory_order_relaxed);
    atomic_fetch_sub(&stats.concurrent, 1);
    return err;
}

/* -- inodes --------------------------------------------------------------------------- */

/* An inode the kernel knows: its lookup count and a path relative to SOURCE ("" is the
 * root).  A chained hash table under one mutex: a handful of instructions per operation. */
struct node {
    uint64_t ino;
    uint64_t nlookup;
    char *path;
    struct node *next;
};

struct foreign {
    dev_t dev;
    ino_t ino;
    uint64_t number;
    struct foreign *next;
};

static struct {
    pthread_mutex_t lock;
    struct node **buckets;
    size_t mask; /* buckets - 1, a power of two minus one */
    size_t count;
    struct foreign **fbuckets; /* (st_dev, st_ino) -> number, for foreign files */
    size_t fmask;
    size_t fcount;
    uint64_t next_foreign;
} table = {.lock = PTHREAD_MUTEX_INITIALIZER, .next_foreign = FOREIGN_INODES};

static size_t hash64(uint64_t key, size_t mask)
{
    uint64_t h = key * UINT64_C(0x9E3779B97F4A7C15); /* Fibonacci hashing: mixes into the high bits */
    return (size_t)(h ^ (h >> 32)) & mask;
}

static int table_init(void)
{
    table.mask = 1023; /* grows by doubling past one entry per bucket */
    table.fmask = 63;
    table.buckets = calloc(table.mask + 1, sizeof *table.buckets);
    table.fbuckets = calloc(table.fmask + 1, sizeof *table.fbuckets);
    return table.buckets && table.fbuckets ? 0 : -1;
}

static void table_grow(void)
{
    size_t mask = table.mask * 2 + 1;
    struct node **buckets = calloc(mask + 1, sizeof *buckets);
    if (!buckets)
        return; /* longer chains, still correct */
    for (size_t i = 0; i <= table.mask; i++) {
        struct node *n = table.buckets[i];
        while (n) {
            struct node *next = n->next;
            size_t h = hash64(n->ino, mask);
            n->next = buckets[h];
            buckets[h] = n;
            n = next;
        }
    }
    free(table.buckets);
    table.buckets = buckets;
    table.mask = mask;
}

static void fgrow(void)
{
    size_t mask = table.fmask * 2 + 1;
    struct foreign **buckets = calloc(mask + 1, sizeof *buckets);
    if (!buckets)
        return;
    for (size_t i = 0; i <= table.fmask; i++) {
        struct foreign *f = table.fbuckets[i];
        while (f) {
            struct foreign *next = f->next;
            size_t h = hash64((uint64_t)f->ino ^ ((uint64_t)f->dev << 32), mask);
            f->next = buckets[h];
            buckets[h] = f;
            f = next;
        }
    }
    free(table.fbuckets);
    table.fbuckets = buckets;
    table.fmask = mask;
}

static struct node *find_node(uint64_t ino)
{
    for (struct node *n = table.buckets[hash64(ino, table.mask)]; n; n = n->next)
        if (n->ino == ino)
            return n;
    return NULL;
}

/* The inode number handed to the kernel for a file with these attributes. */
static uint64_t inode_of(const struct stat *st)
{
    if (st->st_dev == root_dev && st->st_ino == root_ino)
        return ROOT_INO;
    if (st->st_dev == root_dev && (uint64_t)st->st_ino < FOREIGN_INODES - INODE_SHIFT)
        return (uint64_t)st->st_ino + INODE_SHIFT;
    uint64_t key = (uint64_t)st->st_ino ^ ((uint64_t)st->st_dev << 32);
    pthread_mutex_lock(&table.lock);
    struct foreign *f;
    for (f = table.fbuckets[hash64(key, table.fmask)]; f; f = f->next)
        if (f->dev == st->st_dev && f->ino == st->st_ino)
            break;
    uint64_t number = 0;
    if (f) {
        number = f->number;
    } else if ((f = malloc(sizeof *f))) {
        f->dev = st->st_dev;
        f->ino = st->st_ino;
        number = f->number = table.next_foreign++;
        size_t h = hash64(key, table.fmask);
        f->next = table.fbuckets[h];
        table.fbuckets[h] = f;
        if (++table.fcount > table.fmask)
            fgrow();
    } else {
        number = table.next_foreign++; /* out of memory: a fresh number, not remembered */
    }
    pthread_mutex_unlock(&table.lock);
    return number;
}

/* Copy the path of ``ino`` into ``out`` (PATH_MAX bytes); ESTALE if the kernel forgot it. */
static int node_path(fuse_ino_t ino, char *out)
{
    if (ino == ROOT_INO) {
        out[0] = '\0';
        return 0;
    }
    pthread_mutex_lock(&table.lock);
    struct node *n = find_node(ino);
    if (n)
        memcpy(out, n->path, strlen(n->path) + 1); /* shorter than PATH_MAX: checked by join() */
    pthread_mutex_unlock(&table.lock);
    return n ? 0 : ESTALE;
}

/* The kernel got an entry for ``ino`` at ``path``: its lookup count goes up by one. */
static int remember(uint64_t ino, const char *path)
{
    if (ino == ROOT_INO)
        return 0; /* the root lives as long as the mount */
    int err = 0;
    pthread_mutex_lock(&table.lock);
    struct node *n = find_node(ino);
    if (n) {
        if (strcmp(n->path, path) != 0) { /* the latest name of a hard-linked file will do */
            char *copy = strdup(path);
            if (copy) {
                free(n->path);
                n->path = copy;
            }
        }
        n->nlookup++;
    } else if ((n = malloc(sizeof *n)) && (n->path = strdup(path))) {
        n->ino = ino;
        n->nlookup = 1;
        size_t h = hash64(ino, table.mask);
        n->next = table.buckets[h];
        table.buckets[h] = n;
        if (++table.count > table.mask)
            table_grow();
    } else {
        free(n);
        err = ENOMEM;
    }
    pthread_mutex_unlock(&table.lock);
    return err;
}

static void forget_one(uint64_t ino, uint64_t nlookup)
{
    pthread_mutex_lock(&table.lock);
    struct node **link = &table.buckets[hash64(ino, table.mask)];
    while (*link && (*link)->ino != ino)
        link = &(*link)->next;
    struct node *n = *link;
    if (n) { /* the root and the stats file are not in the table */
        if (n->nlookup <= nlookup) {
            *link = n->next;
            free(n->path);
            free(n);
            table.count--;
        } else {
            n->nlookup -= nlookup;
        }
    }
    pthread_mutex_unlock(&table.lock);
}

/* -- helpers -------------------------------------------------------------------------- */

static const char *rel(const char *path)
{
    return path[0] ? path : ".";
}

/* ``parent/name`` (or ``name`` below the root) into ``out`` of PATH_MAX bytes. */
static int join(const char *parent, const char *name, char *out)
{
    int n = parent[0] ? snprintf(out, PATH_MAX, "%s/%s", parent, name) : snprintf(out, PATH_MAX, "%s", name);
    return n < 0 || n >= PATH_MAX ? ENAMETOOLONG : 0;
}

static void fill_entry(struct fuse_entry_param *e, uint64_t ino, const struct stat *st)
{
    memset(e, 0, sizeof *e);
    e->ino = ino;
    e->generation = 0;
    e->attr = *st;
    e->attr.st_ino = ino;
    e->attr_timeout = opt.cache_timeout;
    e->entry_timeout = opt.cache_timeout;
}

static int first_match(const struct rule *rules, size_t n, const char *path)
{
    for (size_t i = 0; i < n; i++)
        if (fnmatch(rules[i].pattern, path, 0) == 0) /* no FNM_PATHNAME: '*' also matches '/' */
            return rules[i].errnum;
    return 0;
}

/* -- the statistics file -------------------------------------------------------------- */

struct text {
    char *p;
    size_t len, cap;
    int failed;
};

static void put(struct text *t, const char *fmt, ...)
{
    if (t->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->p + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = (t->cap + (size_t)n) * 2;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->failed = 1;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
}

static void put_string(struct text *t, const char *s)
{
    put(t, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            put(t, "\\%c", c);
        else if (c < 0x20)
            put(t, "\\u%04x", c);
        else
            put(t, "%c", c);
    }
    put(t, "\"");
}

static const char *errno_name(int e, char *buf)
{
    const char *name = strerrorname_np(e);
    if (name)
        return name;
    snprintf(buf, 16, "%d", e);
    return buf;
}

/* Everything counted so far: the JSON object tools/slowfs.py writes (keys sorted), plus
 * "implementation" and "threads".  Caller frees; NULL if out of memory. */
static char *statistics_json(size_t *len)
{
    struct text t = {.p = malloc(4096), .cap = 4096};
    if (!t.p)
        return NULL;
    t.p[0] = '\0';
    pthread_mutex_lock(&stats.delay_lock);
    uint64_t count = stats.delay_count;
    double mean_us = count ? stats.delay_total_ns / (double)count / 1e3 : 0.0;
    double max_us = (double)stats.delay_max_ns / 1e3;
    pthread_mutex_unlock(&stats.delay_lock);

    put(&t, "{\"bandwidth_mb_s\": %.17g, \"bytes_read\": %" PRIuFAST64 ", ", opt.bandwidth_mb_s,
        atomic_load(&stats.bytes_read));
    put(&t, "\"delay\": {\"count\": %" PRIu64 ", \"max_us\": %.3f, \"mean_us\": %.3f}, ", count, max_us, mean_us);
    put(&t, "\"errors\": {");
    int first_op = 1;
    char buf[16];
    for (int op = 0; op < N_OPS; op++) {
        int first = 1;
        for (int e = 1; e < ERRNO_SLOTS; e++) {
            uint_fast64_t n = atomic_load(&stats.errors[op][e]);
            if (!n)
                continue;
            if (first)
                put(&t, "%s\"%s\": {", first_op ? "" : ", ", op_names[op]);
            put(&t, "%s\"%s\": %" PRIuFAST64, first ? "" : ", ", errno_name(e, buf), n);
            first = first_op = 0;
        }
        if (!first)
            put(&t, "}");
    }
    put(&t, "}, \"implementation\": \"c\", \"injected\": {");
    first_op = 1;
    for (int op = 0; op < N_OPS; op++) {
        uint_fast64_t n = atomic_load(&stats.injected[op]);
        if (n) {
            put(&t, "%s\"%s\": %" PRIuFAST64, first_op ? "" : ", ", op_names[op], n);
            first_op = 0;
        }
    }
    put(&t, "}, \"latency_us\": %.17g, \"max_concurrent\": %d, \"max_sleeping\": %d, \"open_files\": %ld, ",
        opt.latency_us, atomic_load(&stats.max_concurrent), atomic_load(&stats.max_sleeping),
        atomic_load(&stats.open_files));
    put(&t, "\"ops\": {");
    first_op = 1;
    for (int op = 0; op < N_OPS; op++) {
        uint_fast64_t n = atomic_load(&stats.ops[op]);
        if (n) {
            put(&t, "%s\"%s\": %" PRIuFAST64, first_op ? "" : ", ", op_names[op], n);
            first_op = 0;
        }
    }
    put(&t, "}, \"pid\": %d, \"source\": ", (int)getpid());
    put_string(&t, opt.source);
    put(&t, ", \"threads\": %u}\n", opt.threads);
    if (t.failed) {
        free(t.p);
        return NULL;
    }
    *len = t.len;
    return t.p;
}

static void stats_attributes(struct stat *st)
{
    size_t len = 0;
    free(statistics_json(&len));
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    memset(st, 0, sizeof *st);
    st->st_ino = STATS_INO;
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_uid = getuid();
    st->st_gid = getgid();
    st->st_size = (off_t)len;
    st->st_blksize = 4096;
    st->st_atim = st->st_mtim = st->st_ctim = now;
}

/* -- names and attributes ------------------------------------------------------------- */

static void sf_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    char ppath[PATH_MAX], path[PATH_MAX];
    int err = node_path(parent, ppath);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    struct fuse_entry_param e;
    struct stat st;
    if (parent == ROOT_INO && strcmp(name, STATS_NAME) == 0) {
        stats_attributes(&st);
        fill_entry(&e, STATS_INO, &st);
        e.attr_timeout = e.entry_timeout = 0; /* its size changes with every operation */
        fuse_reply_entry(req, &e);
        return;
    }
    if (strcmp(name, ".") == 0) {
        memcpy(path, ppath, sizeof path);
    } else if (strcmp(name, "..") == 0) {
        memcpy(path, ppath, sizeof path);
        char *slash = strrchr(path, '/');
        *(slash ? slash : path) = '\0';
    } else if ((err = join(ppath, name, path))) {
        fuse_reply_err(req, err);
        return;
    }
    remote_begin(OP_LOOKUP, 0);
    err = fstatat(root_fd, rel(path), &st, AT_SYMLINK_NOFOLLOW) ? errno : 0;
    remote_end(OP_LOOKUP, err);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    uint64_t ino = inode_of(&st);
    if ((err = remember(ino, path))) {
        fuse_reply_err(req, err);
        return;
    }
    fill_entry(&e, ino, &st);
    if (fuse_reply_entry(req, &e) != 0)
        forget_one(ino, 1); /* the kernel never got it (interrupted) */
}

static void sf_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    forget_one(ino, nlookup);
    fuse_reply_none(req);
}

static void sf_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    for (size_t i = 0; i < count; i++)
        forget_one(forgets[i].ino, forgets[i].nlookup);
    fuse_reply_none(req);
}

static void sf_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    struct stat st;
    if (ino == STATS_INO) {
        stats_attributes(&st);
        fuse_reply_attr(req, &st, 0);
        return;
    }
    char path[PATH_MAX];
    int err = node_path(ino, path);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    remote_begin(OP_GETATTR, 0);
    err = fstatat(root_fd, rel(path), &st, AT_SYMLINK_NOFOLLOW) ? errno : 0;
    remote_end(OP_GETATTR, err);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    st.st_ino = ino;
    fuse_reply_attr(req, &st, opt.cache_timeout);
}

static void sf_readlink(fuse_req_t req, fuse_ino_t ino)
{
    char path[PATH_MAX], target[PATH_MAX];
    int err = node_path(ino, path);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    remote_begin(OP_READLINK, 0);
    ssize_t n = readlinkat(root_fd, rel(path), target, sizeof target - 1);
    err = remote_end(OP_READLINK, n < 0 ? errno : 0);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    target[n] = '\0';
    fuse_reply_readlink(req, target);
}

static void sf_statfs(fuse_req_t req, fuse_ino_t ino)
{
    (void)ino;
    struct statvfs sv;
    remote_begin(OP_STATFS, 0);
    int err = remote_end(OP_STATFS, fstatvfs(root_fd, &sv) ? errno : 0);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_statfs(req, &sv);
}

/* -- directories ---------------------------------------------------------------------- */

struct dent {
    char *name;
    struct stat st;
};

struct dir {
    char *path;
    size_t n;
    struct dent *e;
};

static void dir_free(struct dir *d)
{
    if (!d)
        return;
    for (size_t i = 0; i < d->n; i++)
        free(d->e[i].name);
    free(d->e);
    free(d->path);
    free(d);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct dent *)a)->name, ((const struct dent *)b)->name);
}

/* The listing of ``path`` with each entry's attributes, sorted by name (stable offsets). */
static int scan(const char *path, struct dir *d)
{
    int fd = openat(root_fd, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    DIR *dp = fdopendir(fd);
    if (!dp) {
        int err = errno;
        close(fd);
        return err;
    }
    size_t cap = 0;
    int err = 0;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(dp);
        if (!de) {
            err = errno;
            break;
        }
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        if (!path[0] && strcmp(de->d_name, STATS_NAME) == 0)
            continue; /* shadowed by the virtual stats file */
        struct stat st;
        if (fstatat(dirfd(dp), de->d_name, &st, AT_SYMLINK_NOFOLLOW)) {
            if (errno == ENOENT)
                continue; /* removed between readdir and stat */
            err = errno;
            break;
        }
        if (d->n == cap) {
            cap = cap ? cap * 2 : 64;
            struct dent *e = realloc(d->e, cap * sizeof *e);
            if (!e) {
                err = ENOMEM;
                break;
            }
            d->e = e;
        }
        if (!(d->e[d->n].name = strdup(de->d_name))) {
            err = ENOMEM;
            break;
        }
        d->e[d->n++].st = st;
    }
    closedir(dp);
    if (!err && d->n)
        qsort(d->e, d->n, sizeof *d->e, by_name);
    return err;
}

static void sf_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    char path[PATH_MAX];
    int err = node_path(ino, path);
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    struct dir *d = calloc(1, sizeof *d);
    if (!d || !(d->path = strdup(path))) {
        free(d);
        fuse_reply_err(req, ENOMEM);
        return;
    }
    remote_begin(OP_READDIR, 0); /* the listing is the remote operation; readdir replies from it */
    err = remote_end(OP_READDIR, scan(path, d));
    if (err) {
        dir_free(d);
        fuse_reply_err(req, err);
        return;
    }
    fi->fh = (uint64_t)(uintptr_t)d;
    if (fuse_reply_open(req, fi) != 0)
        dir_free(d);
}

static void reply_listing(fuse_req_t req, size_t size, off_t off, struct fuse_file_info *fi, int plus)
{
    struct dir *d = (struct dir *)(uintptr_t)fi->fh;
    char *buf = malloc(size ? size : 1);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    size_t used = 0;
    for (size_t i = off < 0 ? d->n : (size_t)off; i < d->n; i++) {
        const struct dent *en = &d->e[i];
        uint64_t ino = inode_of(&en->st);
        size_t need;
        if (plus) {
            struct fuse_entry_param e;
            fill_entry(&e, ino, &en->st);
            need = fuse_add_direntry_plus(req, buf + used, size - used, en->name, &e, (off_t)(i + 1));
        } else {
            struct stat st = en->st;
            st.st_ino = ino;
            need = fuse_add_direntry(req, buf + used, size - used, en->name, &st, (off_t)(i + 1));
        }
        if (need > size - used)
            break; /* not added: the next call starts here */
        used += need;
        char path[PATH_MAX];
        /* readdirplus hands the kernel an entry: its lookup count goes up as a lookup's */
        if (plus && (join(d->path, en->name, path) || remember(ino, path)))
            break;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static void sf_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)ino;
    reply_listing(req, size, off, fi, 0);
}

static void sf_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)ino;
    reply_listing(req, size, off, fi, 1);
}

static void sf_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    dir_free((struct dir *)(uintptr_t)fi->fh);
    fuse_reply_err(req, 0);
}

/* -- files ---------------------------------------------------------------------------- */

struct handle {
    int fd;         /* -1: a snapshot of the statistics file */
    int read_errno; /* injected on every read; 0 for none */
    char *snapshot;
    size_t len;
};

static void sf_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & (O_APPEND | O_TRUNC | O_CREAT))) {
        fuse_reply_err(req, EROFS);
        return;
    }
    struct handle *h = calloc(1, sizeof *h);
    if (!h) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    fi->direct_io = 1; /* no page cache on this mount: every application read is a remote read */
    fi->keep_cache = 0;
    if (ino == STATS_INO) {
        h->fd = -1;
        if (!(h->snapshot = statistics_json(&h->len))) {
            free(h);
            fuse_reply_err(req, ENOMEM);
            return;
        }
        fi->fh = (uint64_t)(uintptr_t)h;
        if (fuse_reply_open(req, fi) != 0) {
            free(h->snapshot);
            free(h);
        }
        return;
    }
    char path[PATH_MAX];
    int err = node_path(ino, path);
    if (err) {
        free(h);
        fuse_reply_err(req, err);
        return;
    }
    int fail = first_match(opt.fail_open, opt.n_fail_open, path);
    remote_begin(OP_OPEN, fail);
    h->fd = -1;
    if (!fail && (h->fd = openat(root_fd, rel(path), O_RDONLY | O_NOFOLLOW | O_CLOEXEC)) < 0)
        err = errno;
    if ((err = remote_end(OP_OPEN, fail ? fail : err))) {
        free(h);
        fuse_reply_err(req, err);
        return;
    }
    h->read_errno = first_match(opt.fail_read, opt.n_fail_read, path);
    atomic_fetch_add(&stats.open_files, 1);
    fi->fh = (uint64_t)(uintptr_t)h;
    if (fuse_reply_open(req, fi) != 0) { /* interrupted: no release will come */
        close(h->fd);
        free(h);
        atomic_fetch_sub(&stats.open_files, 1);
    }
}

static void sf_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)ino;
    struct handle *h = (struct handle *)(uintptr_t)fi->fh;
    if (h->fd < 0) {
        size_t start = off < 0 || (size_t)off > h->len ? h->len : (size_t)off;
        size_t n = h->len - start < size ? h->len - start : size;
        fuse_reply_buf(req, h->snapshot + start, n);
        return;
    }
    remote_begin(OP_READ, h->read_errno);
    char *buf = NULL;
    ssize_t n = 0;
    int err = h->read_errno;
    if (!err) {
        if (!(buf = malloc(size ? size : 1))) {
            err = ENOMEM;
        } else if ((n = pread(h->fd, buf, size, off)) < 0) {
            err = errno;
        } else {
            link_transfer((size_t)n);
        }
    }
    if (remote_end(OP_READ, err)) {
        fuse_reply_err(req, err);
    } else {
        atomic_fetch_add_explicit(&stats.bytes_read, (uint_fast64_t)n, memory_order_relaxed);
        fuse_reply_buf(req, buf, (size_t)n);
    }
    free(buf);
}

static void sf_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    struct handle *h = (struct handle *)(uintptr_t)fi->fh;
    if (h->fd >= 0) {
        /* counted, not delayed: the kernel sends it asynchronously, nobody waits for it */
        atomic_fetch_add_explicit(&stats.ops[OP_RELEASE], 1, memory_order_relaxed);
        close(h->fd);
        atomic_fetch_sub(&stats.open_files, 1);
    }
    free(h->snapshot);
    free(h);
    fuse_reply_err(req, 0);
}

/* -- writes: a read-only volume ------------------------------------------------------- */

static void rofs_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set, struct fuse_file_info *fi)
{
    (void)ino, (void)attr, (void)to_set, (void)fi;
    fuse_reply_err(req, EROFS);
}

static void rofs_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, dev_t rdev)
{
    (void)parent, (void)name, (void)mode, (void)rdev;
    fuse_reply_err(req, EROFS);
}

static void rofs_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{
    (void)parent, (void)name, (void)mode;
    fuse_reply_err(req, EROFS);
}

static void rofs_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    (void)parent, (void)name;
    fuse_reply_err(req, EROFS);
}

static void rofs_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{
    (void)link, (void)parent, (void)name;
    fuse_reply_err(req, EROFS);
}

static void rofs_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                        const char *newname, unsigned int flags)
{
    (void)parent, (void)name, (void)newparent, (void)newname, (void)flags;
    fuse_reply_err(req, EROFS);
}

static void rofs_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname)
{
    (void)ino, (void)newparent, (void)newname;
    fuse_reply_err(req, EROFS);
}

static void rofs_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                        struct fuse_file_info *fi)
{
    (void)parent, (void)name, (void)mode, (void)fi;
    fuse_reply_err(req, EROFS);
}

static void rofs_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    (void)ino, (void)buf, (void)size, (void)off, (void)fi;
    fuse_reply_err(req, EROFS);
}

static void rofs_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value, size_t size,
                          int flags)
{
    (void)ino, (void)name, (void)value, (void)size, (void)flags;
    fuse_reply_err(req, EROFS);
}

static void rofs_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name)
{
    (void)ino, (void)name;
    fuse_reply_err(req, EROFS);
}

static void rofs_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                           struct fuse_file_info *fi)
{
    (void)ino, (void)mode, (void)offset, (void)length, (void)fi;
    fuse_reply_err(req, EROFS);
}

/* -- serving -------------------------------------------------------------------------- */

static void sf_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    /* Lookups in one directory run concurrently (the default, asked for explicitly). */
    if (conn->capable & FUSE_CAP_PARALLEL_DIROPS)
        conn->want |= FUSE_CAP_PARALLEL_DIROPS;
    /* The kernel's limit on asynchronous requests in flight (default 12) is raised to the
     * worker count, so that it never caps the emulated remote's concurrency; the kernel
     * field is 16 bits wide. */
    unsigned background = opt.threads < 65535 ? opt.threads : 65535;
    conn->max_background = background;
    conn->congestion_threshold = background * 3 / 4; /* the kernel's default ratio */
}

static const struct fuse_lowlevel_ops operations = {
    .init = sf_init,
    .lookup = sf_lookup,
    .forget = sf_forget,
    .forget_multi = sf_forget_multi,
    .getattr = sf_getattr,
    .readlink = sf_readlink,
    .statfs = sf_statfs,
    .opendir = sf_opendir,
    .readdir = sf_readdir,
    .readdirplus = sf_readdirplus,
    .releasedir = sf_releasedir,
    .open = sf_open,
    .read = sf_read,
    .release = sf_release,
    .setattr = rofs_setattr,
    .mknod = rofs_mknod,
    .mkdir = rofs_mkdir,
    .unlink = rofs_unlink,
    .rmdir = rofs_unlink,
    .symlink = rofs_symlink,
    .rename = rofs_rename,
    .link = rofs_link,
    .create = rofs_create,
    .write = rofs_write,
    .setxattr = rofs_setxattr,
    .removexattr = rofs_removexattr,
    .fallocate = rofs_fallocate,
};

/* The one-line start-up report to a launcher waiting on --ready-fd ("ok" or "error: ..."). */
static void report(const char *fmt, ...)
{
    char line[PATH_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof line - 2)
        n = (int)sizeof line - 2;
    if (strcmp(line, "ok") != 0)
        log_line("%s", line);
    if (opt.ready_fd < 0)
        return;
    line[n++] = '\n';
    ssize_t written = write(opt.ready_fd, line, (size_t)n);
    (void)written; /* a launcher that went away learns nothing either way */
    close(opt.ready_fd);
    opt.ready_fd = -1;
}

/* -- ending the session on a signal -------------------------------------------------- */

/* The exit signals are not left to libfuse's handlers (fuse_set_signal_handlers), for two
 * reasons:
 * - They leave a signal that the daemon inherited as ignored ignored.  A background job of
 *   a non-interactive shell starts with SIGINT ignored (POSIX), and so does all it runs: in
 *   a test suite started that way the daemon outlived its SIGINT with the mount live (in
 *   both CI runs started that way, and every time when started alone with SIGINT ignored).
 * - libfuse 3.14's multi-threaded loop can miss a signal (fixed upstream in 3.18: commit
 *   c5dbcdce, "Fix multi-threaded fuse session exit").
 *   The handler only sets the session's exit flag.  A worker thread that takes the signal
 *   between its check of that flag and its read of /dev/fuse then waits in the read, and
 *   the main thread in sem_wait, until the next request comes, which may be never.
 * So the exit signals are blocked in every thread (a blocked signal is queued even while
 * its disposition is to ignore it) and taken by one thread of ours (sigwait).  That thread
 * sets the exit flag, then interrupts the loop's main thread with SIGUSR1, whose handler
 * does nothing and does not restart: sem_wait returns EINTR, and the loop finds the flag
 * and cancels its workers.  It sends SIGUSR1 again every WAKE_INTERVAL_MS until the loop
 * has returned, because one interruption can land just before the main thread enters
 * sem_wait. */
#define WAKE_INTERVAL_MS 20

static sigset_t exit_signals;
static struct fuse_session *signal_session;
static pthread_t loop_thread;
static atomic_int loop_returned;

/* SIGUSR1's handler: it does nothing, but being a handler, not SIG_IGN (an ignored signal
 * interrupts no wait), it makes the loop's sem_wait return EINTR. */
static void interrupt_wait(int sig)
{
    (void)sig;
}

static void *take_signals(void *unused)
{
    (void)unused;
    int sig;
    if (sigwait(&exit_signals, &sig) != 0)
        return NULL;
    log_line("signal %d: unmounting", sig);
    fuse_session_exit(signal_session);
    while (!atomic_load(&loop_returned)) {
        pthread_kill(loop_thread, SIGUSR1);
        struct timespec pause = {0, WAKE_INTERVAL_MS * 1000000L};
        nanosleep(&pause, NULL);
    }
    return NULL;
}

/* Before any thread starts (threads inherit the mask): SIGTERM, SIGINT and SIGHUP blocked,
 * even if inherited as ignored, and left to take_signals; SIGUSR1 able to interrupt the
 * loop; SIGPIPE ignored (as libfuse's own handlers do).  0, or -1 with errno. */
static int handle_signals(struct fuse_session *se)
{
    sigemptyset(&exit_signals);
    sigaddset(&exit_signals, SIGTERM);
    sigaddset(&exit_signals, SIGINT);
    sigaddset(&exit_signals, SIGHUP);
    int err = pthread_sigmask(SIG_BLOCK, &exit_signals, NULL);
    if (err) {
        errno = err;
        return -1;
    }
    /* Not ignored, whatever was inherited (blocked, they never take their default action:
     * take_signals takes them). */
    struct sigaction by_default = {.sa_handler = SIG_DFL};
    sigemptyset(&by_default.sa_mask);
    if (sigaction(SIGTERM, &by_default, NULL) || sigaction(SIGINT, &by_default, NULL) ||
        sigaction(SIGHUP, &by_default, NULL))
        return -1;
    /* No SA_RESTART: with it the kernel restarts the loop's futex wait (sem_wait) and the
     * main thread sleeps on (measured: 100 of 100 SIGTERMs missed). */
    struct sigaction wake = {.sa_handler = interrupt_wait, .sa_flags = 0};
    sigemptyset(&wake.sa_mask);
    struct sigaction ignore = {.sa_handler = SIG_IGN};
    sigemptyset(&ignore.sa_mask);
    if (sigaction(SIGUSR1, &wake, NULL) || sigaction(SIGPIPE, &ignore, NULL))
        return -1;
    signal_session = se;
    loop_thread = pthread_self();
    pthread_t taker;
    err = pthread_create(&taker, NULL, take_signals, NULL);
    if (err) {
        errno = err;
        return -1;
    }
    pthread_detach(taker);
    return 0;
}

static int serve(void)
{
    root_fd = open(opt.source, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat root;
    if (root_fd < 0 || fstat(root_fd, &root)) {
        report("error: cannot open %s: %s", opt.source, strerror(errno));
        return 1;
    }
    root_dev = root.st_dev;
    root_ino = root.st_ino;
    if (table_init()) {
        report("error: out of memory");
        return 1;
    }
    /* The kernel checks permissions against the source's modes (default_permissions), the
     * mount is read-only, and root's mount is open to every user (the daemon under test
     * may run as another one), as tools/slowfs.py mounts. */
    char options[64] = "ro,default_permissions,fsname=slowfs,subtype=slowfs";
    if (geteuid() == 0)
        strcat(options, ",allow_other");
    char *argv[] = {"slowfs-c", "-o", options, NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, argv);
    struct fuse_session *se = fuse_session_new(&args, &operations, sizeof operations, NULL);
    if (!se) {
        report("error: cannot create the FUSE session");
        return 1;
    }
    int code = 1;
    /* Before readiness is reported: a SIGTERM right after start-up unmounts. */
    if (handle_signals(se) != 0) {
        report("error: cannot set up signal handling: %s", strerror(errno));
        goto destroy;
    }
    if (fuse_session_mount(se, opt.mount_point) != 0) {
        report("error: cannot mount on %s", opt.mount_point);
        goto destroy;
    }
    log_line("%s on %s, latency %.0f us, %u threads, pid %d", opt.source, opt.mount_point, opt.latency_us,
             opt.threads, (int)getpid());
    report("ok");
    struct fuse_loop_config *config = fuse_loop_cfg_create();
    if (!config) {
        log_line("out of memory");
    } else {
        fuse_loop_cfg_set_max_threads(config, opt.threads);
        /* Idle workers stay: starting a thread per burst would cost more than its stack. */
        fuse_loop_cfg_set_idle_threads(config, opt.threads);
        fuse_loop_cfg_set_clone_fd(config, (unsigned)opt.clone_fd);
        int result = fuse_session_loop_mt(se, config);
        fuse_loop_cfg_destroy(config);
        code = result < 0 ? 1 : 0; /* 0: unmounted, or ended by a signal */
    }
    /* No more wake-ups from here on (one still pending stays blocked, so it cannot
     * interrupt the unmount), then take_signals stops sending them. */
    sigset_t wake;
    sigemptyset(&wake);
    sigaddset(&wake, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &wake, NULL);
    atomic_store(&loop_returned, 1);
    fuse_session_unmount(se);
    log_line("unmounted %s", opt.mount_point);
destroy:
    fuse_session_destroy(se);
    fuse_opt_free_args(&args);
    return code;
}

/* Without --foreground: the daemon runs in a child in its own session; the parent returns
 * once the mount is live, printing the daemon's pid (or the reason it failed). */
static int detach(void)
{
    int pipefd[2];
    if (pipe(pipefd)) {
        perror("slowfs-c: pipe");
        return 1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        perror("slowfs-c: fork");
        return 1;
    }
    if (pid == 0) {
        close(pipefd[0]);
        setsid();
        int in = open("/dev/null", O_RDONLY);
        int out = opt.log_file ? open(opt.log_file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644)
                               : open("/dev/null", O_WRONLY);
        if (in >= 0)
            dup2(in, STDIN_FILENO);
        if (out >= 0) {
            dup2(out, STDOUT_FILENO);
            dup2(out, STDERR_FILENO);
        }
        if (in > STDERR_FILENO)
            close(in);
        if (out > STDERR_FILENO)
            close(out);
        opt.ready_fd = pipefd[1];
        _exit(serve());
    }
    close(pipefd[1]);
    char message[PATH_MAX + 256];
    size_t len = 0;
    int64_t deadline = now_ns() + (int64_t)READY_TIMEOUT_MS * 1000000;
    while (len < sizeof message - 1 && (len == 0 || message[len - 1] != '\n')) {
        int64_t left_ms = (deadline - now_ns()) / 1000000;
        struct pollfd p = {.fd = pipefd[0], .events = POLLIN};
        int ready = left_ms > 0 ? poll(&p, 1, (int)left_ms) : 0;
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0) {
            len = (size_t)snprintf(message, sizeof message, "error: no mount after %d s", READY_TIMEOUT_MS / 1000);
            break;
        }
        ssize_t n = read(pipefd[0], message + len, sizeof message - 1 - len);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(pipefd[0]);
    message[len] = '\0';
    message[strcspn(message, "\n")] = '\0';
    if (strcmp(message, "ok") != 0) {
        if (waitpid(pid, NULL, WNOHANG) == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        fprintf(stderr, "slowfs-c: %s\n", message[0] ? message : "the daemon exited during start-up");
        return 1;
    }
    printf("%d\n", (int)pid);
    return 0;
}

/* -- command line --------------------------------------------------------------------- */

static const char usage[] =
    "usage: slowfs-c SOURCE MOUNTPOINT [--latency-us N] [--threads N] [--cache-timeout SECONDS]\n"
    "                [--bandwidth-mb-s MB] [--fail GLOB=ERRNO ...] [--fail-read GLOB=ERRNO ...]\n"
    "                [--foreground] [--log-file PATH] [--clone-fd]\n"
    "\n"
    "Mount SOURCE read-only on MOUNTPOINT with a per-operation latency and injected errors (an\n"
    "emulated remote volume; the C twin of tools/slowfs.py). Statistics: read MOUNTPOINT/.slowfs_stats.\n"
    "\n"
    "  --latency-us N        delay of every remote operation in microseconds (default: 0)\n"
    "  --threads N           remote operations in progress at once (default: 128)\n"
    "  --cache-timeout S     kernel entry/attribute cache timeout (default: 0, every stat is remote)\n"
    "  --bandwidth-mb-s MB   cap on bytes all reads return per second, in MB/s (10^6 bytes; default: 0, none)\n"
    "  --fail GLOB=ERRNO     open of files matching GLOB (relative path) fails with ERRNO, e.g. '*.bad=EIO'\n"
    "  --fail-read GLOB=ERRNO  like --fail, but open succeeds and every read fails\n"
    "  --foreground          do not detach; log to stderr\n"
    "  --log-file PATH       where a detached daemon logs\n"
    "  --clone-fd            one /dev/fuse descriptor per worker thread\n";

static void die_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("slowfs-c: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\n(slowfs-c --help for the options)\n", stderr);
    va_end(ap);
    exit(2); /* as argparse: a usage error */
}

static double parse_number(const char *name, const char *text)
{
    char *end;
    errno = 0;
    double value = strtod(text, &end);
    if (errno || end == text || *end || !isfinite(value) || value < 0)
        die_usage("--%s must be a number >= 0, got '%s'", name, text);
    return value;
}

static void add_rule(struct rule **rules, size_t *n, const char *text)
{
    const char *eq = strrchr(text, '=');
    if (!eq || eq == text)
        die_usage("expected GLOB=ERRNO, got '%s'", text);
    const char *code = eq + 1;
    int number = 0;
    if (*code && strspn(code, "0123456789") == strlen(code)) {
        number = atoi(code);
    } else {
        for (int e = 1; e < ERRNO_SLOTS && !number; e++) {
            const char *name = strerrorname_np(e);
            if (name && strcasecmp(name, code) == 0)
                number = e;
        }
    }
    if (number <= 0 || number >= ERRNO_SLOTS)
        die_usage("unknown errno '%s' in '%s'", code, text);
    struct rule *grown = realloc(*rules, (*n + 1) * sizeof *grown);
    if (!grown || !(grown[*n].pattern = strndup(text, (size_t)(eq - text))))
        die_usage("out of memory");
    grown[*n].errnum = number;
    *rules = grown;
    (*n)++;
}

static void parse_args(int argc, char **argv)
{
    enum { O_LATENCY = 256, O_THREADS, O_CACHE, O_BANDWIDTH, O_FAIL, O_FAIL_READ, O_FOREGROUND, O_LOG, O_READY,
           O_CLONE };
    static const struct option longopts[] = {
        {"latency-us", required_argument, NULL, O_LATENCY},
        {"threads", required_argument, NULL, O_THREADS},
        {"cache-timeout", required_argument, NULL, O_CACHE},
        {"bandwidth-mb-s", required_argument, NULL, O_BANDWIDTH},
        {"fail", required_argument, NULL, O_FAIL},
        {"fail-read", required_argument, NULL, O_FAIL_READ},
        {"foreground", no_argument, NULL, O_FOREGROUND},
        {"log-file", required_argument, NULL, O_LOG},
        {"ready-fd", required_argument, NULL, O_READY},
        {"clone-fd", no_argument, NULL, O_CLONE},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    double threads;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case O_LATENCY:
            opt.latency_us = parse_number("latency-us", optarg);
            break;
        case O_THREADS:
            threads = parse_number("threads", optarg);
            if (threads < 1 || threads > 100000 || threads != floor(threads))
                die_usage("--threads must be an integer from 1 to 100000, got '%s'", optarg);
            opt.threads = (unsigned)threads;
            break;
        case O_CACHE:
            opt.cache_timeout = parse_number("cache-timeout", optarg);
            break;
        case O_BANDWIDTH:
            opt.bandwidth_mb_s = parse_number("bandwidth-mb-s", optarg);
            break;
        case O_FAIL:
            add_rule(&opt.fail_open, &opt.n_fail_open, optarg);
            break;
        case O_FAIL_READ:
            add_rule(&opt.fail_read, &opt.n_fail_read, optarg);
            break;
        case O_FOREGROUND:
            opt.foreground = 1;
            break;
        case O_LOG:
            opt.log_file = optarg;
            break;
        case O_READY:
            opt.ready_fd = (int)parse_number("ready-fd", optarg);
            break;
        case O_CLONE:
            opt.clone_fd = 1;
            break;
        case 'h':
            fputs(usage, stdout);
            exit(0);
        default:
            die_usage("unknown option");
        }
    }
    if (argc - optind != 2)
        die_usage("expected SOURCE and MOUNTPOINT");
    opt.source = argv[optind];
    opt.mount_point = argv[optind + 1];
    opt.latency_ns = (int64_t)llround(opt.latency_us * 1e3);
    struct stat st;
    if (stat(opt.source, &st) || !S_ISDIR(st.st_mode))
        die_usage("SOURCE '%s' is not a directory", opt.source);
    if (stat(opt.mount_point, &st) || !S_ISDIR(st.st_mode))
        die_usage("MOUNTPOINT '%s' is not a directory", opt.mount_point);
}

int main(int argc, char **argv)
{
    parse_args(argc, argv);
    static char source[PATH_MAX], mount_point[PATH_MAX];
    if (!realpath(opt.source, source) || !realpath(opt.mount_point, mount_point))
        die_usage("cannot resolve '%s' or '%s': %s", opt.source, opt.mount_point, strerror(errno));
    opt.source = source;
    opt.mount_point = mount_point;
    if (!opt.foreground)
        return detach();
    return serve();
}

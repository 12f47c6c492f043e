/*
 * cubefs_fuse.fs._session: the daemon's own FUSE session (libfuse 3 low-level API).
 *
 * C owns the kernel connection: it mounts, runs the reader threads (each with its own
 * request buffer, none holding the GIL), answers what needs no decision (IOCTL ENOTTY,
 * FLUSH ENOSYS, every write EROFS, FORGET's empty reply) and queues every other request
 * for Python.  Python (fs/session.py) waits on an eventfd, takes the queue in one call and
 * answers each request through a reply method, which releases the GIL while it writes to
 * /dev/fuse.  A request is named to Python by a slot id that carries a generation, so a
 * reply to a request already answered, or a made-up id, raises instead of touching freed
 * memory.
 *
 * Python also publishes inodes (publish(), lend()): which blocks of the inode's version it
 * lends.  A READ of lent blocks is answered here and reported (OP_SERVED), so Python counts
 * reads it never saw.  And it publishes entries (publish_entry()): the answer to a LOOKUP
 * of a name until a deadline (as long as it trusts the attributes), answered here and
 * reported (OP_LOOKED), so Python's lookup counts stay the kernel's.
 *
 * Opens: with no_open (the daemon's filesystem reads by inode), every OPEN is answered
 * ENOSYS, which the kernel takes as "opens need no server": from then on it opens files of
 * the connection without a request and sends no RELEASE, and keeps their pages across
 * opens (FOPEN_KEEP_CACHE); a cached file read again costs the daemon no request at all.
 * A changed file is then found at LOOKUP, which Python answers with each entry's own
 * timeouts (as long as it trusts the attributes, no longer).  Without no_open (the remote
 * emulator, which opens a source file per open), OPENs go to Python, and every RELEASE is
 * answered here and reported only for a handle Python gave (OP_RELEASE).
 *
 * Handover (an upgrade: the connection passes to the next daemon, readers only pause):
 * pause() stops the readers (the kernel queues what comes meanwhile), Python answers what
 * it was given (busy turns 0), and detach() hands out a duplicate of the /dev/fuse
 * descriptor and the kernel's INIT request as it came, then frees the session without
 * unmounting.  The successor's session adopts the descriptor (Session(..., adopt_fd, init)):
 * libfuse expects INIT first, so the saved INIT goes through libfuse again, which sets up
 * the connection's parameters as the kernel negotiated them, and its answer (the kernel
 * has one) is dropped by the session's own writev (fuse_session_custom_io).
 */
#define PY_SSIZE_T_CLEAN
#define FUSE_USE_VERSION 35
#include <Python.h>
#include <fuse_lowlevel.h>
/* xxHash compiled in (header only): the NVMe tier's checksums, checked before a byte is served. */
#define XXH_INLINE_ALL
#include <xxhash.h>
/* The kernel's FUSE ABI: the INIT request kept for a successor's session (a handover). */
#include <linux/fuse.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <time.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <spawn.h>
#include <sys/uio.h>
#include <unistd.h>

/* What Python is asked to do; the numbers are the module's OP_* constants. */
enum {
    OP_LOOKUP = 1,
    OP_GETATTR,
    OP_READLINK,
    OP_OPENDIR,
    OP_READDIR,     /* READDIRPLUS (size = the kernel's buffer) */
    OP_RELEASEDIR,
    OP_OPEN,
    OP_READ,
    OP_RELEASE,     /* no reply: C answered the RELEASE of a handle Python gave (fh != 0) */
    OP_STATFS,
    OP_FORGET,      /* no reply: ino, nlookup in size */
    OP_INIT,        /* no reply: the kernel has the answer to its INIT */
    OP_EXIT,        /* no reply: the session ended (unmounted, or exit() was called) */
    OP_SERVED,      /* no reply: C served a READ from lent blocks (off, size: its range) */
    OP_LOOKED,      /* no reply: C answered a LOOKUP from a published entry (ino: the inode) */
};

/* A block lent as its place in the NVMe tier: an entry of a segment file (cache/disk.py):
 * a 40-byte header (magic, format, reserved, payload length, key, xxh3-64 of the payload,
 * xxh32 of the 36 bytes before it), then the payload, ``alloc`` bytes in all. */
struct disk_block {
    char *path;
    uint64_t offset;
    uint64_t alloc;
    unsigned char key[16];
};
/* The blocks one served READ touches are reported as 64-bit masks from its first block:
 * a READ is at most the kernel's max_read (1 MiB), 64 blocks of 16 KiB, and the daemon's
 * blocks are larger; a READ over more blocks is left to Python. */
#define MAX_READ_BLOCKS 64
/* Inode numbers are consecutive: they fill the buckets evenly, and the chains stay short
 * for the ~10^5-10^6 inodes a node's kernel holds. */
#define PUB_BUCKETS 65536
/* Entries are keyed by (parent, name): as many buckets, for the same ~10^5-10^6 names. */
#define ENTRY_BUCKETS 65536
/* How long a report may wait for a request or other reports before trio is woken for it
 * (push()): 2 ms batches a few to a few dozen per wake-up at 10^3-10^4 files/s, and
 * delays only counting (and the giving back of freed publications' blocks). */
#define REPORT_DELAY_NS 2000000ULL
#define ENTRY_HEADER 40
#define ENTRY_FORMAT 2
#define ALLOCATION_UNIT 4096

/* An inode Python published (publish()): the cached blocks of the version it serves,
 * lent: READs of the inode that fall on them are served here without Python, from the
 * bytes objects of RAM blocks, or from NVMe entries checked like Python checks them (a
 * failed check leaves the READ to Python).  A version's bytes never change, so a READ may
 * use them for as long as they are lent, whatever the metadata says.  A READ uses the
 * blocks under the read lock, replies included; publish, lend and withdraw change them
 * under the write lock, so what they replace is unused once they return. */
struct pub {
    struct pub *next;     /* the bucket's chain */
    fuse_ino_t ino;
    uint64_t size;        /* the file's size at the version published */
    uint64_t block_size;
    uint32_t nblocks;
    struct disk_block **disk;  /* per block, NULL where not lent from NVMe (allocated on demand) */
    PyObject *blocks[];   /* per block, a reference to a lent RAM block (bytes), or NULL */
};

/* An entry Python published (publish_entry()): until expires_ns (CLOCK_MONOTONIC), a LOOKUP
 * of (parent, name) is answered here with ino and attr, each answer's timeouts what is left
 * of that (at most the session's).  Python keeps ino alive (its number, what it serves)
 * until it has withdrawn the entry and taken the reports queued before that, so an answer
 * never names an inode Python has let go.  Read under elock; changed under its write lock. */
struct centry {
    struct centry *next;  /* the bucket's chain */
    fuse_ino_t parent, ino;
    uint64_t expires_ns;
    struct stat attr;
    size_t len;
    char name[];          /* NUL-terminated */
};

/* An INIT request: a 40-byte header and fuse_init_in (64 bytes since protocol 7.36); room
 * for a later, longer one. */
#define INIT_MAX 256

struct pending {
    struct pending *next;  /* the queue's link */
    fuse_req_t req;        /* NULL for the messages that take no reply */
    uint64_t id;           /* slot | generation << 32; 0 for messages */
    int op;
    int flags;
    fuse_ino_t ino;
    uint64_t fh;
    uint64_t off;
    uint64_t size;         /* READ/READDIR: bytes wanted; SERVED: bytes sent; FORGET: nlookup */
    /* SERVED: the READ's first block, and per tier the bytes sent and a mask of the blocks
     * read (bit i: block first + i) */
    uint64_t first, ram_bytes, ram_mask, disk_bytes, disk_mask;
    uint64_t queued_ns;    /* CLOCK_MONOTONIC when it was queued (the watchdog's deadline) */
    pid_t pid;
    uid_t uid;
    gid_t gid;
    char name[];           /* LOOKUP's name, NUL-terminated; empty otherwise */
};

typedef struct {
    PyObject_HEAD
    struct fuse_session *se;
    int efd;         /* readable while requests wait for Python */
    int stopfd;      /* readable once the readers must stop */
    int mounted;
    pthread_t *threads;
    int nthreads;
    int started;
    double entry_timeout, attr_timeout;  /* the longest an entry's or attributes' timeout may be */
    int no_open;     /* every OPEN is answered ENOSYS: the kernel's no_open mode */
    uint64_t deadline_ns;  /* a forwarded request older than this gets EIO from C; 0: never */
    _Atomic uint64_t expired;  /* requests the watchdog answered */
    pthread_t watchdog;
    int watching;
    atomic_int init_posted;
    atomic_int exit_posted;
    /* The kernel's INIT request as it came (header and fuse_init_in; a handover replays it). */
    unsigned char init[INIT_MAX];
    size_t init_len;
    int replaying;   /* the adopted session's INIT goes through libfuse: its answer is dropped */
    int initialized; /* libfuse took the connection's INIT (op_init ran) */
    char *adopted;   /* the mount point of an adopted connection (closing unmounts it), else NULL */
    pthread_rwlock_t hlock;  /* publications: READs read them, Python changes them */
    struct pub *pubs[PUB_BUCKETS];
    pthread_rwlock_t elock;  /* entries: LOOKUPs read them, Python changes them */
    struct centry *entries[ENTRY_BUCKETS];
    pthread_mutex_t lock;  /* the queue, the slots and the flusher's state */
    pthread_cond_t flush_cond;  /* CLOCK_MONOTONIC: the flusher waits on it */
    pthread_t flusher;
    int flushing;          /* the flusher thread runs */
    int stopping;          /* the flusher must end */
    int signalled;         /* trio was woken and has not taken the queue since */
    uint64_t report_due_ns;  /* reports are queued and trio is not woken: wake it then */
    struct pending *head, *tail;
    struct pending **slots;  /* requests given to Python and not yet answered */
    uint32_t *gens;
    uint32_t *free_slots;
    size_t nslots, nfree;
} Session;

/* libfuse reports mount failures through its log; the last message goes into the
 * exception Python sees (e.g. "fuse: device not found, try 'modprobe fuse' first"). */
static char last_log[512];
static pthread_mutex_t last_log_lock = PTHREAD_MUTEX_INITIALIZER;  /* readers log too */

static void session_log(enum fuse_log_level level, const char *fmt, va_list ap)
{
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n')
        line[--n] = '\0';
    if (level <= FUSE_LOG_ERR) {
        pthread_mutex_lock(&last_log_lock);
        memcpy(last_log, line, n + 1);
        pthread_mutex_unlock(&last_log_lock);
    }
    fprintf(stderr, "%s\n", line);
}

/* A reply to a request that waits for none: answered at its deadline, or never given. */
static PyObject *Gone;

/* ---- the queue (reader threads, no GIL) ---- */

static void wake(Session *s)
{
    uint64_t one = 1;
    ssize_t r;
    do {
        r = write(s->efd, &one, sizeof one);
    } while (r < 0 && errno == EINTR);
    /* EAGAIN: the counter is at its maximum, so the eventfd is readable anyway. */
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

/* Queue p.  Python reads the eventfd before it takes the queue, so one wake per take()
 * suffices (s->signalled).  A request (urgent) wakes trio at once.  A report, which nobody
 * waits on, waits up to REPORT_DELAY_NS for company (the flusher thread wakes trio then):
 * a wake-up of the trio thread costs it more CPU than handling a report, and a reader
 * that opens and closes files one after another would otherwise cost two per file. */
static void push(Session *s, struct pending *p, int urgent)
{
    int wake_now = 0;
    pthread_mutex_lock(&s->lock);
    p->next = NULL;
    if (s->tail)
        s->tail->next = p;
    else
        s->head = p;
    s->tail = p;
    if (!s->signalled) {
        if (urgent) {
            s->signalled = 1;
            s->report_due_ns = 0;
            wake_now = 1;
        } else if (!s->report_due_ns) {
            s->report_due_ns = now_ns() + REPORT_DELAY_NS;
            pthread_cond_signal(&s->flush_cond);
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (wake_now)
        wake(s);
}

/* Wakes trio for reports that waited REPORT_DELAY_NS without a request to take them along. */
static void *flusher(void *arg)
{
    Session *s = arg;
    pthread_mutex_lock(&s->lock);
    while (!s->stopping) {
        if (!s->report_due_ns || s->signalled) {
            pthread_cond_wait(&s->flush_cond, &s->lock);
            continue;
        }
        uint64_t due = s->report_due_ns;
        if (now_ns() < due) {
            struct timespec until = {.tv_sec = (time_t)(due / 1000000000ULL), .tv_nsec = (long)(due % 1000000000ULL)};
            pthread_cond_timedwait(&s->flush_cond, &s->lock, &until);
            continue;
        }
        s->report_due_ns = 0;
        s->signalled = 1;
        pthread_mutex_unlock(&s->lock);
        wake(s);
        pthread_mutex_lock(&s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static struct pending *new_pending(fuse_req_t req, int op, fuse_ino_t ino, const char *name)
{
    size_t len = name ? strlen(name) : 0;
    struct pending *p = calloc(1, sizeof *p + len + 1);
    if (!p)
        return NULL;
    p->req = req;
    p->op = op;
    p->ino = ino;
    p->queued_ns = now_ns();
    if (name)
        memcpy(p->name, name, len + 1);
    if (req) {
        const struct fuse_ctx *ctx = fuse_req_ctx(req);
        p->pid = ctx->pid;
        p->uid = ctx->uid;
        p->gid = ctx->gid;
    }
    return p;
}

static void message(Session *s, int op, fuse_ino_t ino, uint64_t size)
{
    struct pending *p = new_pending(NULL, op, ino, NULL);
    if (!p) {
        /* Losing a FORGET leaks one inode's lookup count until unmount; losing INIT or
         * EXIT would be worse, but neither can be allocated-away without a dying process. */
        fuse_log(FUSE_LOG_ERR, "cubefs-fuse: out of memory queuing a message\n");
        return;
    }
    p->size = size;
    push(s, p, op != OP_FORGET);  /* INIT and EXIT are awaited; a FORGET is a report */
}

/* Forward a request to Python; ENOMEM to the kernel if it cannot even be queued. */
static void forward(struct pending *p)
{
    if (!p)
        return;
    push((Session *)fuse_req_userdata(p->req), p, 1);
}

static Session *of(fuse_req_t req) { return (Session *)fuse_req_userdata(req); }

static struct pending *request(fuse_req_t req, int op, fuse_ino_t ino, const char *name)
{
    struct pending *p = new_pending(req, op, ino, name);
    if (!p)
        fuse_reply_err(req, ENOMEM);
    return p;
}

/* ---- the low-level operations (reader threads) ---- */

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    ((Session *)userdata)->initialized = 1;  /* libfuse accepted the INIT (a replayed one too) */
    /* Every directory listing is READDIRPLUS: one request gives the kernel the names and
     * their attributes, so `ls -l` or a dataset scan costs no LOOKUP per entry. */
    if (conn->capable & FUSE_CAP_READDIRPLUS)
        conn->want |= FUSE_CAP_READDIRPLUS;
    conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
}

static int answer_entry(Session *s, fuse_req_t req, fuse_ino_t parent, const char *name);

/* A LOOKUP of a published entry is answered here; any other goes to Python. */
static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    if (!answer_entry(of(req), req, parent, name))
        forward(request(req, OP_LOOKUP, parent, name));
}

static void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    Session *s = of(req);
    fuse_reply_none(req);
    message(s, OP_FORGET, ino, nlookup);
}

static void op_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    Session *s = of(req);
    fuse_reply_none(req);
    for (size_t i = 0; i < count; i++)
        message(s, OP_FORGET, forgets[i].ino, forgets[i].nlookup);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    forward(request(req, OP_GETATTR, ino, NULL));
}

static void op_readlink(fuse_req_t req, fuse_ino_t ino)
{
    forward(request(req, OP_READLINK, ino, NULL));
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct pending *p = request(req, OP_OPENDIR, ino, NULL);
    if (p)
        p->flags = fi->flags;
    forward(p);
}

/* A READ or READDIRPLUS for Python: a handle, an offset and a size. */
static void forward_range(fuse_req_t req, int op, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    struct pending *p = request(req, op, ino, NULL);
    if (p) {
        p->fh = fi->fh;
        p->off = (uint64_t)off;
        p->size = size;
    }
    forward(p);
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    forward_range(req, OP_READDIR, ino, size, off, fi);
}

static void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct pending *p = request(req, OP_RELEASEDIR, ino, NULL);
    if (p)
        p->fh = fi->fh;
    forward(p);
}

/* Under hlock (either mode). */
static struct pub *find_pub(Session *s, fuse_ino_t ino)
{
    struct pub *pub = s->pubs[ino % PUB_BUCKETS];
    while (pub && pub->ino != ino)
        pub = pub->next;
    return pub;
}

/* Under hlock (write).  Takes the inode's publication out of the table (the caller frees
 * it, with the GIL, after unlocking: no READ can be using it then). */
static struct pub *unlink_pub(Session *s, fuse_ino_t ino)
{
    struct pub **link = &s->pubs[ino % PUB_BUCKETS];
    while (*link && (*link)->ino != ino)
        link = &(*link)->next;
    struct pub *pub = *link;
    if (pub) {
        *link = pub->next;
        pub->next = NULL;
    }
    return pub;
}

static void free_disk_block(struct disk_block *d)
{
    if (d) {
        free(d->path);
        free(d);
    }
}

/* With the GIL. */
static void free_pub(struct pub *pub)
{
    if (!pub)
        return;
    for (uint32_t i = 0; i < pub->nblocks; i++) {
        Py_XDECREF(pub->blocks[i]);
        if (pub->disk)
            free_disk_block(pub->disk[i]);
    }
    free(pub->disk);
    free(pub);
}

static void forward_open(fuse_req_t req, fuse_ino_t ino, int flags)
{
    struct pending *p = request(req, OP_OPEN, ino, NULL);
    if (p)
        p->flags = flags;
    forward(p);
}

/* With no_open, ENOSYS: the kernel answers this OPEN and every later one of the connection
 * itself (fc->no_open), with the pages kept across opens and no RELEASE.  The mount is
 * read-only, so the kernel refuses a write open before it gets here.  Otherwise the OPEN
 * goes to Python. */
static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (of(req)->no_open) {
        fuse_reply_err(req, ENOSYS);
        return;
    }
    if (fi->flags & (O_WRONLY | O_RDWR | O_TRUNC | O_APPEND | O_CREAT)) {
        fuse_reply_err(req, EROFS);
        return;
    }
    forward_open(req, ino, fi->flags);
}

/* The payload of a lent NVMe entry, checked; NULL if it is not (any more) what was lent:
 * evicted (punched to zeros, or its segment deleted), damaged, or unreadable.  Python's
 * read of the same block then finds out which, counts it and frees it. */
static unsigned char *read_entry(const struct disk_block *d, uint64_t *length)
{
    unsigned char header[ENTRY_HEADER];
    int fd = open(d->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    unsigned char *payload = NULL;
    if (pread(fd, header, sizeof header, (off_t)d->offset) != (ssize_t)sizeof header)
        goto out;
    uint16_t format;
    uint32_t len, own;
    uint64_t sum;
    memcpy(&format, header + 4, 2);
    memcpy(&len, header + 8, 4);
    memcpy(&sum, header + 28, 8);
    memcpy(&own, header + 36, 4);
    uint64_t alloc = (ENTRY_HEADER + (uint64_t)len + ALLOCATION_UNIT - 1) / ALLOCATION_UNIT * ALLOCATION_UNIT;
    if (memcmp(header, "CFSG", 4) != 0 || format != ENTRY_FORMAT || memcmp(header + 12, d->key, 16) != 0
        || XXH32(header, 36, 0) != own || alloc != d->alloc)
        goto out;
    payload = malloc(len ? len : 1);
    if (!payload)
        goto out;
    if (pread(fd, payload, len, (off_t)(d->offset + ENTRY_HEADER)) != (ssize_t)len || XXH3_64bits(payload, len) != sum) {
        free(payload);
        payload = NULL;
        goto out;
    }
    *length = len;
out:
    close(fd);
    return payload;
}

/* Serve a READ from the lent blocks of the inode's publication; 0 (nothing sent) if any
 * byte of the range is on a block that is not lent, or an NVMe entry fails its check:
 * then Python serves the whole request.  A served READ is reported (OP_SERVED) with what
 * it read, queued before the answer so that Python counts reads in the kernel's order. */
static int serve_lent(Session *s, fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
{
    struct iovec iov[MAX_READ_BLOCKS];
    unsigned char *payloads[MAX_READ_BLOCKS];
    int n = 0, served = 0;
    uint64_t first = 0, ram_mask = 0, ram_bytes = 0, disk_mask = 0, disk_bytes = 0;
    /* The caller's pid must be taken before the answer (the request is gone after it). */
    struct pending *m = new_pending(req, OP_SERVED, ino, NULL);
    if (!m)
        return 0;
    m->req = NULL;
    pthread_rwlock_rdlock(&s->hlock);
    struct pub *pub = find_pub(s, ino);
    if (!pub || !pub->nblocks || off < 0)
        goto out;
    uint64_t start = (uint64_t)off, end = start + size < pub->size ? start + size : pub->size;
    if (start < end) {
        uint64_t bs = pub->block_size, last = (end - 1) / bs;
        first = start / bs;
        if (last >= pub->nblocks || last - first >= MAX_READ_BLOCKS)
            goto out;
        for (uint64_t i = first; i <= last; i++) {
            uint64_t from = (start > i * bs ? start : i * bs) - i * bs;
            uint64_t to = (end < (i + 1) * bs ? end : (i + 1) * bs) - i * bs;
            PyObject *block = pub->blocks[i];
            payloads[n] = NULL;
            if (block) {
                /* PyBytes_AS_STRING and _GET_SIZE only read the object's fields: no GIL
                 * is needed while a reference keeps it alive (bytes never change). */
                if ((uint64_t)PyBytes_GET_SIZE(block) < to)
                    goto out;
                iov[n].iov_base = PyBytes_AS_STRING(block) + from;
                ram_mask |= 1ULL << (i - first);
                ram_bytes += to - from;
            } else if (pub->disk && pub->disk[i]) {
                /* An NVMe entry is read and checked whole, so it serves a READ of its
                 * whole block, or of any part of a one-block file (the entry is the file);
                 * a part of a larger file's block goes to Python, whose read brings the
                 * block into RAM, instead of a block's read and checksum per READ. */
                uint64_t block_len = pub->size - i * bs < bs ? pub->size - i * bs : bs;
                if (pub->nblocks > 1 && (from != 0 || to != block_len))
                    goto out;
                uint64_t length = 0;
                unsigned char *payload = read_entry(pub->disk[i], &length);
                if (!payload || length < to) {
                    free(payload);
                    goto out;
                }
                payloads[n] = payload;
                iov[n].iov_base = payload + from;
                disk_mask |= 1ULL << (i - first);
                disk_bytes += to - from;
            } else {
                goto out;
            }
            iov[n].iov_len = to - from;
            n++;
        }
    }
    m->off = start;
    m->size = ram_bytes + disk_bytes;
    m->first = first;
    m->ram_bytes = ram_bytes;
    m->ram_mask = ram_mask;
    m->disk_bytes = disk_bytes;
    m->disk_mask = disk_mask;
    push(s, m, 0);
    m = NULL;
    /* The reply is written under the read lock, so nothing can free the blocks under it. */
    fuse_reply_iov(req, iov, n);
    served = 1;
out:
    pthread_rwlock_unlock(&s->hlock);
    free(m);
    for (int i = 0; i < n; i++)
        free(payloads[i]);
    return served;
}

/* A lent NVMe block from Python's (path: bytes, offset, allocated bytes, key: 16 bytes);
 * NULL with an exception set if it is malformed. */
static struct disk_block *disk_block_of(PyObject *t)
{
    const char *path, *key;
    Py_ssize_t key_len;
    unsigned long long offset, alloc;
    if (!PyArg_ParseTuple(t, "yKKy#", &path, &offset, &alloc, &key, &key_len))
        return NULL;
    if (key_len != 16) {
        PyErr_Format(PyExc_ValueError, "a block key is 16 bytes, not %zd", key_len);
        return NULL;
    }
    struct disk_block *d = calloc(1, sizeof *d);
    if (!d || !(d->path = strdup(path))) {
        free(d);
        PyErr_NoMemory();
        return NULL;
    }
    d->offset = offset;
    d->alloc = alloc;
    memcpy(d->key, key, 16);
    return d;
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    if (!serve_lent(of(req), req, ino, size, off))
        forward_range(req, OP_READ, ino, size, off, fi);
}

/* A handle Python gave (fh != 0) is closed: Python is told (no reply is awaited: nothing
 * about a read-only handle's end can fail).  Handle 0 carries nothing: reads are by inode. */
static void release_fh(Session *s, fuse_ino_t ino, uint64_t fh)
{
    if (!fh)
        return;
    struct pending *m = new_pending(NULL, OP_RELEASE, ino, NULL);
    if (!m) {
        fuse_log(FUSE_LOG_ERR, "cubefs-fuse: out of memory reporting a release\n");
        return;
    }
    m->fh = fh;
    push(s, m, 0);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    Session *s = of(req);
    uint64_t fh = fi->fh;
    fuse_reply_err(req, 0);
    release_fh(s, ino, fh);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino)
{
    forward(request(req, OP_STATFS, ino, NULL));
}

static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino; (void)fi;
    /* Nothing is ever written: ENOSYS once makes the kernel stop sending FLUSH on close
     * for the whole connection (fc->no_flush). */
    fuse_reply_err(req, ENOSYS);
}

static void op_ioctl(fuse_req_t req, fuse_ino_t ino, unsigned int cmd, void *arg,
                     struct fuse_file_info *fi, unsigned flags, const void *in_buf,
                     size_t in_bufsz, size_t out_bufsz)
{
    (void)ino; (void)cmd; (void)arg; (void)fi; (void)flags; (void)in_buf; (void)in_bufsz; (void)out_bufsz;
    /* Python's open() asks isatty() through TCGETS on every file: not a terminal. */
    fuse_reply_err(req, ENOTTY);
}

/* The volume is read-only: each modifying operation is refused, whatever reaches us past
 * the `ro` mount option. */
static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set, struct fuse_file_info *fi)
{ (void)ino; (void)attr; (void)to_set; (void)fi; fuse_reply_err(req, EROFS); }
static void op_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, dev_t rdev)
{ (void)parent; (void)name; (void)mode; (void)rdev; fuse_reply_err(req, EROFS); }
static void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{ (void)parent; (void)name; (void)mode; fuse_reply_err(req, EROFS); }
static void op_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{ (void)parent; (void)name; fuse_reply_err(req, EROFS); }
static void op_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{ (void)link; (void)parent; (void)name; fuse_reply_err(req, EROFS); }
static void op_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags)
{ (void)parent; (void)name; (void)newparent; (void)newname; (void)flags; fuse_reply_err(req, EROFS); }
static void op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname)
{ (void)ino; (void)newparent; (void)newname; fuse_reply_err(req, EROFS); }
static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off, struct fuse_file_info *fi)
{ (void)ino; (void)buf; (void)size; (void)off; (void)fi; fuse_reply_err(req, EROFS); }
static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, struct fuse_file_info *fi)
{ (void)parent; (void)name; (void)mode; (void)fi; fuse_reply_err(req, EROFS); }
static void op_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value, size_t size, int flags)
{ (void)ino; (void)name; (void)value; (void)size; (void)flags; fuse_reply_err(req, EROFS); }
static void op_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name)
{ (void)ino; (void)name; fuse_reply_err(req, EROFS); }
static void op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length, struct fuse_file_info *fi)
{ (void)ino; (void)mode; (void)offset; (void)length; (void)fi; fuse_reply_err(req, EROFS); }

static const struct fuse_lowlevel_ops operations = {
    .init = op_init,
    .lookup = op_lookup,
    .forget = op_forget,
    .forget_multi = op_forget_multi,
    .getattr = op_getattr,
    .readlink = op_readlink,
    .opendir = op_opendir,
    .readdirplus = op_readdirplus,
    .releasedir = op_releasedir,
    .open = op_open,
    .read = op_read,
    .release = op_release,
    .statfs = op_statfs,
    .flush = op_flush,
    .ioctl = op_ioctl,
    .setattr = op_setattr,
    .mknod = op_mknod,
    .mkdir = op_mkdir,
    .unlink = op_unlink,
    .rmdir = op_unlink,
    .symlink = op_symlink,
    .rename = op_rename,
    .link = op_link,
    .write = op_write,
    .create = op_create,
    .setxattr = op_setxattr,
    .removexattr = op_removexattr,
    .fallocate = op_fallocate,
};

/* ---- the reader threads ---- */

static void *reader(void *arg)
{
    Session *s = arg;
    struct fuse_buf buf;
    memset(&buf, 0, sizeof buf);
    int stopped = 0;  /* told to stop (stopfd), rather than the connection ending */
    /* EPOLLEXCLUSIVE: a new request wakes one idle reader, not all of them (measured: with
     * poll() every request woke the four readers, three of which found nothing to read). */
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event dev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.fd = fuse_session_fd(s->se)};
    struct epoll_event stop = {.events = EPOLLIN, .data.fd = s->stopfd};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, dev.data.fd, &dev) < 0
        || epoll_ctl(ep, EPOLL_CTL_ADD, s->stopfd, &stop) < 0) {
        fuse_log(FUSE_LOG_ERR, "cubefs-fuse: a reader cannot wait: %s\n", strerror(errno));
        goto out;
    }
    while (!fuse_session_exited(s->se)) {
        struct epoll_event events[2];
        int n = epoll_wait(ep, events, 2, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        for (int i = 0; i < n; i++)
            stopped |= events[i].data.fd == s->stopfd;
        if (stopped)
            break;
        /* The fd is non-blocking: a reader woken with another finds nothing (EAGAIN).
         * An unmounted connection reads ENODEV and exits the session. */
        int r = fuse_session_receive_buf(s->se, &buf);
        if (r == -EAGAIN || r == -EINTR)
            continue;
        if (r <= 0)
            break;
        if (!(buf.flags & FUSE_BUF_IS_FD) && (size_t)r >= sizeof(struct fuse_in_header)
            && ((const struct fuse_in_header *)buf.mem)->opcode == FUSE_INIT && (size_t)r <= INIT_MAX) {
            memcpy(s->init, buf.mem, (size_t)r);  /* one reader gets INIT, before any other request */
            s->init_len = (size_t)r;
        }
        fuse_session_process_buf(s->se, &buf);
        /* The first request of a connection is INIT, answered inside process_buf: only
         * now may Python tune the connection (the answer would undo an earlier tuning). */
        if (!atomic_exchange(&s->init_posted, 1))
            message(s, OP_INIT, 0, 0);
    }
out:
    if (ep >= 0)
        close(ep);
    free(buf.mem);
    /* The connection ended (or failed): the session has.  Not when stopped (close(), or
     * pause() for a handover, where the session goes on in the next process). */
    if (!stopped && !atomic_exchange(&s->exit_posted, 1))
        message(s, OP_EXIT, 0, 0);
    return NULL;
}

/* ---- the watchdog: no forwarded request waits forever ---- */

/* Requests whose answer carries data, which a stalled Python would leave the caller
 * waiting for; RELEASEDIR is not cut: Python must see it to free the handle. */
static int expires(int op)
{
    return op != OP_RELEASEDIR;
}

static void *watchdog(void *arg)
{
    Session *s = arg;
    /* Ticks of a quarter of the deadline (at least 100 ms): a request is answered at most
     * 25 % past it, and an idle daemon wakes four times per deadline. */
    int tick_ms = (int)(s->deadline_ns / 4000000ULL);
    struct pollfd stop = {.fd = s->stopfd, .events = POLLIN};
    if (tick_ms < 100)
        tick_ms = 100;
    for (;;) {
        int r = poll(&stop, 1, tick_ms);
        if (r > 0 || (r < 0 && errno != EINTR))
            break;  /* told to stop (or cannot wait: then no deadline is kept) */
        if (r < 0)
            continue;
        uint64_t now = now_ns();
        if (now < s->deadline_ns)
            continue;  /* nothing can be that old yet (the clock counts from boot) */
        uint64_t oldest = now - s->deadline_ns;
        struct pending *late = NULL;
        pthread_mutex_lock(&s->lock);
        for (size_t i = 0; i < s->nslots; i++) {  /* taken by Python, not answered */
            struct pending *p = s->slots[i];
            if (p && expires(p->op) && p->queued_ns < oldest) {
                s->slots[i] = NULL;
                s->gens[i] = s->gens[i] + 1 ? s->gens[i] + 1 : 1;
                s->free_slots[s->nfree++] = (uint32_t)i;
                p->next = late;
                late = p;
            }
        }
        struct pending **link = &s->head, *tail = NULL;  /* queued, not taken yet */
        while (*link) {
            struct pending *p = *link;
            if (p->req && expires(p->op) && p->queued_ns < oldest) {
                *link = p->next;
                p->next = late;
                late = p;
            } else {
                tail = p;
                link = &p->next;
            }
        }
        s->tail = tail;
        pthread_mutex_unlock(&s->lock);
        while (late) {
            struct pending *next = late->next;
            atomic_fetch_add(&s->expired, 1);
            fuse_reply_err(late->req, EIO);
            free(late);
            late = next;
        }
    }
    return NULL;
}

/* ---- slots: requests handed to Python ---- */

/* Under s->lock.  Returns 0, or -1 with a Python exception set (GIL held by the caller). */
static int give_slot(Session *s, struct pending *p)
{
    if (s->nfree == 0) {
        size_t n = s->nslots ? s->nslots * 2 : 64;
        struct pending **slots = realloc(s->slots, n * sizeof *slots);
        if (!slots)
            goto nomem;
        s->slots = slots;
        uint32_t *gens = realloc(s->gens, n * sizeof *gens);
        if (!gens)
            goto nomem;
        s->gens = gens;
        uint32_t *free_slots = realloc(s->free_slots, n * sizeof *free_slots);
        if (!free_slots)
            goto nomem;
        s->free_slots = free_slots;
        for (size_t i = s->nslots; i < n; i++) {
            s->slots[i] = NULL;
            s->gens[i] = 1;
            s->free_slots[s->nfree++] = (uint32_t)(n - 1 - (i - s->nslots));
        }
        s->nslots = n;
    }
    uint32_t slot = s->free_slots[--s->nfree];
    s->slots[slot] = p;
    p->id = (uint64_t)slot | ((uint64_t)s->gens[slot] << 32);
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Takes the request named by id out of its slot; NULL with KeyError if there is none. */
static struct pending *claim(Session *s, unsigned long long id)
{
    uint32_t slot = (uint32_t)(id & 0xffffffffu);
    uint32_t gen = (uint32_t)(id >> 32);
    struct pending *p = NULL;
    pthread_mutex_lock(&s->lock);
    if (slot < s->nslots && s->slots[slot] && s->gens[slot] == gen) {
        p = s->slots[slot];
        s->slots[slot] = NULL;
        s->gens[slot] = gen + 1 ? gen + 1 : 1;
        s->free_slots[s->nfree++] = slot;
    }
    pthread_mutex_unlock(&s->lock);
    if (!p)
        PyErr_Format(Gone, "no request %llu waits for a reply (answered at its deadline, or never given)", id);
    return p;
}

/* ---- the Python type ---- */

static PyObject *raise_errno(int err, const char *what)
{
    char why[sizeof last_log];
    pthread_mutex_lock(&last_log_lock);
    memcpy(why, last_log, sizeof why);
    pthread_mutex_unlock(&last_log_lock);
    if (why[0])
        PyErr_Format(PyExc_OSError, "%s: %s (%s)", what, strerror(err), why);
    else
        PyErr_Format(PyExc_OSError, "%s: %s", what, strerror(err));
    return NULL;
}

static void stop_readers(Session *s)
{
    if (!s->started)
        return;
    uint64_t one = 1;
    if (write(s->stopfd, &one, sizeof one) < 0 && errno != EAGAIN)
        fuse_log(FUSE_LOG_ERR, "cubefs-fuse: cannot stop the readers: %s\n", strerror(errno));
    pthread_mutex_lock(&s->lock);
    s->stopping = 1;
    pthread_cond_broadcast(&s->flush_cond);
    pthread_mutex_unlock(&s->lock);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < s->nthreads; i++)
        pthread_join(s->threads[i], NULL);
    if (s->watching)
        pthread_join(s->watchdog, NULL);
    if (s->flushing)
        pthread_join(s->flusher, NULL);
    Py_END_ALLOW_THREADS
    s->started = s->watching = s->flushing = 0;
}

/* A list of requests that will not be answered: EIO to each, then freed (with the GIL). */
static void fail_all(struct pending *q)
{
    while (q) {
        struct pending *next = q->next;
        if (q->req)
            fuse_reply_err(q->req, EIO);
        free(q);
        q = next;
    }
}

/* Requests nobody will answer any more (the session is closing): EIO, then freed. */
static void fail_outstanding(Session *s)
{
    pthread_mutex_lock(&s->lock);
    struct pending *q = s->head;
    s->head = s->tail = NULL;
    for (size_t i = 0; i < s->nslots; i++) {
        struct pending *p = s->slots[i];
        if (p) {
            s->slots[i] = NULL;
            p->next = q;
            q = p;
        }
    }
    s->nfree = 0;
    for (size_t i = 0; i < s->nslots; i++)
        s->free_slots[s->nfree++] = (uint32_t)(s->nslots - 1 - i);
    pthread_mutex_unlock(&s->lock);
    fail_all(q);
    /* The readers have stopped: no lock is needed. */
    for (size_t i = 0; i < ENTRY_BUCKETS; i++) {
        while (s->entries[i]) {
            struct centry *c = s->entries[i];
            s->entries[i] = c->next;
            free(c);
        }
    }
    for (size_t i = 0; i < PUB_BUCKETS; i++) {
        while (s->pubs[i]) {
            struct pub *pub = s->pubs[i];
            s->pubs[i] = pub->next;
            free_pub(pub);
        }
    }
}

/* Unmount an adopted connection's mount point (libfuse only unmounts what it mounted), as
 * libfuse does: nothing if the connection is gone already (POLLERR: unmounted, or aborted
 * through /sys/fs/fuse/connections), else a lazy unmount, through fusermount3 when this
 * process may not unmount itself.  Called without the GIL, the descriptor still open. */
static void unmount_adopted(const char *mountpoint, int fd)
{
    struct pollfd pfd = {.fd = fd, .events = 0};
    if (poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLERR))
        return;
    if (umount2(mountpoint, MNT_DETACH) == 0 || errno == EINVAL || errno == ENOENT)
        return;
    char *argv[] = {"fusermount3", "-u", "-q", "-z", "--", (char *)mountpoint, NULL};
    pid_t pid;
    extern char **environ;
    if (posix_spawnp(&pid, "fusermount3", NULL, NULL, argv, environ) != 0) {
        fuse_log(FUSE_LOG_ERR, "cubefs-fuse: cannot unmount %s: %s\n", mountpoint, strerror(errno));
        return;
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
}

static void session_close(Session *s)
{
    stop_readers(s);
    if (s->se) {
        fail_outstanding(s);
        if (s->mounted) {
            Py_BEGIN_ALLOW_THREADS
            fuse_session_unmount(s->se);
            Py_END_ALLOW_THREADS
            s->mounted = 0;
        }
        if (s->adopted) {
            Py_BEGIN_ALLOW_THREADS
            unmount_adopted(s->adopted, fuse_session_fd(s->se));
            Py_END_ALLOW_THREADS
        }
        fuse_session_destroy(s->se);
        s->se = NULL;
    }
    free(s->adopted);
    s->adopted = NULL;
}

/* The adopted connection's I/O (fuse_session_custom_io): plain read and writev, except
 * that the answer to the replayed INIT is dropped (the kernel had its answer long ago). */
static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    return read(fd, buf, len);
}

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    Session *s = userdata;
    if (s->replaying) {
        ssize_t n = 0;
        for (int i = 0; i < count; i++)
            n += (ssize_t)iov[i].iov_len;
        return n;
    }
    return writev(fd, iov, count);
}

/* Take over a connection another session detached: fd and its INIT request (what the kernel
 * negotiated is set up again from it).  0, or -1 with a Python exception set. */
static int adopt(Session *s, int fd, const char *mountpoint, const unsigned char *init, size_t len)
{
    const struct fuse_in_header *in = (const void *)init;
    if (len < sizeof *in + sizeof(uint32_t) * 2 || len > INIT_MAX || in->opcode != FUSE_INIT || in->len != len) {
        PyErr_SetString(PyExc_ValueError, "init is not a FUSE INIT request");
        return -1;
    }
    /* s->adopted (closing unmounts) is set last: a session that fails to adopt must never
     * unmount the mount it was to serve, which its predecessor still serves. */
    char *adopted = strdup(mountpoint);
    if (!adopted) {
        PyErr_NoMemory();
        return -1;
    }
    static const struct fuse_custom_io io = {.read = io_read, .writev = io_writev};
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (dup_fd < 0) {
        free(adopted);
        raise_errno(errno, "cannot adopt the connection");
        return -1;
    }
    if (fuse_session_custom_io(s->se, &io, dup_fd) != 0) {
        close(dup_fd);
        free(adopted);
        raise_errno(EINVAL, "fuse_session_custom_io");
        return -1;
    }
    memcpy(s->init, init, len);
    s->init_len = len;
    /* libfuse may keep a pointer into the buffer while it processes it: a copy of its own. */
    unsigned char copy[INIT_MAX];
    memcpy(copy, init, len);
    struct fuse_buf buf = {.size = len, .mem = copy};
    s->replaying = 1;
    fuse_session_process_buf(s->se, &buf);
    s->replaying = 0;
    if (!s->initialized) {  /* libfuse refused it (a protocol it does not speak): not servable */
        free(adopted);
        PyErr_SetString(PyExc_ValueError, "libfuse refused the connection's INIT request");
        return -1;
    }
    atomic_store(&s->init_posted, 1);  /* the connection was tuned by the session before */
    s->adopted = adopted;
    return 0;
}

static void Session_dealloc(Session *s)
{
    session_close(s);
    if (s->efd >= 0)
        close(s->efd);
    if (s->stopfd >= 0)
        close(s->stopfd);
    free(s->threads);
    free(s->slots);
    free(s->gens);
    free(s->free_slots);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->flush_cond);
    pthread_rwlock_destroy(&s->hlock);
    pthread_rwlock_destroy(&s->elock);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *new_session(PyTypeObject *type, const char *mountpoint, const char *options, int threads,
                             double entry_timeout, double attr_timeout, double request_timeout, int no_open,
                             int adopt_fd, const void *init, size_t init_len);

static PyObject *Session_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"mountpoint", "options", "threads", "entry_timeout", "attr_timeout",
                             "request_timeout", "no_open", "adopt_fd", "init", NULL};
    const char *mountpoint, *options;
    int threads = 4, no_open = 0, adopt_fd = -1;
    double entry_timeout = 1.0, attr_timeout = 1.0, request_timeout = 0.0;
    Py_buffer init = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ss|idddpiy*", kwlist, &mountpoint, &options, &threads,
                                     &entry_timeout, &attr_timeout, &request_timeout, &no_open,
                                     &adopt_fd, &init))
        return NULL;
    PyObject *made = new_session(type, mountpoint, options, threads, entry_timeout, attr_timeout,
                                 request_timeout, no_open, adopt_fd, init.buf, (size_t)init.len);
    if (init.obj)
        PyBuffer_Release(&init);
    return made;
}

static PyObject *new_session(PyTypeObject *type, const char *mountpoint, const char *options, int threads,
                             double entry_timeout, double attr_timeout, double request_timeout, int no_open,
                             int adopt_fd, const void *init, size_t init_len)
{
    if (!(request_timeout >= 0.0 && request_timeout < 1e6))
        return PyErr_Format(PyExc_ValueError, "request_timeout must be 0 (none) or seconds below 1e6");
    /* More readers than this only contend for one descriptor; the kernel queue is the buffer. */
    if (threads < 1 || threads > 64)
        return PyErr_Format(PyExc_ValueError, "threads must be 1..64, not %d", threads);
    Session *s = (Session *)type->tp_alloc(type, 0);
    if (!s)
        return NULL;
    s->efd = s->stopfd = -1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&s->flush_cond, &monotonic);
    pthread_condattr_destroy(&monotonic);
    pthread_rwlock_init(&s->hlock, NULL);
    pthread_rwlock_init(&s->elock, NULL);
    s->entry_timeout = entry_timeout;
    s->attr_timeout = attr_timeout;
    s->no_open = no_open;
    s->deadline_ns = (uint64_t)(request_timeout * 1e9);
    s->nthreads = threads;
    s->threads = calloc((size_t)threads, sizeof *s->threads);
    s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->stopfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!s->threads) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    if (s->efd < 0 || s->stopfd < 0) {
        int err = errno;
        Py_DECREF(s);
        return raise_errno(err, "eventfd");
    }
    char *argv[] = {"cubefs-fuse", "-o", (char *)options, NULL};
    struct fuse_args fargs = FUSE_ARGS_INIT(3, argv);
    pthread_mutex_lock(&last_log_lock);
    last_log[0] = '\0';
    pthread_mutex_unlock(&last_log_lock);
    fuse_set_log_func(session_log);
    s->se = fuse_session_new(&fargs, &operations, sizeof operations, s);
    if (!s->se) {
        Py_DECREF(s);
        return raise_errno(EINVAL, "fuse_session_new");
    }
    if (adopt_fd >= 0) {
        if (adopt(s, adopt_fd, mountpoint, init, init_len) < 0) {
            Py_DECREF(s);
            return NULL;
        }
    } else {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = fuse_session_mount(s->se, mountpoint);
        Py_END_ALLOW_THREADS
        if (rc != 0) {
            Py_DECREF(s);
            return raise_errno(EIO, "cannot mount");
        }
        s->mounted = 1;
    }
    int fd = fuse_session_fd(s->se);
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) {
        int err = errno;
        Py_DECREF(s);
        return raise_errno(err, "fcntl(/dev/fuse)");
    }
    return (PyObject *)s;
}

/* The session's threads are named (cfs-*: their comm, as /proc and top show it) so that
 * a profile of the daemon tells C's share from the interpreter's; a name that does not
 * take changes nothing else. */
static PyObject *Session_start(Session *s, PyObject *unused)
{
    (void)unused;
    if (!s->se || s->started || s->stopping)
        return PyErr_Format(PyExc_RuntimeError, "the session is %s",
                            !s->se ? "closed" : s->started ? "running" : "paused (for detach())");
    for (int i = 0; i < s->nthreads; i++) {
        int err = pthread_create(&s->threads[i], NULL, reader, s);
        if (err) {
            s->nthreads = i;
            s->started = i > 0;
            return raise_errno(err, "pthread_create");
        }
        (void)pthread_setname_np(s->threads[i], "cfs-reader");
    }
    s->started = 1;
    int err = pthread_create(&s->flusher, NULL, flusher, s);
    if (err)
        return raise_errno(err, "pthread_create");
    (void)pthread_setname_np(s->flusher, "cfs-flusher");
    s->flushing = 1;
    if (s->deadline_ns) {
        err = pthread_create(&s->watchdog, NULL, watchdog, s);
        if (err)
            return raise_errno(err, "pthread_create");
        (void)pthread_setname_np(s->watchdog, "cfs-watchdog");
        s->watching = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *Session_fileno(Session *s, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(s->efd);
}

static PyObject *Session_take(Session *s, PyObject *unused)
{
    (void)unused;
    uint64_t count;
    if (read(s->efd, &count, sizeof count) < 0 && errno != EAGAIN)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&s->lock);
    struct pending *q = s->head;
    s->head = s->tail = NULL;
    s->signalled = 0;  /* a push from now on wakes trio again */
    s->report_due_ns = 0;
    pthread_mutex_unlock(&s->lock);
    PyObject *out = PyList_New(0);
    if (!out)
        goto fail;
    while (q) {
        struct pending *p = q;
        if (p->req) {
            pthread_mutex_lock(&s->lock);
            int rc = give_slot(s, p);
            pthread_mutex_unlock(&s->lock);
            if (rc < 0)
                goto fail;
        }
        PyObject *served;
        if (p->op == OP_SERVED) {
            served = Py_BuildValue("(KKKKK)", (unsigned long long)p->first, (unsigned long long)p->ram_bytes,
                                   (unsigned long long)p->ram_mask, (unsigned long long)p->disk_bytes,
                                   (unsigned long long)p->disk_mask);
            if (!served)
                goto fail;
        } else {
            served = Py_NewRef(Py_None);
        }
        PyObject *t = Py_BuildValue("(KiKKKKiiIIyN)", (unsigned long long)p->id, p->op,
                                    (unsigned long long)p->ino, (unsigned long long)p->fh,
                                    (unsigned long long)p->off, (unsigned long long)p->size,
                                    p->flags, (int)p->pid, (unsigned)p->uid, (unsigned)p->gid, p->name,
                                    served);
        if (!t || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            if (p->req)
                (void)claim(s, p->id);  /* out of its slot again: the loop below answers it EIO */
            goto fail;
        }
        Py_DECREF(t);
        q = p->next;
        if (!p->req)
            free(p);
    }
    return out;
fail:
    /* Whatever could not be handed over is answered EIO rather than left hanging. */
    fail_all(q);
    Py_XDECREF(out);
    return NULL;
}

static int fill_stat(PyObject *attr, struct stat *st)
{
    unsigned long long mode, nlink, uid, gid, rdev, size, blksize, blocks;
    long long atime, mtime, ctime;
    unsigned long long ino;
    if (!PyArg_ParseTuple(attr, "KKKKKKKKKLLL", &ino, &mode, &nlink, &uid, &gid, &rdev, &size,
                          &blksize, &blocks, &atime, &mtime, &ctime))
        return -1;
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_mode = (mode_t)mode;
    st->st_nlink = (nlink_t)nlink;
    st->st_uid = (uid_t)uid;
    st->st_gid = (gid_t)gid;
    st->st_rdev = (dev_t)rdev;
    st->st_size = (off_t)size;
    st->st_blksize = (blksize_t)blksize;
    st->st_blocks = (blkcnt_t)blocks;
    st->st_atim.tv_sec = atime / 1000000000LL;
    st->st_atim.tv_nsec = atime % 1000000000LL;
    st->st_mtim.tv_sec = mtime / 1000000000LL;
    st->st_mtim.tv_nsec = mtime % 1000000000LL;
    st->st_ctim.tv_sec = ctime / 1000000000LL;
    st->st_ctim.tv_nsec = ctime % 1000000000LL;
    return 0;
}

/* The timeout of an answer: ``valid_for`` (how long Python trusts what it answers), at
 * most the session's ``cap``; a NaN or negative one is 0 (the kernel asks again). */
static double timeout(double valid_for, double cap)
{
    return valid_for > 0.0 ? (valid_for < cap ? valid_for : cap) : 0.0;
}

static void fill_entry(Session *s, struct fuse_entry_param *e, const struct stat *st, double valid_for)
{
    memset(e, 0, sizeof *e);
    e->ino = st->st_ino;
    e->generation = 0;
    e->attr = *st;
    e->attr_timeout = timeout(valid_for, s->attr_timeout);
    e->entry_timeout = timeout(valid_for, s->entry_timeout);
}

/* ---- entries ---- */

/* Answer a LOOKUP with e.  If the kernel does not take it (the LOOKUP was interrupted), it
 * counts no lookup of e->ino: Python is told as if the kernel had sent a FORGET. */
static void send_entry(Session *s, fuse_req_t req, const struct fuse_entry_param *e)
{
    if (fuse_reply_entry(req, e) == -ENOENT)
        message(s, OP_FORGET, e->ino, 1);
}

static size_t entry_bucket(fuse_ino_t parent, const char *name, size_t len)
{
    uint64_t h = 1469598103934665603ULL ^ ((uint64_t)parent * 0x9E3779B97F4A7C15ULL);  /* FNV-1a over the name */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    return (size_t)(h % ENTRY_BUCKETS);
}

/* Under elock (either mode): the link to (parent, name)'s entry, or to the chain's end. */
static struct centry **entry_link(Session *s, fuse_ino_t parent, const char *name, size_t len)
{
    struct centry **link = &s->entries[entry_bucket(parent, name, len)];
    while (*link && !((*link)->parent == parent && (*link)->len == len && memcmp((*link)->name, name, len) == 0))
        link = &(*link)->next;
    return link;
}

/* Answer a LOOKUP from its published entry, if there is one not expired: 1 (answered), or
 * 0 (Python answers it).  The report is queued before the answer and under the read lock,
 * so once withdraw_entry() returns, every answer made from the entry is in the queue. */
static int answer_entry(Session *s, fuse_req_t req, fuse_ino_t parent, const char *name)
{
    size_t len = strlen(name);
    uint64_t now = now_ns();
    struct fuse_entry_param e;
    struct pending *m = new_pending(NULL, OP_LOOKED, 0, NULL);
    if (!m)
        return 0;
    pthread_rwlock_rdlock(&s->elock);
    struct centry *c = *entry_link(s, parent, name, len);
    if (!c || now >= c->expires_ns) {
        pthread_rwlock_unlock(&s->elock);
        free(m);
        return 0;
    }
    fill_entry(s, &e, &c->attr, (double)(c->expires_ns - now) / 1e9);
    m->ino = c->ino;
    push(s, m, 0);
    pthread_rwlock_unlock(&s->elock);
    send_entry(s, req, &e);
    return 1;
}

/* publish_entry(parent, name, attr, expires_ns): LOOKUPs of (parent, name) are answered
 * with attr (its ino field the inode) until expires_ns (CLOCK_MONOTONIC, time.monotonic_ns()),
 * each reported (OP_LOOKED).  Replaces the name's earlier entry. */
static PyObject *Session_publish_entry(Session *s, PyObject *args)
{
    unsigned long long parent, expires;
    const char *name;
    Py_ssize_t len;
    PyObject *attr;
    struct stat st;
    if (!PyArg_ParseTuple(args, "Ky#O!K", &parent, &name, &len, &PyTuple_Type, &attr, &expires)
        || fill_stat(attr, &st) < 0)
        return NULL;
    if (len == 0 || len > 255 || memchr(name, '/', (size_t)len) || memchr(name, '\0', (size_t)len))
        return PyErr_Format(PyExc_ValueError, "an entry's name is 1-255 bytes without '/' or NUL");
    struct centry *c = malloc(sizeof *c + (size_t)len + 1);
    if (!c)
        return PyErr_NoMemory();
    c->parent = parent;
    c->ino = st.st_ino;
    c->expires_ns = expires;
    c->attr = st;
    c->len = (size_t)len;
    memcpy(c->name, name, (size_t)len);
    c->name[len] = '\0';
    struct centry *old;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&s->elock);
    struct centry **link = entry_link(s, parent, name, (size_t)len);
    old = *link;
    c->next = old ? old->next : NULL;
    *link = c;
    pthread_rwlock_unlock(&s->elock);
    Py_END_ALLOW_THREADS
    free(old);
    Py_RETURN_NONE;
}

/* withdraw_entry(parent, name, expires_ns) -> bool: the entry published with that deadline
 * (0: with any) answers no LOOKUP once this returns (a later publication of the name is
 * left alone: False). */
static PyObject *Session_withdraw_entry(Session *s, PyObject *args)
{
    unsigned long long parent, expires;
    const char *name;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Ky#K", &parent, &name, &len, &expires))
        return NULL;
    struct centry *old = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&s->elock);
    struct centry **link = entry_link(s, parent, name, (size_t)len);
    if (*link && (expires == 0 || (*link)->expires_ns == expires)) {
        old = *link;
        *link = old->next;
    }
    pthread_rwlock_unlock(&s->elock);
    Py_END_ALLOW_THREADS
    free(old);
    return PyBool_FromLong(old != NULL);
}

/* The reply methods: each claims its request, writes the answer without the GIL (a write
 * to /dev/fuse), and frees it.  A reply the kernel no longer wants (the request was
 * interrupted, the connection is gone) fails there and is dropped: nothing to do. */
#define CLAIM(s, id) struct pending *p = claim((s), (id)); if (!p) return NULL
#define ANSWER(call) do { Py_BEGIN_ALLOW_THREADS (void)(call); Py_END_ALLOW_THREADS } while (0)
/* Answer the claimed request p, free it, return None to Python. */
#define REPLY(call) do { ANSWER(call); free(p); Py_RETURN_NONE; } while (0)

static PyObject *Session_reply_err(Session *s, PyObject *args)
{
    unsigned long long id;
    int err;
    if (!PyArg_ParseTuple(args, "Ki", &id, &err))
        return NULL;
    CLAIM(s, id);
    REPLY(fuse_reply_err(p->req, err));
}

static PyObject *Session_reply_entry(Session *s, PyObject *args)
{
    unsigned long long id;
    PyObject *attr;
    double valid_for;
    struct stat st;
    struct fuse_entry_param e;
    if (!PyArg_ParseTuple(args, "KO!d", &id, &PyTuple_Type, &attr, &valid_for) || fill_stat(attr, &st) < 0)
        return NULL;
    CLAIM(s, id);
    fill_entry(s, &e, &st, valid_for);
    REPLY(send_entry(s, p->req, &e));
}

static PyObject *Session_reply_attr(Session *s, PyObject *args)
{
    unsigned long long id;
    PyObject *attr;
    double valid_for;
    struct stat st;
    if (!PyArg_ParseTuple(args, "KO!d", &id, &PyTuple_Type, &attr, &valid_for) || fill_stat(attr, &st) < 0)
        return NULL;
    CLAIM(s, id);
    REPLY(fuse_reply_attr(p->req, &st, timeout(valid_for, s->attr_timeout)));
}

/* reply_open(id, fh, keep_cache, direct_io): answer an OPEN with Python's handle fh (0:
 * none, reads are by inode).  If the kernel does not take the answer (the open was
 * interrupted), a RELEASE of fh is reported as if the kernel had sent it. */
static PyObject *Session_reply_open(Session *s, PyObject *args)
{
    unsigned long long id, fh;
    int keep_cache, direct_io;
    if (!PyArg_ParseTuple(args, "KKpp", &id, &fh, &keep_cache, &direct_io))
        return NULL;
    CLAIM(s, id);
    fuse_ino_t ino = p->ino;
    struct fuse_file_info fi;
    memset(&fi, 0, sizeof fi);
    fi.fh = fh;
    fi.keep_cache = keep_cache ? 1 : 0;
    fi.direct_io = direct_io ? 1 : 0;
    Py_BEGIN_ALLOW_THREADS
    if (fuse_reply_open(p->req, &fi) == -ENOENT)
        release_fh(s, ino, fh);
    Py_END_ALLOW_THREADS
    free(p);
    Py_RETURN_NONE;
}

/* reply_opendir(id, dh) -> bool: False if the kernel did not take the answer (the open was
 * interrupted): then no RELEASEDIR will come, and the caller frees dh itself. */
static PyObject *Session_reply_opendir(Session *s, PyObject *args)
{
    unsigned long long id, dh;
    if (!PyArg_ParseTuple(args, "KK", &id, &dh))
        return NULL;
    CLAIM(s, id);
    struct fuse_file_info fi;
    memset(&fi, 0, sizeof fi);
    fi.fh = dh;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fuse_reply_open(p->req, &fi);
    Py_END_ALLOW_THREADS
    free(p);
    return PyBool_FromLong(rc != -ENOENT);
}

/* A lent block from Python: bytes (a RAM block, referenced), a (path, offset, size, key)
 * tuple (an NVMe entry) or None.  0, or -1 with an exception set. */
static int lent_block(PyObject *b, PyObject **ram, struct disk_block **disk)
{
    *ram = NULL;
    *disk = NULL;
    if (PyBytes_Check(b)) {
        *ram = Py_NewRef(b);
    } else if (PyTuple_Check(b)) {
        if (!(*disk = disk_block_of(b)))
            return -1;
    } else if (b != Py_None) {
        PyErr_Format(PyExc_TypeError, "a lent block is bytes, a (path, offset, size, key) tuple or None");
        return -1;
    }
    return 0;
}

/* publish(ino, size, block_size, blocks): READs of ino's lent blocks (one per block of the
 * file: bytes from RAM, a (path, offset, size, key) tuple of an NVMe entry, or None; empty
 * when none can be lent) are served here from now on.  Replaces the inode's earlier
 * publication, which nothing uses once this returns. */
static PyObject *Session_publish(Session *s, PyObject *args)
{
    unsigned long long ino, size, block_size;
    PyObject *blocks, *seq;
    if (!PyArg_ParseTuple(args, "KKKO", &ino, &size, &block_size, &blocks))
        return NULL;
    if (!(seq = PySequence_Fast(blocks, "blocks must be a sequence")))
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > UINT32_MAX || (n && (block_size == 0 || (unsigned long long)(n - 1) * block_size >= size
                                 || (unsigned long long)n * block_size < size))) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "%zd blocks of %llu bytes for a file of %llu bytes", n, block_size, size);
    }
    struct pub *pub = calloc(1, sizeof *pub + (size_t)n * sizeof(PyObject *));
    if (!pub) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    pub->ino = ino;
    pub->size = size;
    pub->block_size = block_size;
    pub->nblocks = (uint32_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ram;
        struct disk_block *disk;
        if (lent_block(PySequence_Fast_GET_ITEM(seq, i), &ram, &disk) < 0)
            goto bad;
        pub->blocks[i] = ram;
        if (disk) {
            if (!pub->disk && !(pub->disk = calloc((size_t)n, sizeof *pub->disk))) {
                free_disk_block(disk);
                PyErr_NoMemory();
                goto bad;
            }
            pub->disk[i] = disk;
        }
    }
    Py_DECREF(seq);
    struct pub *old;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&s->hlock);
    old = unlink_pub(s, ino);
    pub->next = s->pubs[ino % PUB_BUCKETS];
    s->pubs[ino % PUB_BUCKETS] = pub;
    pthread_rwlock_unlock(&s->hlock);
    Py_END_ALLOW_THREADS
    free_pub(old);
    Py_RETURN_NONE;
bad:
    Py_DECREF(seq);
    free_pub(pub);
    return NULL;
}

/* lend(ino, index, block) -> bool: block ``index`` of ino's publication is now ``block``
 * (as publish() takes them: bytes, an NVMe entry's tuple, or None to take it back);
 * what it replaces is unused once this returns.  False if ino is not published or has
 * no such block. */
static PyObject *Session_lend(Session *s, PyObject *args)
{
    unsigned long long ino, index;
    PyObject *b, *ram, *old_ram = NULL;
    struct disk_block *disk, *old_disk = NULL;
    if (!PyArg_ParseTuple(args, "KKO", &ino, &index, &b) || lent_block(b, &ram, &disk) < 0)
        return NULL;
    int done = 0, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&s->hlock);
    struct pub *pub = find_pub(s, ino);
    if (pub && index < pub->nblocks) {
        if (disk && !pub->disk && !(pub->disk = calloc(pub->nblocks, sizeof *pub->disk))) {
            nomem = 1;
        } else {
            old_ram = pub->blocks[index];
            old_disk = pub->disk ? pub->disk[index] : NULL;
            pub->blocks[index] = ram;
            if (pub->disk)
                pub->disk[index] = disk;
            ram = NULL;
            disk = NULL;
            done = 1;
        }
    }
    pthread_rwlock_unlock(&s->hlock);
    Py_END_ALLOW_THREADS
    Py_XDECREF(old_ram);
    Py_XDECREF(ram);
    free_disk_block(old_disk);
    free_disk_block(disk);
    if (nomem)
        return PyErr_NoMemory();
    return PyBool_FromLong(done);
}

/* withdraw(ino): ino's READs go to Python again; its lent blocks are unused
 * once this returns. */
static PyObject *Session_withdraw(Session *s, PyObject *args)
{
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    struct pub *old;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&s->hlock);
    old = unlink_pub(s, ino);
    pthread_rwlock_unlock(&s->hlock);
    Py_END_ALLOW_THREADS
    free_pub(old);
    Py_RETURN_NONE;
}

static PyObject *Session_reply_buf(Session *s, PyObject *args)
{
    unsigned long long id;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Ky*", &id, &view))
        return NULL;
    struct pending *p = claim(s, id);
    if (!p) {
        PyBuffer_Release(&view);
        return NULL;
    }
    ANSWER(fuse_reply_buf(p->req, view.buf, (size_t)view.len));
    PyBuffer_Release(&view);
    free(p);
    Py_RETURN_NONE;
}

static PyObject *Session_reply_readlink(Session *s, PyObject *args)
{
    unsigned long long id;
    const char *target;
    if (!PyArg_ParseTuple(args, "Ky", &id, &target))
        return NULL;
    CLAIM(s, id);
    REPLY(fuse_reply_readlink(p->req, target));
}

static PyObject *Session_reply_statfs(Session *s, PyObject *args)
{
    unsigned long long id, bsize, frsize, blocks, bfree, bavail, files, ffree, favail, namemax;
    if (!PyArg_ParseTuple(args, "K(KKKKKKKKK)", &id, &bsize, &frsize, &blocks, &bfree, &bavail, &files,
                          &ffree, &favail, &namemax))
        return NULL;
    CLAIM(s, id);
    struct statvfs st;
    memset(&st, 0, sizeof st);
    st.f_bsize = bsize;
    st.f_frsize = frsize;
    st.f_blocks = blocks;
    st.f_bfree = bfree;
    st.f_bavail = bavail;
    st.f_files = files;
    st.f_ffree = ffree;
    st.f_favail = favail;
    st.f_namemax = namemax;
    REPLY(fuse_reply_statfs(p->req, &st));
}

/* entries: a sequence of (name: bytes, attr: tuple, next_offset: int, valid_for: float).  Packs as many as
 * the kernel's buffer holds and returns how many it took: each one taken is a lookup the
 * kernel will FORGET; the caller forgets the others itself. */
static PyObject *Session_reply_readdir(Session *s, PyObject *args)
{
    unsigned long long id;
    PyObject *entries;
    if (!PyArg_ParseTuple(args, "KO", &id, &entries))
        return NULL;
    PyObject *seq = PySequence_Fast(entries, "entries must be a sequence");
    if (!seq)
        return NULL;
    CLAIM(s, id);
    size_t cap = (size_t)p->size, used = 0;
    char *buf = malloc(cap ? cap : 1);
    Py_ssize_t taken = 0, n = PySequence_Fast_GET_SIZE(seq);
    if (!buf) {
        fuse_reply_err(p->req, ENOMEM);
        free(p);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (; taken < n; taken++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, taken), *attr;
        const char *name;
        unsigned long long next;
        double valid_for;
        struct stat st;
        struct fuse_entry_param e;
        if (!PyArg_ParseTuple(item, "yO!Kd", &name, &PyTuple_Type, &attr, &next, &valid_for)
            || fill_stat(attr, &st) < 0) {
            fuse_reply_err(p->req, EIO);
            free(buf);
            free(p);
            Py_DECREF(seq);
            return NULL;
        }
        fill_entry(s, &e, &st, valid_for);
        size_t need = fuse_add_direntry_plus(p->req, buf + used, cap - used, name, &e, (off_t)next);
        if (need > cap - used)
            break;
        used += need;
    }
    Py_DECREF(seq);
    ANSWER(fuse_reply_buf(p->req, buf, used));
    free(buf);
    free(p);
    return PyLong_FromSsize_t(taken);
}

static PyObject *Session_exit(Session *s, PyObject *unused)
{
    (void)unused;
    if (s->se)
        fuse_session_exit(s->se);
    if (!atomic_exchange(&s->exit_posted, 1))
        message(s, OP_EXIT, 0, 0);
    Py_RETURN_NONE;
}

static PyObject *Session_pause(Session *s, PyObject *unused)
{
    (void)unused;
    stop_readers(s);
    wake(s);  /* Python looks at busy again */
    Py_RETURN_NONE;
}

/* Requests given to Python and not answered, and entries queued and not taken. */
static size_t busy(Session *s)
{
    pthread_mutex_lock(&s->lock);
    size_t n = s->nslots - s->nfree;
    for (struct pending *p = s->head; p; p = p->next)
        n++;
    pthread_mutex_unlock(&s->lock);
    return n;
}

static PyObject *Session_busy(Session *s, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(busy(s));
}

/* (fd, init): a duplicate of the session's /dev/fuse and the kernel's INIT request as it came. */
static PyObject *connection_of(Session *s)
{
    if (!s->init_len)
        return PyErr_Format(PyExc_RuntimeError, "the connection's INIT was never seen");
    int fd = fcntl(fuse_session_fd(s->se), F_DUPFD_CLOEXEC, 3);
    if (fd < 0)
        return raise_errno(errno, "cannot duplicate /dev/fuse");
    PyObject *out = Py_BuildValue("(iy#)", fd, (const char *)s->init, (Py_ssize_t)s->init_len);
    if (!out)
        close(fd);
    return out;
}

static PyObject *Session_detach(Session *s, PyObject *unused)
{
    (void)unused;
    if (!s->se || s->started)
        return PyErr_Format(PyExc_RuntimeError, "detach() needs a paused session (%s)",
                            s->se ? "its readers run" : "it is closed");
    if (busy(s))
        return PyErr_Format(PyExc_RuntimeError, "detach() with requests or reports not taken or answered");
    PyObject *out = connection_of(s);
    if (!out)
        return NULL;
    /* Freed without unmounting: the descriptor handed out keeps the connection. */
    s->mounted = 0;
    free(s->adopted);
    s->adopted = NULL;
    session_close(s);
    return out;
}

/* A duplicate of /dev/fuse and the kernel's INIT request, the session serving on: what the
 * daemon's keeper holds so that a daemon that recovers after a crash can adopt them. */
static PyObject *Session_connection(Session *s, PyObject *unused)
{
    (void)unused;
    if (!s->se)
        return PyErr_Format(PyExc_RuntimeError, "connection() of a closed session");
    return connection_of(s);
}

/* FUSE_NOTIFY_RESEND (kernel 6.9): the kernel queues again every request it gave to a
 * reader of the connection and has no answer for, with FUSE_UNIQUE_RESEND set in its
 * unique id (libfuse answers it with that id, as any other).  A daemon that recovers a
 * connection after its predecessor died calls it once: the requests the dead daemon had
 * read would otherwise never be answered, and their readers would wait forever. */
#ifndef FUSE_NOTIFY_RESEND
#define FUSE_NOTIFY_RESEND 7
#endif
static PyObject *Session_resend(Session *s, PyObject *unused)
{
    (void)unused;
    if (!s->se)
        return PyErr_Format(PyExc_RuntimeError, "resend() of a closed session");
    struct fuse_out_header out = {.len = sizeof(out), .error = FUSE_NOTIFY_RESEND, .unique = 0};
    ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    n = write(fuse_session_fd(s->se), &out, sizeof(out));
    Py_END_ALLOW_THREADS
    if (n < 0)
        return raise_errno(errno, "FUSE_NOTIFY_RESEND");
    Py_RETURN_NONE;
}

static PyObject *Session_close(Session *s, PyObject *unused)
{
    (void)unused;
    session_close(s);
    Py_RETURN_NONE;
}

static PyObject *Session_expired(Session *s, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(atomic_load(&s->expired));
}

static PyObject *Session_exited(Session *s, void *closure)
{
    (void)closure;
    return PyBool_FromLong(!s->se || fuse_session_exited(s->se));
}

static PyMethodDef Session_methods[] = {
    {"start", (PyCFunction)Session_start, METH_NOARGS, "Start the reader threads."},
    {"fileno", (PyCFunction)Session_fileno, METH_NOARGS, "The eventfd that is readable while requests wait."},
    {"take", (PyCFunction)Session_take, METH_NOARGS,
     "Every queued request: (id, op, ino, fh, offset, size, flags, pid, uid, gid, name, served) tuples."},
    {"reply_err", (PyCFunction)Session_reply_err, METH_VARARGS, "reply_err(id, errno)"},
    {"reply_entry", (PyCFunction)Session_reply_entry, METH_VARARGS,
     "reply_entry(id, attr, valid_for): the kernel keeps the entry and attributes that long (at most the session's timeouts)"},
    {"reply_attr", (PyCFunction)Session_reply_attr, METH_VARARGS,
     "reply_attr(id, attr, valid_for): the kernel keeps the attributes that long (at most the session's timeout)"},
    {"reply_open", (PyCFunction)Session_reply_open, METH_VARARGS,
     "reply_open(id, fh, keep_cache, direct_io): an answer not taken is reported as a RELEASE of fh (if not 0)"},
    {"reply_opendir", (PyCFunction)Session_reply_opendir, METH_VARARGS,
     "reply_opendir(id, dh) -> whether the kernel took it"},
    {"publish", (PyCFunction)Session_publish, METH_VARARGS,
     "publish(ino, size, block_size, blocks): lend an inode's blocks"},
    {"lend", (PyCFunction)Session_lend, METH_VARARGS,
     "lend(ino, index, block) -> False if ino has no publication with that block"},
    {"withdraw", (PyCFunction)Session_withdraw, METH_VARARGS, "withdraw(ino): nothing of ino is served here"},
    {"publish_entry", (PyCFunction)Session_publish_entry, METH_VARARGS,
     "publish_entry(parent, name, attr, expires_ns): LOOKUPs of the name answered here until then"},
    {"withdraw_entry", (PyCFunction)Session_withdraw_entry, METH_VARARGS,
     "withdraw_entry(parent, name, expires_ns) -> False if the name has no entry with that deadline"},
    {"reply_buf", (PyCFunction)Session_reply_buf, METH_VARARGS, "reply_buf(id, data)"},
    {"reply_readlink", (PyCFunction)Session_reply_readlink, METH_VARARGS, "reply_readlink(id, target)"},
    {"reply_statfs", (PyCFunction)Session_reply_statfs, METH_VARARGS, "reply_statfs(id, fields)"},
    {"reply_readdir", (PyCFunction)Session_reply_readdir, METH_VARARGS,
     "reply_readdir(id, entries) -> how many entries the kernel took"},
    {"exit", (PyCFunction)Session_exit, METH_NOARGS, "End the session: take() returns OP_EXIT."},
    {"pause", (PyCFunction)Session_pause, METH_NOARGS,
     "Stop the readers for a handover: the kernel keeps new requests; answer those given, then detach()."},
    {"detach", (PyCFunction)Session_detach, METH_NOARGS,
     "(fd, init): a duplicate of /dev/fuse and the kernel's INIT request; frees the paused, idle session "
     "without unmounting (a successor's session adopts them)"},
    {"connection", (PyCFunction)Session_connection, METH_NOARGS,
     "(fd, init): a duplicate of /dev/fuse and the kernel's INIT request, while the session serves"},
    {"resend", (PyCFunction)Session_resend, METH_NOARGS,
     "Have the kernel send again the requests read and not answered (by a daemon that died): FUSE_NOTIFY_RESEND"},
    {"close", (PyCFunction)Session_close, METH_NOARGS,
     "Stop the readers, fail what is outstanding with EIO, unmount, free the connection."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Session_getset[] = {
    {"exited", (getter)Session_exited, NULL, "True once the session has ended", NULL},
    {"busy", (getter)Session_busy, NULL, "requests given to Python and not answered, and entries not taken", NULL},
    {"expired", (getter)Session_expired, NULL, "requests answered EIO at their deadline, Python too late", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SessionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cubefs_fuse.fs._session.Session",
    .tp_basicsize = sizeof(Session),
    .tp_dealloc = (destructor)Session_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Session(mountpoint, options, threads=4, entry_timeout=1.0, attr_timeout=1.0, request_timeout=0, "
              "no_open=False): mounts and owns a FUSE connection; a forwarded request older than request_timeout "
              "seconds (0: none) is answered EIO by C; with no_open, files are opened by the kernel alone",
    .tp_methods = Session_methods,
    .tp_getset = Session_getset,
    .tp_new = Session_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cubefs_fuse.fs._session",
    "The daemon's FUSE session in C (libfuse 3 low-level API).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__session(void)
{
    if (PyType_Ready(&SessionType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Gone = PyErr_NewExceptionWithDoc("cubefs_fuse.fs._session.Gone",
                                     "The request was answered already (EIO at its deadline) or never given.",
                                     PyExc_LookupError, NULL);
    if (!Gone || PyModule_AddObject(m, "Gone", Py_NewRef(Gone)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SessionType);
    if (PyModule_AddObject(m, "Session", (PyObject *)&SessionType) < 0) {
        Py_DECREF(&SessionType);
        Py_DECREF(m);
        return NULL;
    }
    static const struct { const char *name; int value; } ops[] = {
        {"OP_LOOKUP", OP_LOOKUP}, {"OP_GETATTR", OP_GETATTR}, {"OP_READLINK", OP_READLINK},
        {"OP_OPENDIR", OP_OPENDIR}, {"OP_READDIR", OP_READDIR}, {"OP_RELEASEDIR", OP_RELEASEDIR},
        {"OP_OPEN", OP_OPEN}, {"OP_READ", OP_READ}, {"OP_RELEASE", OP_RELEASE},
        {"OP_STATFS", OP_STATFS}, {"OP_FORGET", OP_FORGET}, {"OP_INIT", OP_INIT}, {"OP_EXIT", OP_EXIT},
        {"OP_SERVED", OP_SERVED}, {"OP_LOOKED", OP_LOOKED},
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (PyModule_AddIntConstant(m, ops[i].name, ops[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    if (PyModule_AddStringConstant(m, "LIBFUSE_VERSION", fuse_pkgversion()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/*
 * cubefs_fuse.cache._index: the per-block index of a cache tier and its eviction order,
 * in C: BlockIndex.
 *
 * One record (struct slot, 48 bytes) per block: its key (a fixed length of at most 16
 * bytes, set per index: an xxh3-128 block key, or the sample store's 12-byte name), its
 * path tag, its value (a RAM block's bytes object, referenced, or an NVMe location word),
 * its size and its place in the eviction order.  A Python dict entry, its key object and
 * the policy's linked-list dicts cost ~250 bytes a block, ~520 planned; a node caching
 * 10^7 files held gigabytes of index.  Here a block costs its record and ~8 bytes of hash
 * table: ~60 bytes, planned or not (plus 4-8 of heap per planned block).
 *
 * The eviction rules (what the tiers and the sample store build on):
 *   - a block is *unplanned* (no active plan reads it) or *planned* at position next_use;
 *   - unplanned blocks are evicted first, least recently used first (a doubly linked list
 *     threaded through the records: touch() moves a block to the tail);
 *   - then planned blocks, the furthest next use first, equal next uses in key order
 *     (a binary heap of record numbers, the record holding its heap position: any block
 *     leaves it in O(log n));
 *   - victims(need, free, next_use) chooses without removing: a planned newcomer displaces
 *     only blocks needed later than itself, an unplanned one takes planned blocks only
 *     within scratch_bytes.
 *
 * Nothing here is ever rebuilt whole (the trio thread does no work proportional to the
 * cache, docs/concurrency.md): records live in chunks of CHUNK that are never moved (a
 * record's number is its address), and the hash table is split into SHARDS tables by a
 * key's first byte, each resized alone.  Values are bytes or ints, which cannot form a
 * reference cycle, so the type needs no garbage-collector support and a full collection
 * never walks a cache.  Every method holds the GIL throughout: a worker thread's
 * ``key in index`` sees each change whole.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define KEY_MAX 16
/* Hash tables, one per value of a key's first byte (``shards.SHARDS``: a caller walks the
 * index one shard per step).  At 10^7 blocks a shard holds ~40,000 keys: its resize
 * rehashes them in ~2-4 ms; at 10^8, ~40 ms once per doubling. */
#define SHARDS 256
/* Records per chunk: 4,096 x 48 bytes = 192 KiB, the most a growing index ever allocates
 * at once, and the most it holds unused. */
#define CHUNK_SHIFT 12
#define CHUNK (1u << CHUNK_SHIFT)
#define NONE UINT32_MAX              /* no record: an empty bucket, a list's end */
#define UNPLANNED (UINT32_MAX - 1)   /* slot.pos of an unplanned block */
#define FREE (UINT32_MAX - 2)        /* slot.pos of a free record */
#define MAX_RECORDS (UINT32_MAX - 3)
#define MIN_BUCKETS 8u

struct __attribute__((packed, aligned(4))) slot {
    unsigned char key[KEY_MAX];  /* the key, zero-padded to KEY_MAX */
    uint64_t tag;                /* the file's path tag; 0: unknown */
    uint64_t value;              /* a bytes object (referenced) or an int of 0 to 2^64-1; a free record: the next free one */
    uint32_t size;
    uint32_t pos;                /* planned: its heap position; UNPLANNED; FREE */
    union {
        struct {
            uint32_t prev;       /* the record before it in the unplanned list (NONE: the head) */
            uint32_t next;       /* the record after it (NONE: the tail) */
        } lru;
        int64_t next_use;        /* planned: the plan position that reads it */
    } u;
};
_Static_assert(sizeof(struct slot) == 48, "a record is 48 bytes");

struct table {
    uint32_t *buckets;  /* record numbers, NONE where empty; linear probing */
    uint32_t mask;      /* buckets - 1 (0 with no buckets) */
    uint32_t used;
};

typedef struct {
    PyObject_HEAD
    int objects;                 /* values are bytes objects (else ints) */
    Py_ssize_t key_bytes;
    long long scratch_bytes;
    long long unplanned_bytes;
    long long planned_bytes;
    struct slot **chunks;
    uint32_t nchunks;
    uint32_t records;            /* records ever handed out (free ones included) */
    uint32_t free_head;
    uint32_t len;
    uint32_t lru_head, lru_tail;
    uint32_t *heap;
    uint32_t heap_len, heap_cap;
    struct table shards[SHARDS];
} Index;

static inline struct slot *at(const Index *x, uint32_t i)
{
    return &x->chunks[i >> CHUNK_SHIFT][i & (CHUNK - 1)];
}

static inline uint64_t hash_of(const unsigned char *key)
{
    return XXH3_64bits(key, KEY_MAX);
}

/* ---- keys from Python ---- */

/* The key's bytes, zero-padded into buf; -1 with an exception if it is not bytes of the
 * index's length. */
static int key_of(const Index *x, PyObject *o, unsigned char *buf)
{
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a key is bytes, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(o) != x->key_bytes) {
        PyErr_Format(PyExc_ValueError, "a key of this index is %zd bytes, not %zd", x->key_bytes, PyBytes_GET_SIZE(o));
        return -1;
    }
    memset(buf, 0, KEY_MAX);
    memcpy(buf, PyBytes_AS_STRING(o), (size_t)x->key_bytes);
    return 0;
}

static PyObject *key_object(const Index *x, uint32_t i)
{
    return PyBytes_FromStringAndSize((const char *)at(x, i)->key, x->key_bytes);
}

/* ---- the hash tables ---- */

static uint32_t find(const Index *x, const unsigned char *key)
{
    const struct table *t = &x->shards[key[0]];
    if (!t->buckets)
        return NONE;
    for (uint32_t b = (uint32_t)hash_of(key) & t->mask;; b = (b + 1) & t->mask) {
        uint32_t i = t->buckets[b];
        if (i == NONE || memcmp(at(x, i)->key, key, KEY_MAX) == 0)
            return i;
    }
}

static void place(const Index *x, struct table *t, uint32_t i)
{
    uint32_t b = (uint32_t)hash_of(at(x, i)->key) & t->mask;
    while (t->buckets[b] != NONE)
        b = (b + 1) & t->mask;
    t->buckets[b] = i;
}

/* Resize one shard's table to ``buckets`` (a power of two above its load); -1 if out of memory. */
static int resize(Index *x, struct table *t, uint32_t buckets)
{
    uint32_t *old = t->buckets, old_n = t->buckets ? t->mask + 1 : 0;
    uint32_t *fresh = PyMem_Malloc((size_t)buckets * sizeof *fresh);
    if (!fresh)
        return -1;
    memset(fresh, 0xff, (size_t)buckets * sizeof *fresh);
    t->buckets = fresh;
    t->mask = buckets - 1;
    for (uint32_t b = 0; b < old_n; b++)
        if (old[b] != NONE)
            place(x, t, old[b]);
    PyMem_Free(old);
    return 0;
}

/* Enter record i (its key set); -1 if out of memory.  Tables stay at most 3/4 full. */
static int enter(Index *x, uint32_t i)
{
    struct table *t = &x->shards[at(x, i)->key[0]];
    uint32_t n = t->buckets ? t->mask + 1 : 0;
    if ((uint64_t)(t->used + 1) * 4 > (uint64_t)n * 3 && resize(x, t, n ? n * 2 : MIN_BUCKETS) < 0)
        return -1;
    place(x, t, i);
    t->used++;
    return 0;
}

/* Take record i out of its table: backward-shift deletion (linear probing needs no
 * tombstones: each following entry that may move into the hole does). */
static void leave(Index *x, uint32_t i)
{
    struct table *t = &x->shards[at(x, i)->key[0]];
    uint32_t hole = (uint32_t)hash_of(at(x, i)->key) & t->mask;
    while (t->buckets[hole] != i)
        hole = (hole + 1) & t->mask;
    for (uint32_t b = (hole + 1) & t->mask; t->buckets[b] != NONE; b = (b + 1) & t->mask) {
        uint32_t home = (uint32_t)hash_of(at(x, t->buckets[b])->key) & t->mask;
        /* The entry at b stays if its home lies cyclically in (hole, b]. */
        int stays = hole <= b ? (hole < home && home <= b) : (hole < home || home <= b);
        if (!stays) {
            t->buckets[hole] = t->buckets[b];
            hole = b;
        }
    }
    t->buckets[hole] = NONE;
    if (--t->used == 0) {  /* an emptied shard (a cleared tier) gives its table back */
        PyMem_Free(t->buckets);
        t->buckets = NULL;
        t->mask = 0;
    } else if (t->mask + 1 > MIN_BUCKETS && (uint64_t)t->used * 8 < (uint64_t)t->mask + 1) {
        /* Under 1/8 full: halved (then under 1/4, far from the 3/4 that doubles it), so a
         * tier that shrank gives its buckets back; if memory is short it stays as it is. */
        (void)resize(x, t, (t->mask + 1) / 2);
    }
}

/* ---- records ---- */

static uint32_t new_record(Index *x)
{
    if (x->free_head != NONE) {
        uint32_t i = x->free_head;
        x->free_head = (uint32_t)at(x, i)->value;
        return i;
    }
    if (x->records >= MAX_RECORDS)
        return NONE;
    if ((x->records & (CHUNK - 1)) == 0) {
        struct slot **chunks = PyMem_Realloc(x->chunks, (size_t)(x->nchunks + 1) * sizeof *chunks);
        if (!chunks)
            return NONE;
        x->chunks = chunks;
        if (!(chunks[x->nchunks] = PyMem_Malloc((size_t)CHUNK * sizeof(struct slot))))
            return NONE;
        x->nchunks++;
    }
    return x->records++;
}

static void free_record(Index *x, uint32_t i)
{
    struct slot *s = at(x, i);
    s->pos = FREE;
    s->value = x->free_head;
    x->free_head = i;
}

/* ---- the unplanned list ---- */

static void lru_append(Index *x, uint32_t i)
{
    struct slot *s = at(x, i);
    s->pos = UNPLANNED;
    s->u.lru.prev = x->lru_tail;
    s->u.lru.next = NONE;
    if (x->lru_tail == NONE)
        x->lru_head = i;
    else
        at(x, x->lru_tail)->u.lru.next = i;
    x->lru_tail = i;
}

static void lru_unlink(Index *x, uint32_t i)
{
    struct slot *s = at(x, i);
    if (s->u.lru.prev == NONE)
        x->lru_head = s->u.lru.next;
    else
        at(x, s->u.lru.prev)->u.lru.next = s->u.lru.next;
    if (s->u.lru.next == NONE)
        x->lru_tail = s->u.lru.prev;
    else
        at(x, s->u.lru.next)->u.lru.prev = s->u.lru.prev;
}

/* ---- the planned heap: evicted first on top ---- */

/* Whether record a is evicted before record b (both planned). */
static inline int before(const Index *x, uint32_t a, uint32_t b)
{
    const struct slot *sa = at(x, a), *sb = at(x, b);
    if (sa->u.next_use != sb->u.next_use)
        return sa->u.next_use > sb->u.next_use;
    return memcmp(sa->key, sb->key, KEY_MAX) < 0;
}

static inline void heap_set(Index *x, uint32_t pos, uint32_t i)
{
    x->heap[pos] = i;
    at(x, i)->pos = pos;
}

static void heap_up(Index *x, uint32_t pos)
{
    uint32_t i = x->heap[pos];
    while (pos > 0) {
        uint32_t parent = (pos - 1) / 2;
        if (!before(x, i, x->heap[parent]))
            break;
        heap_set(x, pos, x->heap[parent]);
        pos = parent;
    }
    heap_set(x, pos, i);
}

static void heap_down(Index *x, uint32_t pos)
{
    uint32_t i = x->heap[pos];
    for (;;) {
        uint32_t child = 2 * pos + 1;
        if (child >= x->heap_len)
            break;
        if (child + 1 < x->heap_len && before(x, x->heap[child + 1], x->heap[child]))
            child++;
        if (!before(x, x->heap[child], i))
            break;
        heap_set(x, pos, x->heap[child]);
        pos = child;
    }
    heap_set(x, pos, i);
}

/* -1 if out of memory.  The heap array grows by half (never rebuilt: realloc moves it). */
static int heap_push(Index *x, uint32_t i)
{
    if (x->heap_len == x->heap_cap) {
        uint32_t cap = x->heap_cap ? x->heap_cap + x->heap_cap / 2 : 64;
        uint32_t *heap = PyMem_Realloc(x->heap, (size_t)cap * sizeof *heap);
        if (!heap)
            return -1;
        x->heap = heap;
        x->heap_cap = cap;
    }
    heap_set(x, x->heap_len++, i);
    heap_up(x, x->heap_len - 1);
    return 0;
}

static void heap_remove(Index *x, uint32_t i)
{
    uint32_t pos = at(x, i)->pos, last = x->heap[--x->heap_len];
    if (pos == x->heap_len)
        return;
    heap_set(x, pos, last);
    heap_up(x, pos);
    heap_down(x, at(x, last)->pos);
}

/* ---- the order a record is in ---- */

static void unlink_record(Index *x, uint32_t i)
{
    struct slot *s = at(x, i);
    if (s->pos != UNPLANNED) {
        heap_remove(x, i);
        x->planned_bytes -= s->size;
    } else {
        lru_unlink(x, i);
        x->unplanned_bytes -= s->size;
    }
}

/* Put record i (in no order) in its order: the most recent unplanned, or planned at
 * ``use``.  -1 if out of memory (then it is unplanned). */
static int link_record(Index *x, uint32_t i, int planned, long long use)
{
    struct slot *s = at(x, i);
    if (planned) {
        s->u.next_use = use;
        if (heap_push(x, i) == 0) {
            x->planned_bytes += s->size;
            return 0;
        }
    }
    lru_append(x, i);
    x->unplanned_bytes += s->size;
    return planned ? -1 : 0;
}

/* A next use from Python: *planned 0 for None; -1 with an exception if neither an int nor None. */
static int use_of(PyObject *o, int *planned, long long *use)
{
    *planned = o != Py_None;
    *use = 0;
    if (!*planned)
        return 0;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "next_use is an int or None, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *use = PyLong_AsLongLong(o);
    return *use == -1 && PyErr_Occurred() ? -1 : 0;
}

static void drop_record(Index *x, uint32_t i)
{
    struct slot *s = at(x, i);
    unlink_record(x, i);
    leave(x, i);
    if (x->objects)
        Py_DECREF((PyObject *)(uintptr_t)s->value);
    free_record(x, i);
    x->len--;
}

/* ---- the Python type ---- */

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"scratch_bytes", "key_bytes", "objects", NULL};
    long long scratch;
    Py_ssize_t key_bytes = KEY_MAX;
    int objects = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|$np:BlockIndex", kwlist, &scratch, &key_bytes, &objects))
        return NULL;
    if (key_bytes < 1 || key_bytes > KEY_MAX)
        return PyErr_Format(PyExc_ValueError, "key_bytes is 1 to %d, not %zd", KEY_MAX, key_bytes);
    Index *x = (Index *)type->tp_alloc(type, 0);
    if (!x)
        return NULL;
    x->objects = objects;
    x->key_bytes = key_bytes;
    x->scratch_bytes = scratch;
    x->free_head = x->lru_head = x->lru_tail = NONE;
    return (PyObject *)x;
}

static void release_all(Index *x)
{
    if (x->objects)
        for (uint32_t i = 0; i < x->records; i++)
            if (at(x, i)->pos != FREE)
                Py_DECREF((PyObject *)(uintptr_t)at(x, i)->value);
    for (uint32_t c = 0; c < x->nchunks; c++)
        PyMem_Free(x->chunks[c]);
    PyMem_Free(x->chunks);
    PyMem_Free(x->heap);
    for (int s = 0; s < SHARDS; s++)
        PyMem_Free(x->shards[s].buckets);
}

static void Index_dealloc(Index *x)
{
    release_all(x);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

static Py_ssize_t Index_len(Index *x)
{
    return x->len;
}

static int Index_contains(Index *x, PyObject *key)
{
    unsigned char k[KEY_MAX];
    if (key_of(x, key, k) < 0)
        return -1;
    return find(x, k) != NONE;
}

/* *i: the record of a key, NONE if absent; -1 with an exception on a bad key. */
static int lookup(Index *x, PyObject *key, uint32_t *i)
{
    unsigned char k[KEY_MAX];
    if (key_of(x, key, k) < 0)
        return -1;
    *i = find(x, k);
    return 0;
}

/* Append record i's key to a list; -1 with an exception if it cannot. */
static int append_key(const Index *x, PyObject *list, uint32_t i)
{
    PyObject *k = key_object(x, i);
    int rc = k ? PyList_Append(list, k) : -1;
    Py_XDECREF(k);
    return rc;
}

static PyObject *value_of(const Index *x, uint32_t i)
{
    uint64_t v = at(x, i)->value;
    return x->objects ? Py_NewRef((PyObject *)(uintptr_t)v) : PyLong_FromUnsignedLongLong(v);
}

/* add(key, size, next_use=None, *, value=None, tag=0): store ``key`` (replacing it if
 * present) as the most recent unplanned block, or planned at ``next_use``. */
static PyObject *Index_add(Index *x, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "size", "next_use", "value", "tag", NULL};
    PyObject *key, *next_use = Py_None, *value = Py_None;
    unsigned long long size, tag = 0;
    unsigned char k[KEY_MAX];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OK|O$OK:add", kwlist, &key, &size, &next_use, &value, &tag)
        || key_of(x, key, k) < 0)
        return NULL;
    if (size > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "a block of %llu bytes is larger than an index holds", size);
    int planned;
    long long use;
    if (use_of(next_use, &planned, &use) < 0)
        return NULL;
    uint64_t word = 0;
    if (x->objects) {
        if (!PyBytes_Check(value))
            return PyErr_Format(PyExc_TypeError, "a value of this index is bytes");
    } else if (value != Py_None) {
        if (!PyLong_Check(value))
            return PyErr_Format(PyExc_TypeError, "a value of this index is an int");
        word = PyLong_AsUnsignedLongLong(value);
        if (word == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    uint32_t old = find(x, k);
    if (old != NONE)
        drop_record(x, old);
    uint32_t i = new_record(x);
    if (i == NONE)
        return PyErr_NoMemory();
    struct slot *s = at(x, i);
    memcpy(s->key, k, KEY_MAX);
    s->tag = tag;
    s->size = (uint32_t)size;
    if (enter(x, i) < 0) {
        free_record(x, i);
        return PyErr_NoMemory();
    }
    s->value = x->objects ? (uint64_t)(uintptr_t)Py_NewRef(value) : word;
    x->len++;
    if (link_record(x, i, planned, use) < 0)
        return PyErr_NoMemory();  /* stored, unplanned */
    Py_RETURN_NONE;
}

/* remove(key) -> its size (0 if absent). */
static PyObject *Index_remove(Index *x, PyObject *key)
{
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    if (i == NONE)
        return PyLong_FromLong(0);
    uint32_t size = at(x, i)->size;
    drop_record(x, i);
    return PyLong_FromUnsignedLong(size);
}

/* What get() and pop() answer: the key's value, or the default (*i NONE: absent). */
static PyObject *found(Index *x, PyObject *const *args, Py_ssize_t nargs, uint32_t *i)
{
    if (nargs < 1 || nargs > 2)
        return PyErr_Format(PyExc_TypeError, "(key, default=None)");
    if (lookup(x, args[0], i) < 0)
        return NULL;
    if (*i == NONE)
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    return value_of(x, *i);
}

/* get(key, default=None) -> its value. */
static PyObject *Index_get(Index *x, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t i;
    return found(x, args, nargs, &i);
}

/* pop(key, default=None) -> its value, removed. */
static PyObject *Index_pop(Index *x, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t i = NONE;
    PyObject *value = found(x, args, nargs, &i);
    if (value && i != NONE)
        drop_record(x, i);
    return value;
}

static PyObject *Index_size_of(Index *x, PyObject *key)
{
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    return i == NONE ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(at(x, i)->size);
}

/* tag(key) -> its path tag (0: unknown or absent). */
static PyObject *Index_tag(Index *x, PyObject *key)
{
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(i == NONE ? 0 : at(x, i)->tag);
}

/* set_tag(key, tag): its path tag, if present. */
static PyObject *Index_set_tag(Index *x, PyObject *args)
{
    PyObject *key;
    unsigned long long tag;
    if (!PyArg_ParseTuple(args, "OK:set_tag", &key, &tag))
        return NULL;
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    if (i != NONE)
        at(x, i)->tag = tag;
    Py_RETURN_NONE;
}

static PyObject *Index_next_use(Index *x, PyObject *key)
{
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    if (i == NONE || at(x, i)->pos == UNPLANNED)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(at(x, i)->u.next_use);
}

/* touch(key): a read; an unplanned block becomes the most recently used. */
static PyObject *Index_touch(Index *x, PyObject *key)
{
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    if (i != NONE && i != x->lru_tail && at(x, i)->pos == UNPLANNED) {
        lru_unlink(x, i);
        lru_append(x, i);
    }
    Py_RETURN_NONE;
}

/* plan(key, next_use): a plan reads ``key`` at ``next_use`` (a new position moves it). */
static PyObject *Index_plan(Index *x, PyObject *args)
{
    PyObject *key, *next_use;
    if (!PyArg_ParseTuple(args, "OO!:plan", &key, &PyLong_Type, &next_use))
        return NULL;
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    if (i == NONE)
        Py_RETURN_NONE;
    int planned;
    long long use;
    if (use_of(next_use, &planned, &use) < 0)
        return NULL;
    struct slot *s = at(x, i);
    if (s->pos != UNPLANNED && s->u.next_use == use)
        Py_RETURN_NONE;
    unlink_record(x, i);
    if (link_record(x, i, 1, use) < 0)
        return PyErr_NoMemory();  /* unplanned */
    Py_RETURN_NONE;
}

static void unplan_record(Index *x, uint32_t i)
{
    unlink_record(x, i);
    lru_append(x, i);
    x->unplanned_bytes += at(x, i)->size;
}

/* unplan(key): no plan reads it any more; it becomes the most recent unplanned block. */
static PyObject *Index_unplan(Index *x, PyObject *key)
{
    uint32_t i;
    if (lookup(x, key, &i) < 0)
        return NULL;
    if (i != NONE && at(x, i)->pos != UNPLANNED)
        unplan_record(x, i);
    Py_RETURN_NONE;
}

/* unplan_some(count) -> whether planned blocks remain: up to ``count`` of them become
 * unplanned, in eviction order (the blocks a plan needed last become the oldest
 * unplanned); O(count log n). */
static PyObject *Index_unplan_some(Index *x, PyObject *arg)
{
    Py_ssize_t count = PyLong_AsSsize_t(arg);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    for (Py_ssize_t n = 0; n < count && x->heap_len; n++)
        unplan_record(x, x->heap[0]);
    return PyBool_FromLong(x->heap_len != 0);
}

/* The planned records in eviction order, a few at a time: a small heap of heap positions
 * (the children of every position taken join it), so taking k costs O(k log k). */
struct walk {
    uint32_t *pos;
    uint32_t len, cap;
};

static int walk_less(const Index *x, uint32_t a, uint32_t b)
{
    return before(x, x->heap[a], x->heap[b]);
}

static int walk_push(const Index *x, struct walk *w, uint32_t p)
{
    if (p >= x->heap_len)
        return 0;
    if (w->len == w->cap) {
        uint32_t cap = w->cap ? w->cap * 2 : 32;
        uint32_t *pos = PyMem_Realloc(w->pos, (size_t)cap * sizeof *pos);
        if (!pos)
            return -1;
        w->pos = pos;
        w->cap = cap;
    }
    uint32_t at_ = w->len++;
    while (at_ > 0 && walk_less(x, p, w->pos[(at_ - 1) / 2])) {
        w->pos[at_] = w->pos[(at_ - 1) / 2];
        at_ = (at_ - 1) / 2;
    }
    w->pos[at_] = p;
    return 0;
}

/* The next planned record in eviction order; NONE when none is left, or out of memory (err). */
static uint32_t walk_next(const Index *x, struct walk *w, int *err)
{
    if (!w->len)
        return NONE;
    uint32_t top = w->pos[0], last = w->pos[--w->len], p = 0;
    for (;;) {
        uint32_t child = 2 * p + 1;
        if (child >= w->len)
            break;
        if (child + 1 < w->len && walk_less(x, w->pos[child + 1], w->pos[child]))
            child++;
        if (!walk_less(x, w->pos[child], last))
            break;
        w->pos[p] = w->pos[child];
        p = child;
    }
    if (w->len)
        w->pos[p] = last;
    if (walk_push(x, w, 2 * top + 1) < 0 || walk_push(x, w, 2 * top + 2) < 0)
        *err = -1;
    return x->heap[top];
}

/* Append the unplanned blocks' keys, least recently used first, until ``need`` bytes fit
 * beside *free (need LLONG_MAX: every one).  1: they fit; 0: not; -1: an exception. */
static int list_unplanned(const Index *x, PyObject *out, long long need, long long *free_)
{
    for (uint32_t i = x->lru_head; i != NONE; i = at(x, i)->u.lru.next) {
        if (append_key(x, out, i) < 0)
            return -1;
        *free_ += at(x, i)->size;
        if (need <= *free_)
            return 1;
    }
    return 0;
}

/* The same for the planned blocks, the furthest next use first; ``planned``: the newcomer
 * is needed at ``use``, and no block needed no later than that is listed. */
static int list_planned(const Index *x, PyObject *out, long long need, long long *free_, int planned, long long use)
{
    struct walk w = {0};
    int err = walk_push(x, &w, 0), fits = 0;
    uint32_t i;
    while (!fits && err == 0 && (i = walk_next(x, &w, &err)) != NONE) {
        if (planned && at(x, i)->u.next_use <= use)
            break;  /* everything left is needed no later than the newcomer */
        if (append_key(x, out, i) < 0) {
            PyMem_Free(w.pos);
            return -1;
        }
        *free_ += at(x, i)->size;
        fits = need <= *free_;
    }
    PyMem_Free(w.pos);
    if (err < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return fits;
}

/* victims(need, free, next_use) -> keys to evict so that ``need`` bytes fit beside
 * ``free``, or None: do not admit.  Nothing is removed (the caller removes those it acts on). */
static PyObject *Index_victims(Index *x, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"need", "free", "next_use", NULL};
    long long need, free_;
    PyObject *next_use;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLO:victims", kwlist, &need, &free_, &next_use))
        return NULL;
    int planned;
    long long use;
    if (use_of(next_use, &planned, &use) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out || need <= free_)
        return out;
    int fits = list_unplanned(x, out, need, &free_);
    /* An unplanned block displaces planned ones only within the scratch room. */
    if (fits == 0 && (planned || need <= x->scratch_bytes))
        fits = list_planned(x, out, need, &free_, planned, use);
    if (fits > 0)
        return out;
    Py_DECREF(out);
    if (fits < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* order() -> every key, first to be evicted first (for tests and the NVMe index's save at
 * shutdown: O(n log n)). */
static PyObject *Index_order(Index *x, PyObject *unused)
{
    (void)unused;
    long long free_ = 0;
    PyObject *out = PyList_New(0);
    if (out && (list_unplanned(x, out, LLONG_MAX, &free_) < 0 || list_planned(x, out, LLONG_MAX, &free_, 0, 0) < 0))
        Py_CLEAR(out);
    return out;
}

static int shard_arg(PyObject *arg)
{
    long shard = PyLong_AsLong(arg);
    if (shard == -1 && PyErr_Occurred())
        return -1;
    if (shard < 0 || shard >= SHARDS) {
        PyErr_Format(PyExc_ValueError, "a shard is 0 to %d, not %ld", SHARDS - 1, shard);
        return -1;
    }
    return (int)shard;
}

/* shard_keys(shard) -> the keys whose first byte is ``shard`` (a walk of the index one
 * shard per step). */
static PyObject *Index_shard_keys(Index *x, PyObject *arg)
{
    int shard = shard_arg(arg);
    if (shard < 0)
        return NULL;
    const struct table *t = &x->shards[shard];
    PyObject *out = PyList_New(t->used);
    if (!out)
        return NULL;
    Py_ssize_t n = 0;
    for (uint32_t b = 0; t->buckets && b <= t->mask; b++) {
        if (t->buckets[b] == NONE)
            continue;
        PyObject *k = key_object(x, t->buckets[b]);
        if (!k) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, k);
    }
    return out;
}

/* tagged_shard(shard) -> (keys, tags) of the shard's blocks whose tag is known (not 0). */
static PyObject *Index_tagged_shard(Index *x, PyObject *arg)
{
    int shard = shard_arg(arg);
    if (shard < 0)
        return NULL;
    const struct table *t = &x->shards[shard];
    PyObject *keys = PyList_New(0), *tags = PyList_New(0);
    if (!keys || !tags)
        goto fail;
    for (uint32_t b = 0; t->buckets && b <= t->mask; b++) {
        uint32_t i = t->buckets[b];
        if (i == NONE || !at(x, i)->tag)
            continue;
        PyObject *k = key_object(x, i), *g = PyLong_FromUnsignedLongLong(at(x, i)->tag);
        int bad = !k || !g || PyList_Append(keys, k) < 0 || PyList_Append(tags, g) < 0;
        Py_XDECREF(k);
        Py_XDECREF(g);
        if (bad)
            goto fail;
    }
    return Py_BuildValue("(NN)", keys, tags);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(tags);
    return NULL;
}

/* check(): every invariant, walked whole (tests only); AssertionError naming the first broken. */
static PyObject *Index_check(Index *x, PyObject *unused)
{
    (void)unused;
    const char *broken = NULL;
    uint32_t listed = 0, prev = NONE;
    long long unplanned = 0, planned = 0;
    for (uint32_t i = x->lru_head; i != NONE && !broken; prev = i, i = at(x, i)->u.lru.next) {
        if (at(x, i)->pos != UNPLANNED || at(x, i)->u.lru.prev != prev)
            broken = "an unplanned record's prev link";
        else if (find(x, at(x, i)->key) != i)
            broken = "an unplanned record missing from its table";
        unplanned += at(x, i)->size;
        if (++listed > x->len)
            broken = "the unplanned list loops";
    }
    if (!broken && prev != x->lru_tail)
        broken = "the unplanned list's tail";
    for (uint32_t p = 0; p < x->heap_len && !broken; p++) {
        uint32_t i = x->heap[p];
        if (at(x, i)->pos != p)
            broken = "a heap record's position";
        else if (p && before(x, i, x->heap[(p - 1) / 2]))
            broken = "the heap order";
        else if (find(x, at(x, i)->key) != i)
            broken = "a planned record missing from its table";
        planned += at(x, i)->size;
    }
    uint32_t entered = 0;
    for (int s = 0; s < SHARDS && !broken; s++) {
        const struct table *t = &x->shards[s];
        uint32_t used = 0;
        for (uint32_t b = 0; t->buckets && b <= t->mask; b++)
            if (t->buckets[b] != NONE) {
                used++;
                if (at(x, t->buckets[b])->key[0] != s)
                    broken = "a record in another shard's table";
            }
        if (used != t->used)
            broken = "a table's count";
        entered += used;
    }
    if (!broken && (listed + x->heap_len != x->len || entered != x->len))
        broken = "the record count";
    if (!broken && (unplanned != x->unplanned_bytes || planned != x->planned_bytes))
        broken = "the byte counts";
    if (broken)
        return PyErr_Format(PyExc_AssertionError, "BlockIndex: %s is wrong", broken);
    Py_RETURN_NONE;
}

/* memory() -> bytes the index holds (records, tables, heap), for tests and statistics. */
static PyObject *Index_memory(Index *x, PyObject *unused)
{
    (void)unused;
    unsigned long long bytes = (unsigned long long)x->nchunks * CHUNK * sizeof(struct slot)
                               + (unsigned long long)x->heap_cap * sizeof(uint32_t);
    for (int s = 0; s < SHARDS; s++)
        if (x->shards[s].buckets)
            bytes += ((unsigned long long)x->shards[s].mask + 1) * sizeof(uint32_t);
    return PyLong_FromUnsignedLongLong(bytes);
}

static PyMethodDef Index_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Index_add, METH_VARARGS | METH_KEYWORDS, NULL},
    {"remove", (PyCFunction)Index_remove, METH_O, NULL},
    {"get", (PyCFunction)(void (*)(void))Index_get, METH_FASTCALL, NULL},
    {"pop", (PyCFunction)(void (*)(void))Index_pop, METH_FASTCALL, NULL},
    {"size_of", (PyCFunction)Index_size_of, METH_O, NULL},
    {"tag", (PyCFunction)Index_tag, METH_O, NULL},
    {"set_tag", (PyCFunction)Index_set_tag, METH_VARARGS, NULL},
    {"next_use", (PyCFunction)Index_next_use, METH_O, NULL},
    {"touch", (PyCFunction)Index_touch, METH_O, NULL},
    {"plan", (PyCFunction)Index_plan, METH_VARARGS, NULL},
    {"unplan", (PyCFunction)Index_unplan, METH_O, NULL},
    {"unplan_some", (PyCFunction)Index_unplan_some, METH_O, NULL},
    {"victims", (PyCFunction)(void (*)(void))Index_victims, METH_VARARGS | METH_KEYWORDS, NULL},
    {"order", (PyCFunction)Index_order, METH_NOARGS, NULL},
    {"shard_keys", (PyCFunction)Index_shard_keys, METH_O, NULL},
    {"tagged_shard", (PyCFunction)Index_tagged_shard, METH_O, NULL},
    {"check", (PyCFunction)Index_check, METH_NOARGS, NULL},
    {"memory", (PyCFunction)Index_memory, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Index_members[] = {
    {"scratch_bytes", T_LONGLONG, offsetof(Index, scratch_bytes), 0, NULL},
    {"unplanned_bytes", T_LONGLONG, offsetof(Index, unplanned_bytes), READONLY, NULL},
    {"planned_bytes", T_LONGLONG, offsetof(Index, planned_bytes), READONLY, NULL},
    {"key_bytes", T_PYSSIZET, offsetof(Index, key_bytes), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Index_as_sequence = {
    .sq_length = (lenfunc)Index_len,
    .sq_contains = (objobjproc)Index_contains,
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cubefs_fuse.cache._index.BlockIndex",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A cache tier's blocks: key -> size, path tag, value, and the eviction order (see cache/_index.c).",
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_as_sequence = &Index_as_sequence,
    .tp_methods = Index_methods,
    .tp_members = Index_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cubefs_fuse.cache._index", "The per-block index of a cache tier (C).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void)
{
    if (PyType_Ready(&IndexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "BlockIndex", (PyObject *)&IndexType) < 0
        || PyModule_AddIntConstant(m, "SHARDS", SHARDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/*
 * s3-proxy-c: a delaying TCP proxy in front of a loopback S3 server, for the benchmark
 * suite's object-store rows.  It gives the server the latency of a real object store at
 * a CPU cost that does not compete with what is measured: a real network's latency costs
 * the client machine no CPU, while tools/s3_proxy.py (Python, with fault injection and a
 * record of every request, for the tests) spends 0.6-1.4 ms of CPU per request on the
 * same two cores as the daemon, the server and the training loop.
 *
 *   s3-proxy-c --target-port PORT [--delay-ms MS] [--port PORT]
 *
 * Listens on 127.0.0.1 (--port, 0 or absent: a free port), prints the port it listens on
 * as one line once it accepts, and serves until SIGTERM or SIGINT.  Each client
 * connection gets its own upstream connection to 127.0.0.1:--target-port and two
 * threads, one per direction, that copy bytes as they come.  Every request is held for
 * --delay-ms before it is forwarded: a request is the first bytes a client sends on its
 * connection, or the first it sends after an answer began to come back (S3 clients send
 * one request at a time on a connection and wait for its answer), so a request body
 * sent in many writes is delayed once (twice if the server sends an interim
 * "100 Continue" between its headers and its body).  Bytes are never changed, so the client's
 * signature (over the Host header it sent) holds.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Bytes moved per read: an S3 GET of a ~110 KB object in two reads, a 1 MiB ranged GET in
 * eight; larger buffers save no measurable CPU on loopback. */
#define CHUNK (128 * 1024)
/* Pending connections the listener queues: the suite's widest reader set (8 DataLoader
 * workers, each pooling a few connections) with room to spare. */
#define BACKLOG 256

struct conn {
    int client, upstream;
    atomic_uint answers;  /* reads of an answer from upstream so far */
    atomic_int open_directions;  /* the last direction to finish closes both sockets */
};

static struct timespec delay;
static int delay_on;
static int target_port;

static int write_all(int fd, const char *buf, size_t n)
{
    while (n) {
        ssize_t w = send(fd, buf, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

static void finish(struct conn *c, int from, int to)
{
    shutdown(to, SHUT_WR);  /* the other side sees the end of what this one sent */
    shutdown(from, SHUT_RD);
    if (atomic_fetch_sub(&c->open_directions, 1) == 1) {
        close(c->client);
        close(c->upstream);
        free(c);
    }
}

/* Copy what one side sends to the other until either ends.  Client to upstream (the
 * requests): each request held for the delay (see the header comment).  Upstream to
 * client (the answers): each read counted, which is how the requests' direction tells a
 * new request from more of the last one. */
static void relay(struct conn *c, int requests)
{
    int from = requests ? c->client : c->upstream, to = requests ? c->upstream : c->client;
    char *buf = malloc(CHUNK);
    unsigned seen = 0;
    int first = 1;
    while (buf) {
        ssize_t n = recv(from, buf, CHUNK, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        if (requests) {
            unsigned answers = atomic_load(&c->answers);
            if (delay_on && (first || answers != seen)) {
                while (clock_nanosleep(CLOCK_MONOTONIC, 0, &delay, NULL) == EINTR) {
                }
            }
            first = 0;
            seen = answers;
        } else {
            atomic_fetch_add(&c->answers, 1);
        }
        if (write_all(to, buf, (size_t)n) != 0)
            break;
    }
    free(buf);
    finish(c, from, to);
}

static void *to_upstream(void *arg)
{
    relay(arg, 1);
    return NULL;
}

static void *to_client(void *arg)
{
    relay(arg, 0);
    return NULL;
}

static int connect_upstream(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)target_port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void serve(int client)
{
    int one = 1;
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int upstream = connect_upstream();
    if (upstream < 0) {
        close(client);  /* the server is down: the client sees its connection refused as a reset */
        return;
    }
    setsockopt(upstream, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(client);
        close(upstream);
        return;
    }
    c->client = client;
    c->upstream = upstream;
    atomic_init(&c->open_directions, 2);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* Small stacks: two threads per connection, each using a heap buffer. */
    pthread_attr_setstacksize(&attr, 64 * 1024);
    pthread_t t;
    if (pthread_create(&t, &attr, to_upstream, c) != 0) {
        close(client);
        close(upstream);
        free(c);
    } else if (pthread_create(&t, &attr, to_client, c) != 0) {
        /* to_upstream runs alone: it finishes when the client goes, and closes both once
         * this direction, never started, is counted as finished here. */
        shutdown(client, SHUT_RDWR);
        finish(c, upstream, client);
    }
    pthread_attr_destroy(&attr);
}

static void usage(const char *why)
{
    fprintf(stderr, "s3-proxy-c: %s\nusage: s3-proxy-c --target-port PORT [--delay-ms MS] [--port PORT]\n", why);
    exit(2);
}

static long number(const char *flag, const char *value, long low, long high)
{
    char *end;
    errno = 0;
    long v = strtol(value, &end, 10);
    if (errno || *end || end == value || v < low || v > high) {
        fprintf(stderr, "s3-proxy-c: %s must be a whole number from %ld to %ld, not %s\n", flag, low, high, value);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv)
{
    long delay_ms = 0, port = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage("every option takes a value");
        if (!strcmp(argv[i], "--target-port"))
            target_port = (int)number("--target-port", argv[++i], 1, 65535);
        else if (!strcmp(argv[i], "--delay-ms"))
            delay_ms = number("--delay-ms", argv[++i], 0, 60000);
        else if (!strcmp(argv[i], "--port"))
            port = number("--port", argv[++i], 0, 65535);
        else
            usage("unknown option");
    }
    if (!target_port)
        usage("--target-port is required");
    delay.tv_sec = delay_ms / 1000;
    delay.tv_nsec = (delay_ms % 1000) * 1000000L;
    delay_on = delay_ms > 0;

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (lfd < 0 || setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0
        || bind(lfd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(lfd, BACKLOG) != 0
        || getsockname(lfd, (struct sockaddr *)&addr, &len) != 0) {
        fprintf(stderr, "s3-proxy-c: cannot listen on 127.0.0.1:%ld: %s\n", port, strerror(errno));
        return 1;
    }
    /* SIGTERM and SIGINT end the process at once (their default action); a client that
     * goes away mid-answer must not (MSG_NOSIGNAL covers sends, this covers the rest). */
    signal(SIGPIPE, SIG_IGN);
    printf("%d\n", ntohs(addr.sin_port));
    fflush(stdout);
    for (;;) {
        int client = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (client < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
                if (errno == EMFILE || errno == ENFILE)
                    usleep(10000);  /* out of descriptors: let connections close, then go on */
                continue;
            }
            fprintf(stderr, "s3-proxy-c: accept: %s\n", strerror(errno));
            return 1;
        }
        serve(client);
    }
}

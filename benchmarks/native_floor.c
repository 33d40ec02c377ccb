/* The native floor of knitkit's eager delivery (benchmarks/native_floor.py runs it).
 *
 * transfer.py's eager knitkit phase with every Python layer taken out: one producer process
 * per ring (4 backbone groups, 2 encoder ranks) runs each micro-batch's copies (the packer's
 * layout, from a shared-memory file of the units) into a ring of 2 slots and publishes
 * each micro-batch with a release store and a futex wake only while a consumer sleeps; one
 * consumer process per rank waits for each publication on the ring's futex, touches the
 * slot's first and last bytes and releases it. A step starts when the last rank reaches the
 * step barrier (a futex word); a rank's exposed wait is the time from there to its step's
 * last micro-batch. Nothing plans, decodes a layout or makes a tensor: what a compiled
 * hand-out on both sides could at best reach on this machine.
 *
 * Usage: native_floor SPEC OUT SOURCE...   (SPEC and OUT: flat little-endian int64 files; a
 * copy's source is an index into the SOURCE files, mapped read-only)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_RINGS 16
#define MAX_CONSUMERS 8   /* per ring */
#define MAX_RANKS 64
#define MAX_SOURCES 64
#define WAIT_NS 30000000000LL /* every futex wait is bounded: 30 s, then the run fails */

typedef struct {
    uint32_t published;                 /* micro-batches published so far (futex word) */
    uint32_t releases;                  /* releases by any consumer so far (futex word) */
    uint32_t producer_waits;            /* 1 while the producer sleeps on `releases` */
    uint32_t consumer_waits[MAX_CONSUMERS];
    uint32_t released[MAX_CONSUMERS];   /* per consumer: micro-batches released so far */
    char pad[64];
} RingWords;

typedef struct {
    uint32_t arrived;
    uint32_t generation; /* futex word: steps started so far */
    char pad[56];
} Barrier;

typedef struct {
    int64_t slots, slot_bytes, consumers;
    int64_t *mb_count;   /* per step */
    int64_t **mbs;       /* per step: pointer to its micro-batches' records in the spec */
    char *data;
    RingWords *words;
} Ring;

typedef struct {
    int64_t num_rings;              /* rings this rank takes from, in order, each step */
    int64_t ring[2], index[2];
} Rank;

static int64_t *spec;
static int64_t spec_len, at;
static Ring rings[MAX_RINGS];
static Rank ranks[MAX_RANKS];
static int64_t num_rings, num_ranks, num_steps, warmup;
static const char *source_base[MAX_SOURCES];
static size_t source_size[MAX_SOURCES];
static int64_t num_sources;
static Barrier *barrier;
static int64_t *out; /* per rank per step: exposed ns; then per process: cpu ns, fill ns */

static int64_t next(void) {
    if (at >= spec_len) {
        fprintf(stderr, "native_floor: the spec ends early at word %lld\n", (long long)at);
        exit(2);
    }
    return spec[at++];
}

static void invalid(const char *what) {
    fprintf(stderr, "native_floor: the spec has an invalid %s before word %lld\n", what,
            (long long)at);
    exit(2);
}

static int64_t now_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void futex_wait(uint32_t *word, uint32_t expected) {
    struct timespec timeout = {WAIT_NS / 1000000000LL, 0};
    if (syscall(SYS_futex, word, FUTEX_WAIT, expected, &timeout, NULL, 0) == -1 &&
        errno == ETIMEDOUT) {
        fprintf(stderr, "native_floor: a wait timed out (a peer died?)\n");
        exit(3);
    }
}

static void futex_wake(uint32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Every rank arrives; the last one starts the next step (wakes ranks and producers). */
static void barrier_wait(int64_t parties) {
    uint32_t generation = __atomic_load_n(&barrier->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&barrier->arrived, 1, __ATOMIC_ACQ_REL) == parties) {
        __atomic_store_n(&barrier->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&barrier->generation, generation + 1, __ATOMIC_RELEASE);
        futex_wake(&barrier->generation);
        return;
    }
    while (__atomic_load_n(&barrier->generation, __ATOMIC_ACQUIRE) == generation)
        futex_wait(&barrier->generation, generation);
}

static void wait_step(uint32_t step) { /* producers: until `step` + 1 steps have started */
    uint32_t seen;
    while ((seen = __atomic_load_n(&barrier->generation, __ATOMIC_ACQUIRE)) <= step)
        futex_wait(&barrier->generation, seen);
}

static uint32_t min_released(Ring *ring) {
    uint32_t low = UINT32_MAX;
    for (int64_t c = 0; c < ring->consumers; c++) {
        uint32_t r = __atomic_load_n(&ring->words->released[c], __ATOMIC_ACQUIRE);
        if (r < low) low = r;
    }
    return low;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

/* A forked child does not inherit the page tables of shared mappings: map every page it reads
 * or writes now, before the first step, as knitkit's reorganizers and consumers do (NOTE
 * [ Populated mappings ] in knitkit/storage/backends/slab.py). */
static void populate(void *start, size_t bytes, int advice) {
    if (bytes && madvise(start, bytes, advice)) {
        perror("native_floor: madvise(MADV_POPULATE_*)");
        exit(2);
    }
}

static void produce(int64_t r) {
    Ring *ring = &rings[r];
    RingWords *w = ring->words;
    uint32_t seq = 0;
    int64_t cpu = 0, fill = 0;
    for (int64_t s = 0; s < num_sources; s++)
        populate((void *)source_base[s], source_size[s], MADV_POPULATE_READ);
    populate(ring->data, (size_t)(ring->slots * ring->slot_bytes), MADV_POPULATE_WRITE);
    for (int64_t step = 0; step < num_steps; step++) {
        wait_step((uint32_t)step);
        if (step == warmup) cpu = -now_ns(CLOCK_PROCESS_CPUTIME_ID), fill = 0;
        int64_t *mb = ring->mbs[step];
        for (int64_t m = 0; m < ring->mb_count[step]; m++, seq++, mb += 2 + 4 * mb[1]) {
            int64_t copies = mb[1]; /* mb[0]: its size, checked against the slot at parse time */
            /* acquire the slot: every consumer released the micro-batch it held before */
            while (seq >= ring->slots && min_released(ring) <= seq - ring->slots) {
                uint32_t seen = __atomic_load_n(&w->releases, __ATOMIC_ACQUIRE);
                __atomic_store_n(&w->producer_waits, 1, __ATOMIC_SEQ_CST);
                if (min_released(ring) <= seq - ring->slots) futex_wait(&w->releases, seen);
                __atomic_store_n(&w->producer_waits, 0, __ATOMIC_RELAXED);
            }
            char *slot = ring->data + (seq % ring->slots) * ring->slot_bytes;
            int64_t began = now_ns(CLOCK_THREAD_CPUTIME_ID);
            for (int64_t c = 0; c < copies; c++) {
                int64_t *copy = mb + 2 + 4 * c; /* source, offset, slot offset, bytes */
                memcpy(slot + copy[2], source_base[copy[0]] + copy[1], (size_t)copy[3]);
            }
            fill += now_ns(CLOCK_THREAD_CPUTIME_ID) - began;
            __atomic_store_n(&w->published, seq + 1, __ATOMIC_SEQ_CST);
            for (int64_t c = 0; c < ring->consumers; c++)
                if (__atomic_load_n(&w->consumer_waits[c], __ATOMIC_SEQ_CST)) {
                    futex_wake(&w->published);
                    break;
                }
        }
    }
    cpu += now_ns(CLOCK_PROCESS_CPUTIME_ID);
    int64_t *mine = out + num_ranks * num_steps + 2 * (num_ranks + r);
    mine[0] = cpu, mine[1] = fill;
}

static volatile uint64_t sink;

static void consume(int64_t k) {
    Rank *rank = &ranks[k];
    uint32_t taken[2] = {0, 0};
    int64_t cpu = 0;
    for (int64_t i = 0; i < rank->num_rings; i++) {
        Ring *ring = &rings[rank->ring[i]];
        populate(ring->data, (size_t)(ring->slots * ring->slot_bytes), MADV_POPULATE_READ);
    }
    for (int64_t step = 0; step < num_steps; step++) {
        barrier_wait(num_ranks);
        int64_t start = now_ns(CLOCK_MONOTONIC);
        if (step == warmup) cpu = -now_ns(CLOCK_PROCESS_CPUTIME_ID);
        for (int64_t i = 0; i < rank->num_rings; i++) {
            Ring *ring = &rings[rank->ring[i]];
            RingWords *w = ring->words;
            int64_t c = rank->index[i];
            int64_t skip = 0;
            for (int64_t m = 0; m < ring->mb_count[step]; m++, taken[i]++) {
                uint32_t seq = taken[i], seen;
                while ((seen = __atomic_load_n(&w->published, __ATOMIC_ACQUIRE)) <= seq) {
                    __atomic_store_n(&w->consumer_waits[c], 1, __ATOMIC_SEQ_CST);
                    if (__atomic_load_n(&w->published, __ATOMIC_SEQ_CST) <= seq)
                        futex_wait(&w->published, seen);
                    __atomic_store_n(&w->consumer_waits[c], 0, __ATOMIC_RELAXED);
                }
                int64_t nbytes = ring->mbs[step][skip];
                skip += 2 + 4 * ring->mbs[step][skip + 1];
                const char *slot = ring->data + (seq % ring->slots) * ring->slot_bytes;
                sink += (uint64_t)slot[0] + (uint64_t)slot[nbytes - 1];
                __atomic_store_n(&w->released[c], seq + 1, __ATOMIC_RELEASE);
                __atomic_add_fetch(&w->releases, 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&w->producer_waits, __ATOMIC_SEQ_CST))
                    futex_wake(&w->releases);
            }
        }
        out[k * num_steps + step] = now_ns(CLOCK_MONOTONIC) - start;
    }
    barrier_wait(num_ranks); /* the last step over */
    cpu += now_ns(CLOCK_PROCESS_CPUTIME_ID);
    out[num_ranks * num_steps + 2 * k] = cpu;
}

static void *shared(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("native_floor: mmap");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: native_floor SPEC OUT SOURCE...\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 2;
    }
    fseek(f, 0, SEEK_END);
    spec_len = ftell(f) / 8;
    fseek(f, 0, SEEK_SET);
    spec = malloc(spec_len * 8);
    if (fread(spec, 8, spec_len, f) != (size_t)spec_len) return 2;
    fclose(f);
    num_sources = argc - 3;
    if (num_sources > MAX_SOURCES) invalid("number of sources");
    for (int64_t s = 0; s < num_sources; s++) { /* the copies' sources, mapped read-only */
        int fd = open(argv[3 + s], O_RDONLY);
        struct stat st;
        if (fd < 0 || fstat(fd, &st)) {
            perror(argv[3 + s]);
            return 2;
        }
        source_size[s] = (size_t)st.st_size;
        source_base[s] = mmap(NULL, source_size[s], PROT_READ, MAP_SHARED, fd, 0);
        if (source_base[s] == MAP_FAILED) return 2;
        close(fd);
    }
    num_rings = next(), num_ranks = next(), num_steps = next(), warmup = next();
    if (num_rings < 1 || num_rings > MAX_RINGS || num_ranks < 1 || num_ranks > MAX_RANKS ||
        warmup < 0 || warmup >= num_steps)
        invalid("the header");
    for (int64_t r = 0; r < num_rings; r++) {
        Ring *ring = &rings[r];
        ring->slots = next(), ring->slot_bytes = next(), ring->consumers = next();
        if (ring->slots < 1 || ring->slot_bytes < 1 || ring->consumers < 1 ||
            ring->consumers > MAX_CONSUMERS)
            invalid("a ring");
        ring->words = shared(sizeof(RingWords));
        ring->data = shared((size_t)(ring->slots * ring->slot_bytes));
        ring->mb_count = calloc(num_steps, 8);
        ring->mbs = calloc(num_steps, sizeof(int64_t *));
        for (int64_t step = 0; step < num_steps; step++) {
            ring->mb_count[step] = next();
            ring->mbs[step] = spec + at;
            for (int64_t m = 0; m < ring->mb_count[step]; m++) {
                int64_t nbytes = next(), copies = next();
                if (nbytes <= 0 || nbytes > ring->slot_bytes) invalid("a micro-batch's size");
                for (int64_t c = 0; c < copies; c++) {
                    int64_t source = next(), offset = next(), to = next(), bytes = next();
                    if (source < 0 || source >= num_sources || offset < 0 || bytes < 0 ||
                        offset + bytes > (int64_t)source_size[source] || to < 0 ||
                        to + bytes > nbytes)
                        invalid("a copy");
                }
            }
        }
    }
    for (int64_t k = 0; k < num_ranks; k++) {
        ranks[k].num_rings = next();
        if (ranks[k].num_rings < 1 || ranks[k].num_rings > 2) invalid("a rank's rings");
        for (int64_t i = 0; i < ranks[k].num_rings; i++) {
            ranks[k].ring[i] = next(), ranks[k].index[i] = next();
            if (ranks[k].ring[i] < 0 || ranks[k].ring[i] >= num_rings || ranks[k].index[i] < 0 ||
                ranks[k].index[i] >= rings[ranks[k].ring[i]].consumers)
                invalid("a rank's ring");
        }
    }
    barrier = shared(sizeof(Barrier));
    size_t out_bytes = (size_t)(num_ranks * num_steps + 2 * (num_ranks + num_rings)) * 8;
    out = shared(out_bytes);
    pid_t pids[MAX_RINGS + MAX_RANKS];
    int64_t children = 0;
    for (int64_t r = 0; r < num_rings + num_ranks; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (r < num_rings)
                produce(r);
            else
                consume(r - num_rings);
            _exit(0);
        }
        pids[children++] = pid;
    }
    int failed = 0;
    for (int64_t c = 0; c < children; c++) {
        int status;
        waitpid(pids[c], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status)) {
            failed = 1;
            for (int64_t d = 0; d < children; d++) kill(pids[d], SIGKILL);
        }
    }
    if (failed) return 3;
    FILE *o = fopen(argv[2], "wb");
    if (!o || fwrite(out, 1, out_bytes, o) != out_bytes) return 2;
    fclose(o);
    return 0;
}

/* process_vm_readv of 64 MiB from another process's 4 KiB pages, on 1, 2, 4
 * and 8 threads each copying a part, into a destination already touched (a
 * pooled readback buffer) or fresh with MADV_HUGEPAGE (docs/latency.md,
 * "Readbacks on two threads"; nif/moat_finalizer.c's SPLIT_BYTES). Medians of 9.
 *
 *   cc -O2 -pthread bench/readback_threads.c -o /tmp/readback_threads && /tmp/readback_threads
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N ((size_t)64 << 20)
#define HUGE ((size_t)2 << 20)
#define REPS 9

static pid_t child;

typedef struct {
  char* to;
  char* from;
  size_t n;
} part;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* read_part(void* arg) {
  part* p = arg;
  struct iovec l = {p->to, p->n}, r = {p->from, p->n};
  if (process_vm_readv(child, &l, 1, &r, 1, 0) != (ssize_t)p->n) perror("process_vm_readv");
  return NULL;
}

static char* buffer(void) {
  char* p = mmap(NULL, N + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  p = (char*)(((size_t)p + HUGE - 1) & ~(HUGE - 1));
  madvise(p, N, MADV_HUGEPAGE);
  return p;
}

static int by_value(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(void) {
  /* The source: 4 KiB pages, written before the fork, so the child (which
   * only waits) maps the same pages at the same address. */
  char* src = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  memset(src, 1, N);
  child = fork();
  if (child == 0) {
    pause();
    return 0;
  }
  int threads[] = {1, 2, 4, 8};
  for (int fresh = 0; fresh < 2; fresh++) {
    for (int t = 0; t < 4; t++) {
      int k = threads[t];
      double gbs[REPS];
      for (int rep = 0; rep < REPS; rep++) {
        char* dst = buffer();
        if (!fresh) memset(dst, 0, N);
        pthread_t th[8];
        part parts[8];
        double t0 = now();
        for (int i = 0; i < k; i++) {
          parts[i] = (part){dst + i * (N / k), src + i * (N / k), N / k};
          if (i > 0) pthread_create(&th[i], NULL, read_part, &parts[i]);
        }
        read_part(&parts[0]);
        for (int i = 1; i < k; i++) pthread_join(th[i], NULL);
        gbs[rep] = N / (now() - t0) / 1e9;
        munmap(dst, N);
      }
      qsort(gbs, REPS, sizeof gbs[0], by_value);
      printf("%s destination, %d thread(s): %.2f GB/s (min %.2f, max %.2f)\n", fresh ? "fresh THP" : "touched", k,
             gbs[REPS / 2], gbs[0], gbs[REPS - 1]);
    }
  }
  kill(child, SIGKILL);
  wait(NULL);
  return 0;
}

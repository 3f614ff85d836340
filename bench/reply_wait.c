/* A request through a pipe to a process that serves it in SERVICE µs (spinning
 * 50 µs on its pipe before it blocks, as Moat's session does), and the reply
 * back three ways: through a pipe the requester blocks on, through a pipe it
 * polls for up to 50 µs first, and through shared memory it spins on.
 * Medians of 4,000 round trips (docs/latency.md, "The caller waits awake").
 *
 *   cc -O2 bench/reply_wait.c -o /tmp/reply_wait && /tmp/reply_wait 1.2 && /tmp/reply_wait 3.2
 */
#define _GNU_SOURCE
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N 4000

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void busy(double us) {
  double t = now_us();
  while (now_us() - t < us) {
  }
}

/* Polls fd for up to us µs; true once readable. */
static int poll_for(int fd, double us) {
  struct pollfd p = {fd, POLLIN, 0};
  double t = now_us();
  int ready;
  while (!(ready = poll(&p, 1, 0)) && now_us() - t < us) {
  }
  return ready;
}

static int by_value(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  double service = argc > 1 ? atof(argv[1]) : 3.2;
  const char* ways[] = {"pipe, requester blocks", "pipe, requester polls 50 us first",
                        "shared memory, requester spins"};
  for (int way = 0; way < 3; way++) {
    int req[2], rep[2];
    if (pipe(req) || pipe(rep)) return 1;
    _Atomic long* seq = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    atomic_store(seq, 0);
    pid_t server = fork();
    if (server == 0) {
      close(req[1]);
      char b[64];
      for (long k = 1;; k++) {
        if (!poll_for(req[0], 50)) {
          struct pollfd p = {req[0], POLLIN, 0};
          poll(&p, 1, -1);
        }
        if (read(req[0], b, sizeof b) <= 0) _exit(0);
        busy(service);
        if (way == 2) atomic_store_explicit(seq, k, memory_order_release);
        else if (write(rep[1], b, 16) != 16) _exit(1);
      }
    }
    close(req[0]);
    double lat[N];
    char b[64] = {1};
    for (long i = 0; i < N; i++) {
      double t = now_us();
      if (write(req[1], b, 16) != 16) return 1;
      if (way == 2) {
        while (atomic_load_explicit(seq, memory_order_acquire) != i + 1) {
        }
      } else {
        if (way == 1) poll_for(rep[0], 50);
        if (read(rep[0], b, sizeof b) <= 0) return 1;
      }
      lat[i] = now_us() - t;
      busy(2);
    }
    qsort(lat, N, sizeof lat[0], by_value);
    printf("service %.1f us, %-34s median %.1f us, p90 %.1f\n", service, ways[way], lat[N / 2], lat[N * 9 / 10]);
    close(req[1]);
    waitpid(server, NULL, 0);
  }
  return 0;
}

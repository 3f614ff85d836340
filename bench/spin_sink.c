/* A port program for bench/dispatch_profile.exs: drops whatever arrives on
 * fd 3 without ever sleeping: it polls the pipe with a zero timeout (which
 * leaves no waiter on the pipe's wait queue, so a write wakes no one, and
 * takes no pipe lock) and reads only when there is data. */
#include <errno.h>
#include <poll.h>
#include <unistd.h>

int main(void) {
  static char buf[1 << 16];
  struct pollfd p = {.fd = 3, .events = POLLIN};
  for (;;) {
    if (poll(&p, 1, 0) < 1) continue;
    ssize_t n = read(3, buf, sizeof buf);
    if (n == 0) return 0;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return 1;
  }
}

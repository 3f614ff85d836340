/*
 * Moat.Finalizer: resources whose only job is to tell a process when the VM
 * garbage-collects them. A tensor handle holds one; when the last copy of the
 * handle is gone, the destructor adds its id to the queue of the worker's
 * releaser, and wakes the releaser with {moat_released} if the queue was
 * empty; the releaser takes every queued id at once (drain/1) and batches
 * them into one :release frame. A message per batch instead of per id: a
 * dropped handle costs its creator almost nothing more than its allocation.
 *
 * No MLX here, and nothing that can fail in a way that harms the VM: the
 * destructor only appends to an array and sends an atom in a tuple.
 *
 * It also makes the binaries of large readbacks (protocol.md §6, "Shared
 * memory"): read_memory/5 copies a pinned tensor out of the worker's memory
 * into memory of this VM, and map_sealed/3 maps a worker's sealed readback
 * file. Neither leaves the VM depending on the worker's pages.
 *
 * And it holds each connection's outbox: the ordered queue of frames
 * written to its port as batch packets (see "outbox" below).
 */
#define _GNU_SOURCE
#include <erl_nif.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <poll.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

/* The ids one releaser has not taken yet. Queues live as long as the
 * library: one per releaser ever started (a few words per worker start). */
typedef struct queue {
  ErlNifPid to;
  ErlNifMutex* lock;
  ErlNifUInt64* ids;
  size_t len, cap;
  int woken; /* a {moat_released} is on its way and not yet followed by drain */
  struct queue* next;
} queue;

static ErlNifMutex* queues_lock;
static queue* queues;

typedef struct {
  queue* to;
  ErlNifUInt64 id;
  int released; /* set once, atomically: by release/1 or by the destructor */
} token;

static ErlNifResourceType* TOKEN;
static ErlNifResourceType* MAPPING;
static ErlNifResourceType* BUFFER;
static ERL_NIF_TERM atom_moat_released;
static ERL_NIF_TERM atom_true;
static ERL_NIF_TERM atom_false;

/* True for the one caller that moves the token from live to released. */
static int take(token* t) {
  int expected = 0;
  return __atomic_compare_exchange_n(&t->released, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

/* The queue of releaser `to`, made on first use; NULL without memory.
 * A queue found is moved to the front of the list: every worker start adds
 * a releaser, and without that a token of a worker restarted thousands of
 * times walked every older queue (40 µs a token after 5,000). */
static queue* queue_of(ErlNifPid* to) {
  enif_mutex_lock(queues_lock);
  queue** at = &queues;
  while (*at != NULL && enif_compare_pids(&(*at)->to, to) != 0) at = &(*at)->next;
  queue* q = *at;
  if (q != NULL && q != queues) {
    *at = q->next;
    q->next = queues;
    queues = q;
  }
  if (q == NULL) {
    q = enif_alloc(sizeof(queue));
    if (q != NULL) {
      q->lock = enif_mutex_create("moat_release_queue");
      if (q->lock == NULL) {
        enif_free(q);
        q = NULL;
      } else {
        q->to = *to;
        q->ids = NULL;
        q->len = q->cap = 0;
        q->woken = 0;
        q->next = queues;
        queues = q;
      }
    }
  }
  enif_mutex_unlock(queues_lock);
  return q;
}

/* Sends {moat_released} to the releaser; a dead one drops it. */
static void wake(ErlNifEnv* caller_env, queue* q) {
  ErlNifEnv* msg_env = enif_alloc_env();
  if (msg_env == NULL) return;
  enif_send(caller_env, &q->to, msg_env, enif_make_tuple1(msg_env, atom_moat_released));
  enif_free_env(msg_env);
}

/* Terms kept on tokens (keep/2): a large readback's mapped binary, which
 * the tensor's next readback returns instead of mapping its file again (its
 * pages are mapped in this VM already). Outside the token struct, so that
 * tokens made by an older load of this library (before an upgrade) stay
 * readable. Few (one per live tensor read back as a mapping): a list. */
typedef struct kept {
  const token* owner;
  ErlNifEnv* env;
  ERL_NIF_TERM term;
  struct kept* next;
} kept;

static ErlNifMutex* kept_lock;
static kept* kepts;

/* Drops what `t` keeps, if anything. */
static void forget_kept(const token* t) {
  kept* gone = NULL;
  enif_mutex_lock(kept_lock);
  for (kept** at = &kepts; *at != NULL; at = &(*at)->next) {
    if ((*at)->owner == t) {
      gone = *at;
      *at = gone->next;
      break;
    }
  }
  enif_mutex_unlock(kept_lock);
  if (gone != NULL) {
    enif_free_env(gone->env);
    enif_free(gone);
  }
}

static void token_dtor(ErlNifEnv* caller_env, void* obj) {
  token* t = (token*)obj;
  queue* q = t->to;
  forget_kept(t);
  if (!take(t)) return;
  enif_mutex_lock(q->lock);
  if (q->len == q->cap) {
    size_t cap = q->cap ? q->cap * 2 : 256;
    ErlNifUInt64* ids = enif_realloc(q->ids, cap * sizeof(ErlNifUInt64));
    if (ids == NULL) {
      /* No memory: the id is not released, as a lost message would not be. */
      enif_mutex_unlock(q->lock);
      return;
    }
    q->ids = ids;
    q->cap = cap;
  }
  q->ids[q->len++] = t->id;
  int first = !q->woken;
  q->woken = 1;
  enif_mutex_unlock(q->lock);
  if (first) wake(caller_env, q);
}

/* drain(Pid) -> the ids queued for releaser Pid, at most 65536 per call
 * (it calls again while it gets a full list). */
static ERL_NIF_TERM token_drain(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  ErlNifPid to;
  (void)argc;
  if (!enif_get_local_pid(env, argv[0], &to)) return enif_make_badarg(env);
  queue* q = queue_of(&to);
  if (q == NULL) return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  ERL_NIF_TERM list = enif_make_list(env, 0);
  enif_mutex_lock(q->lock);
  size_t n = q->len < 65536 ? q->len : 65536;
  for (size_t i = q->len - n; i < q->len; i++) list = enif_make_list_cell(env, enif_make_uint64(env, q->ids[i]), list);
  q->len -= n;
  /* The next id queued wakes the releaser again. */
  if (q->len == 0) q->woken = 0;
  enif_mutex_unlock(q->lock);
  return list;
}

/* new(Pid, Id) -> Token */
static ERL_NIF_TERM token_new(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  ErlNifPid to;
  ErlNifUInt64 id;
  (void)argc;
  if (!enif_get_local_pid(env, argv[0], &to) || !enif_get_uint64(env, argv[1], &id)) {
    return enif_make_badarg(env);
  }
  queue* q = queue_of(&to);
  token* t = q ? enif_alloc_resource(TOKEN, sizeof(token)) : NULL;
  if (t == NULL) return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  t->to = q;
  t->id = id;
  t->released = 0;
  ERL_NIF_TERM term = enif_make_resource(env, t);
  enif_release_resource(t);
  return term;
}

/* release(Token) -> true the first time, false afterwards. The destructor of
 * a released token sends nothing. */
static ERL_NIF_TERM token_release(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  token* t;
  (void)argc;
  if (!enif_get_resource(env, argv[0], TOKEN, (void**)&t)) return enif_make_badarg(env);
  int first = take(t);
  forget_kept(t);
  return first ? atom_true : atom_false;
}

/* keep(Token, Term) -> true, or false when the token keeps a term already
 * or was released. Term is copied (a binary in it is shared, not copied)
 * and kept until the token is released or collected. */
static ERL_NIF_TERM token_keep(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  token* t;
  (void)argc;
  if (!enif_get_resource(env, argv[0], TOKEN, (void**)&t)) return enif_make_badarg(env);
  kept* k = enif_alloc(sizeof(kept));
  ErlNifEnv* held = k ? enif_alloc_env() : NULL;
  if (held == NULL) {
    if (k) enif_free(k);
    return atom_false;
  }
  k->owner = t;
  k->env = held;
  k->term = enif_make_copy(held, argv[1]);
  int taken = 0;
  enif_mutex_lock(kept_lock);
  /* Checked under the lock: a release after this sees the entry and drops it. */
  if (__atomic_load_n(&t->released, __ATOMIC_ACQUIRE)) taken = 1;
  for (kept* at = kepts; at != NULL && !taken; at = at->next) taken = at->owner == t;
  if (!taken) {
    k->next = kepts;
    kepts = k;
  }
  enif_mutex_unlock(kept_lock);
  if (taken) {
    enif_free_env(held);
    enif_free(k);
    return atom_false;
  }
  return atom_true;
}

/* kept(Token) -> the term keep/2 kept on it, or nil. */
static ERL_NIF_TERM token_kept(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  token* t;
  (void)argc;
  if (!enif_get_resource(env, argv[0], TOKEN, (void**)&t)) return enif_make_badarg(env);
  ERL_NIF_TERM found = enif_make_atom(env, "nil");
  enif_mutex_lock(kept_lock);
  for (kept* at = kepts; at != NULL; at = at->next) {
    if (at->owner == t) {
      found = enif_make_copy(env, at->term);
      break;
    }
  }
  enif_mutex_unlock(kept_lock);
  return found;
}

/* released(Token) -> whether release/1 or the destructor has run. */
static ERL_NIF_TERM token_released(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  token* t;
  (void)argc;
  if (!enif_get_resource(env, argv[0], TOKEN, (void**)&t)) return enif_make_badarg(env);
  return __atomic_load_n(&t->released, __ATOMIC_ACQUIRE) ? atom_true : atom_false;
}

/* A read-only mapping of a sealed memory file, alive while any binary made
 * over it is (enif_make_resource_binary). */
typedef struct {
  void* data;
  size_t len;
} mapping;

static void mapping_dtor(ErlNifEnv* env, void* obj) {
  mapping* m = (mapping*)obj;
  (void)env;
  if (m->data != NULL) munmap(m->data, m->len);
}

static ERL_NIF_TERM error(ErlNifEnv* env, const char* why) {
  return enif_make_tuple2(env, enif_make_atom(env, "error"), enif_make_atom(env, why));
}

static ERL_NIF_TERM errno_error(ErlNifEnv* env, int e) {
  switch (e) {
    case ENOENT: return error(env, "enoent");
    case EACCES: return error(env, "eacces");
    case EPERM: return error(env, "eperm");
    case ENOMEM: return error(env, "enomem");
    case EMFILE: return error(env, "emfile");
    case ENFILE: return error(env, "enfile");
    case EINVAL: return error(env, "einval");
    case ESRCH: return error(env, "esrch");
    case EFAULT: return error(env, "efault");
    default: return error(env, "system_error");
  }
}

/* Seals a file must carry before it is mapped: no one can shrink it (a
 * mapping past its end would raise SIGBUS in the VM), write it (a binary
 * never changes) or remove a seal. */
#define REQUIRED_SEALS (F_SEAL_SHRINK | F_SEAL_WRITE | F_SEAL_SEAL)

/* Maps the sealed file Path (the worker's /proc/<pid>/fd/<n>) read-only:
 * opens it, checks that it is the file the worker announced (Inode, so that
 * a dead worker's pid taken by another process is never read), that it
 * holds FileBytes bytes and carries REQUIRED_SEALS, maps all of it, and
 * returns the binary over its Bytes bytes from Offset. The binary stays
 * valid whatever becomes of the worker: the mapping holds the file's pages. */
static ERL_NIF_TERM map_file(ErlNifEnv* env, ERL_NIF_TERM path_term, ErlNifUInt64 inode, ErlNifUInt64 file_bytes,
                             ErlNifUInt64 offset, ErlNifUInt64 bytes) {
  ErlNifBinary path;
  char name[256];
  if (!enif_inspect_binary(env, path_term, &path) || path.size == 0 || path.size >= sizeof(name) ||
      memchr(path.data, 0, path.size) != NULL || bytes == 0 ||
      offset > file_bytes || bytes > file_bytes - offset) {
    return enif_make_badarg(env);
  }
  memcpy(name, path.data, path.size);
  name[path.size] = 0;

  int fd = open(name, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_error(env, errno);
  struct stat st;
  ERL_NIF_TERM refused = 0;
  if (fstat(fd, &st) != 0) {
    refused = errno_error(env, errno);
  } else if ((ErlNifUInt64)st.st_ino != inode) {
    refused = error(env, "not_the_workers_file");
  } else if (st.st_size < 0 || (ErlNifUInt64)st.st_size != file_bytes) {
    refused = error(env, "wrong_size");
  } else {
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & REQUIRED_SEALS) != REQUIRED_SEALS) refused = error(env, "not_sealed");
  }
  if (refused) {
    close(fd);
    return refused;
  }
  void* data = mmap(NULL, (size_t)file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  int map_errno = errno;
  /* The mapping keeps the file alive; the descriptor is not needed. */
  close(fd);
  if (data == MAP_FAILED) return errno_error(env, map_errno);

  mapping* m = enif_alloc_resource(MAPPING, sizeof(mapping));
  if (m == NULL) {
    munmap(data, (size_t)file_bytes);
    return error(env, "enomem");
  }
  m->data = data;
  m->len = (size_t)file_bytes;
  ERL_NIF_TERM bin = enif_make_resource_binary(env, m, (char*)data + offset, (size_t)bytes);
  enif_release_resource(m);
  return enif_make_tuple2(env, enif_make_atom(env, "ok"), bin);
}

/* map_sealed(Path, Inode, Bytes) -> {ok, Binary} | {error, Why}: a sealed
 * readback file of exactly Bytes bytes, all of it (map_file). */
static ERL_NIF_TERM map_sealed(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  ErlNifUInt64 inode, bytes;
  (void)argc;
  if (!enif_get_uint64(env, argv[1], &inode) || !enif_get_uint64(env, argv[2], &bytes)) return enif_make_badarg(env);
  return map_file(env, argv[0], inode, bytes, 0, bytes);
}

/* map_sealed(Path, Inode, FileBytes, Offset, Bytes) -> {ok, Binary} |
 * {error, Why}: Bytes bytes at Offset of a sealed file of FileBytes bytes
 * (a worker's exported buffer, protocol.md §6 "Zero-copy readback"). */
static ERL_NIF_TERM map_sealed_range(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  ErlNifUInt64 inode, file_bytes, offset, bytes;
  (void)argc;
  if (!enif_get_uint64(env, argv[1], &inode) || !enif_get_uint64(env, argv[2], &file_bytes) ||
      !enif_get_uint64(env, argv[3], &offset) || !enif_get_uint64(env, argv[4], &bytes)) {
    return enif_make_badarg(env);
  }
  return map_file(env, argv[0], inode, file_bytes, offset, bytes);
}

/* Readback buffers: anonymous memory of this VM, in whole 2 MiB pages
 * (transparent huge pages where the kernel gives them: one fault and one
 * page-table entry per 2 MiB instead of 512, which is most of what a copy
 * into fresh memory costs), alive while any binary made over one is.
 *
 * A buffer whose binaries are all gone waits in a small pool for the next
 * readback of about its size, its pages still in place: a readback into it
 * is a copy at memory speed, with no page to fault in or clear. The pool
 * keeps at most POOL_SLOTS buffers and POOL_BYTES bytes, none for longer
 * than POOL_SECONDS after it was freed (checked whenever the pool is
 * used), and trim_pool/0 empties it. */
#define HUGE_PAGE ((size_t)2 << 20)
#define POOL_SLOTS 2
#define POOL_BYTES ((size_t)256 << 20)
#define POOL_SECONDS 10

typedef struct {
  void* data;
  size_t cap;
} buffer;

typedef struct {
  void* data;
  size_t cap;
  ErlNifTime freed;
} pooled;

static ErlNifMutex* pool_lock;
static pooled pool[POOL_SLOTS];

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* cap bytes at a 2 MiB boundary (so that every 2 MiB of it can be a huge
 * page), or NULL. */
static void* map_buffer(size_t cap) {
  size_t len = cap + HUGE_PAGE;
  char* raw = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return NULL;
  char* start = (char*)round_up((size_t)raw, HUGE_PAGE);
  if (start > raw) munmap(raw, (size_t)(start - raw));
  size_t tail = (size_t)(raw + len - (start + cap));
  if (tail > 0) munmap(start + cap, tail);
  /* Advice only: without huge pages the buffer still works. */
  (void)madvise(start, cap, MADV_HUGEPAGE);
  return start;
}

/* Drops pooled buffers freed more than POOL_SECONDS ago (all with
 * max_age 0). Call with pool_lock held. */
static void pool_expire(ErlNifTime now, ErlNifTime max_age) {
  for (int i = 0; i < POOL_SLOTS; i++) {
    if (pool[i].data != NULL && now - pool[i].freed >= max_age) {
      munmap(pool[i].data, pool[i].cap);
      pool[i].data = NULL;
    }
  }
}

/* A pooled buffer for `bytes` bytes (at least that, at most twice that
 * rounded up to 2 MiB), taken out of the pool; or a new one. */
static void* take_buffer(size_t bytes, size_t* cap) {
  size_t want = round_up(bytes, HUGE_PAGE);
  void* data = NULL;
  enif_mutex_lock(pool_lock);
  pool_expire(enif_monotonic_time(ERL_NIF_SEC), POOL_SECONDS);
  int best = -1;
  for (int i = 0; i < POOL_SLOTS; i++) {
    if (pool[i].data != NULL && pool[i].cap >= want && pool[i].cap <= 2 * want &&
        (best < 0 || pool[i].cap < pool[best].cap)) {
      best = i;
    }
  }
  if (best >= 0) {
    data = pool[best].data;
    *cap = pool[best].cap;
    pool[best].data = NULL;
  }
  enif_mutex_unlock(pool_lock);
  if (data == NULL) {
    *cap = want;
    data = map_buffer(want);
  }
  return data;
}

/* Back to the pool, or unmapped where it does not fit. */
static void give_buffer(void* data, size_t cap) {
  enif_mutex_lock(pool_lock);
  ErlNifTime now = enif_monotonic_time(ERL_NIF_SEC);
  pool_expire(now, POOL_SECONDS);
  size_t held = 0;
  int slot = -1;
  for (int i = 0; i < POOL_SLOTS; i++) {
    if (pool[i].data != NULL) held += pool[i].cap;
    else if (slot < 0) slot = i;
  }
  if (slot >= 0 && held + cap <= POOL_BYTES) {
    pool[slot].data = data;
    pool[slot].cap = cap;
    pool[slot].freed = now;
    data = NULL;
  }
  enif_mutex_unlock(pool_lock);
  if (data != NULL) munmap(data, cap);
}

static void buffer_dtor(ErlNifEnv* env, void* obj) {
  buffer* b = (buffer*)obj;
  (void)env;
  if (b->data != NULL) give_buffer(b->data, b->cap);
}

/* trim_pool() -> ok: unmaps every pooled buffer. */
static ERL_NIF_TERM trim_pool(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  (void)argc;
  (void)argv;
  enif_mutex_lock(pool_lock);
  pool_expire(enif_monotonic_time(ERL_NIF_SEC), 0);
  enif_mutex_unlock(pool_lock);
  return enif_make_atom(env, "ok");
}

#define PROBE_BYTES 16

/* A readback of at least SPLIT_BYTES is copied by up to READ_THREADS
 * threads, each a part of at least SPLIT_BYTES / 2: one process_vm_readv
 * walks the worker's 4 KiB pages one by one, bound by that walk rather than
 * by memory (64 MiB into a buffer from the pool: about 4 GB/s with one
 * thread, 8 with two, on a 2-vCPU VM; docs/latency.md, "Readbacks on two
 * threads"). */
#define SPLIT_BYTES ((size_t)16 << 20)
#define READ_THREADS 4

/* One process_vm_readv of a part, the probe first. */
typedef struct {
  pid_t pid;
  const void* probe_at;
  unsigned char probe[PROBE_BYTES];
  char* to;
  const char* from;
  size_t n;
  ssize_t got;
  int err;
} part;

static void* read_part(void* arg) {
  part* p = (part*)arg;
  struct iovec local[2] = {{p->probe, PROBE_BYTES}, {p->to, p->n}};
  struct iovec remote[2] = {{(void*)p->probe_at, PROBE_BYTES}, {(void*)p->from, p->n}};
  int n = p->n > 0 ? 2 : 1;
  p->got = process_vm_readv(p->pid, local, n, remote, n, 0);
  p->err = errno;
  return NULL;
}

/* How many threads read `bytes`: at most READ_THREADS and the CPUs online. */
static int read_threads(size_t bytes) {
  if (bytes < SPLIT_BYTES) return 1;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  size_t by_size = bytes / (SPLIT_BYTES / 2);
  long n = cpus < READ_THREADS ? cpus : READ_THREADS;
  if ((size_t)n > by_size) n = (long)by_size;
  return n < 1 ? 1 : (int)n;
}

/* read_memory(OsPid, ProbeAddress, Nonce, Address, Bytes) -> {ok, Binary} | {error, Why}.
 *
 * Copies Bytes bytes at Address of process OsPid (the worker, which keeps
 * them pinned until the client releases the pin) into a readback buffer.
 * Each process_vm_readv (one per part, parts read on threads of their own)
 * also reads the PROBE_BYTES at ProbeAddress: a probe and its part come
 * from one address space, so when every probe equals Nonce (what the worker
 * announced in its hello), every byte is the worker's, not that of another
 * process that took a dead worker's pid. Anything short of every byte is an
 * error, and the buffer goes back. Runs on a dirty scheduler: 64 MiB take
 * milliseconds. */
static ERL_NIF_TERM read_memory(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  int os_pid;
  ErlNifUInt64 probe_at, at, bytes;
  ErlNifBinary nonce;
  (void)argc;
  if (!enif_get_int(env, argv[0], &os_pid) || os_pid <= 0 || !enif_get_uint64(env, argv[1], &probe_at) ||
      !enif_inspect_binary(env, argv[2], &nonce) || nonce.size != PROBE_BYTES ||
      !enif_get_uint64(env, argv[3], &at) || !enif_get_uint64(env, argv[4], &bytes) ||
      bytes > (ErlNifUInt64)SSIZE_MAX - PROBE_BYTES) {
    return enif_make_badarg(env);
  }
  size_t cap = 0;
  char* data = bytes > 0 ? take_buffer((size_t)bytes, &cap) : NULL;
  if (bytes > 0 && data == NULL) return error(env, "enomem");

  int threads = read_threads((size_t)bytes);
  part parts[READ_THREADS];
  ErlNifTid tids[READ_THREADS];
  int started[READ_THREADS] = {0};
  /* Parts in whole pages, the last one taking the rest. */
  size_t each = threads > 1 ? round_up((size_t)bytes / (size_t)threads, 4096) : (size_t)bytes;
  for (int i = 0; i < threads; i++) {
    size_t from = (size_t)i * each;
    parts[i] = (part){.pid = (pid_t)os_pid,
                      .probe_at = (const void*)(uintptr_t)probe_at,
                      .to = data + from,
                      .from = (const char*)(uintptr_t)at + from,
                      .n = i == threads - 1 ? (size_t)bytes - from : each};
  }
  /* Part 0 on this thread; a part whose thread cannot start is read here too. */
  for (int i = 1; i < threads; i++) {
    started[i] = enif_thread_create("moat_readback", &tids[i], read_part, &parts[i], NULL) == 0;
  }
  read_part(&parts[0]);
  for (int i = 1; i < threads; i++) {
    if (started[i]) enif_thread_join(tids[i], NULL);
    else read_part(&parts[i]);
  }

  ERL_NIF_TERM refused = 0;
  for (int i = 0; i < threads && !refused; i++) {
    part* p = &parts[i];
    if (p->got < 0) refused = errno_error(env, p->err);
    else if (p->got < PROBE_BYTES || memcmp(p->probe, nonce.data, PROBE_BYTES) != 0) refused = error(env, "not_the_worker");
    else if ((size_t)p->got != PROBE_BYTES + p->n) refused = error(env, "short_read");
  }
  if (refused) {
    if (data != NULL) give_buffer(data, cap);
    return refused;
  }
  if (data == NULL) {
    ErlNifBinary empty;
    if (!enif_alloc_binary(0, &empty)) return error(env, "enomem");
    return enif_make_tuple2(env, enif_make_atom(env, "ok"), enif_make_binary(env, &empty));
  }
  buffer* b = enif_alloc_resource(BUFFER, sizeof(buffer));
  if (b == NULL) {
    give_buffer(data, cap);
    return error(env, "enomem");
  }
  b->data = data;
  b->cap = cap;
  ERL_NIF_TERM bin = enif_make_resource_binary(env, b, data, (size_t)bytes);
  enif_release_resource(b);
  return enif_make_tuple2(env, enif_make_atom(env, "ok"), bin);
}


/* The outbox of a worker's connection (Moat.Writer, docs/latency.md
 * "Batched writes"): frames queued by any process, in the order of their
 * pushes, written to the port as batch packets (protocol.md §1, "Batches").
 *
 * Every write of queued frames happens here, under the outbox's lock, with
 * enif_port_command (which enqueues the packet on the port before it
 * returns and never suspends its caller): so frames reach the port in the
 * order they were pushed whoever writes them, and no process can die
 * holding frames it took (they never leave the outbox but into the port).
 * The writer process flushes when woken by the first push into an empty
 * outbox; a call flushes the queue itself with its own frame as the last
 * of the batch (outbox_call/2), so it never waits for the writer.
 *
 * Queued terms live in the outbox's own environment (enif_make_copy, which
 * shares refc binaries), cleared at each flush. The outbox monitors its
 * writer: when the writer dies it closes, its queued frames are dropped,
 * and every later push answers `closed`; so does a write the port refuses
 * (it is closed: the worker died). */
#define BATCH_FRAMES 256

typedef struct {
  ErlNifMutex* lock;
  ErlNifPid writer;
  ErlNifPort port;
  ErlNifMonitor monitor;
  ErlNifEnv* env;
  ERL_NIF_TERM* frames;
  size_t* sizes;
  size_t len, cap;
  int woken; /* a {moat_outbox} is on its way, not yet followed by a flush */
  int closed;
} outbox;

static ErlNifResourceType* OUTBOX;
static ERL_NIF_TERM atom_moat_outbox;
static ERL_NIF_TERM atom_ok;
static ERL_NIF_TERM atom_direct;
static ERL_NIF_TERM atom_closed;

static void outbox_drop(outbox* o) {
  /* Release: a caller that reads 0 without the lock (outbox_call) sees the
   * port command that wrote the frames too. */
  __atomic_store_n(&o->len, 0, __ATOMIC_RELEASE);
  if (o->env != NULL) enif_clear_env(o->env);
}

static void outbox_dtor(ErlNifEnv* env, void* obj) {
  outbox* o = (outbox*)obj;
  (void)env;
  if (o->env != NULL) enif_free_env(o->env);
  if (o->frames != NULL) enif_free(o->frames);
  if (o->sizes != NULL) enif_free(o->sizes);
  if (o->lock != NULL) enif_mutex_destroy(o->lock);
}

static void outbox_down(ErlNifEnv* env, void* obj, ErlNifPid* pid, ErlNifMonitor* mon) {
  outbox* o = (outbox*)obj;
  (void)env;
  (void)pid;
  (void)mon;
  enif_mutex_lock(o->lock);
  __atomic_store_n(&o->closed, 1, __ATOMIC_RELEASE);
  outbox_drop(o);
  enif_mutex_unlock(o->lock);
}

/* outbox_new(WriterPid, Port) -> Outbox */
static ERL_NIF_TERM outbox_new(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  ErlNifPid writer;
  ErlNifPort port;
  (void)argc;
  if (!enif_get_local_pid(env, argv[0], &writer) || !enif_get_local_port(env, argv[1], &port)) {
    return enif_make_badarg(env);
  }
  outbox* o = enif_alloc_resource(OUTBOX, sizeof(outbox));
  if (o == NULL) return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  memset(o, 0, sizeof(outbox));
  o->writer = writer;
  o->port = port;
  o->lock = enif_mutex_create("moat_outbox");
  o->env = enif_alloc_env();
  if (o->lock == NULL || o->env == NULL) {
    enif_release_resource(o);
    return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  }
  /* A writer already dead closes it at once. */
  if (enif_monitor_process(env, o, &writer, &o->monitor) != 0) o->closed = 1;
  ERL_NIF_TERM term = enif_make_resource(env, o);
  enif_release_resource(o);
  return term;
}

/* The byte size of iodata `t`, or 0 when it is not iodata (a frame is
 * never empty: it holds at least its header length). */
static int iodata_size(ErlNifEnv* env, ERL_NIF_TERM t, size_t* n, int depth) {
  ErlNifBinary b;
  ERL_NIF_TERM head;
  int byte;
  if (enif_inspect_binary(env, t, &b)) {
    *n += b.size;
    return 1;
  }
  if (depth > 32) return 0;
  while (enif_get_list_cell(env, t, &head, &t)) {
    if (enif_get_int(env, head, &byte)) {
      if (byte < 0 || byte > 255) return 0;
      *n += 1;
    } else if (!iodata_size(env, head, n, depth + 1)) {
      return 0;
    }
  }
  if (enif_is_empty_list(env, t)) return 1;
  if (enif_inspect_binary(env, t, &b)) {
    *n += b.size;
    return 1;
  }
  return 0;
}

/* The frame to queue for iodata `t`, and its byte size: `t` itself where
 * the walk above sizes it, else (iodata nested deeper than it walks, or a
 * shape it does not know) `t` flattened into one binary by
 * enif_inspect_iolist_as_binary, which takes any iodata. 0 when `t` is not
 * iodata at all. */
static int frame_of(ErlNifEnv* env, ERL_NIF_TERM t, ERL_NIF_TERM* frame, size_t* size) {
  ErlNifBinary flat;
  *size = 0;
  if (iodata_size(env, t, size, 0)) {
    *frame = t;
    return 1;
  }
  if (!enif_inspect_iolist_as_binary(env, t, &flat)) return 0;
  unsigned char* p = enif_make_new_binary(env, flat.size, frame);
  if (p == NULL) return 0;
  if (flat.size > 0) memcpy(p, flat.data, flat.size);
  *size = flat.size;
  return 1;
}

/* Queues `frame` of `size` bytes. Call with the lock held; 0 without memory. */
static int outbox_append(outbox* o, ERL_NIF_TERM frame, size_t size) {
  if (o->len == o->cap) {
    size_t cap = o->cap ? o->cap * 2 : 256;
    ERL_NIF_TERM* frames = enif_realloc(o->frames, cap * sizeof(ERL_NIF_TERM));
    if (frames == NULL) return 0;
    o->frames = frames;
    size_t* sizes = enif_realloc(o->sizes, cap * sizeof(size_t));
    if (sizes == NULL) return 0;
    o->sizes = sizes;
    o->cap = cap;
  }
  o->frames[o->len] = enif_make_copy(o->env, frame);
  o->sizes[o->len] = size;
  /* Atomic: outbox_call reads len without the lock. */
  __atomic_store_n(&o->len, o->len + 1, __ATOMIC_RELEASE);
  return 1;
}

static ERL_NIF_TERM u32_binary(ErlNifEnv* env, size_t n) {
  ERL_NIF_TERM term;
  unsigned char* p = enif_make_new_binary(env, 4, &term);
  p[0] = (unsigned char)(n >> 24);
  p[1] = (unsigned char)(n >> 16);
  p[2] = (unsigned char)(n >> 8);
  p[3] = (unsigned char)n;
  return term;
}

/* Writes everything queued as batch packets of at most BATCH_FRAMES frames,
 * in order, and empties the queue. Call with the lock held; 0 when the port
 * refused (it is closed), which closes the outbox. */
static int outbox_write(ErlNifEnv* env, outbox* o) {
  int ok = 1;
  for (size_t start = 0; ok && start < o->len; start += BATCH_FRAMES) {
    size_t end = start + BATCH_FRAMES < o->len ? start + BATCH_FRAMES : o->len;
    ERL_NIF_TERM list = enif_make_list(o->env, 0);
    for (size_t i = end; i > start; i--) {
      list = enif_make_list_cell(o->env, o->frames[i - 1], list);
      list = enif_make_list_cell(o->env, u32_binary(o->env, o->sizes[i - 1]), list);
    }
    list = enif_make_list_cell(o->env, u32_binary(o->env, 0), list);
    ok = enif_port_command(env, &o->port, o->env, list);
  }
  outbox_drop(o);
  if (!ok) __atomic_store_n(&o->closed, 1, __ATOMIC_RELEASE);
  return ok;
}

static void wake_writer(ErlNifEnv* env, ErlNifPid* writer) {
  ErlNifEnv* msg_env = enif_alloc_env();
  if (msg_env == NULL) return;
  enif_send(env, writer, msg_env, enif_make_tuple1(msg_env, atom_moat_outbox));
  enif_free_env(msg_env);
}

/* outbox_push(Outbox, Frame) -> ok | closed. Frame (iodata) is queued
 * behind every frame pushed before it; the first push after a flush wakes
 * the writer. */
static ERL_NIF_TERM outbox_push(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  outbox* o;
  size_t size = 0;
  ERL_NIF_TERM frame;
  (void)argc;
  if (!enif_get_resource(env, argv[0], OUTBOX, (void**)&o) || !frame_of(env, argv[1], &frame, &size)) {
    return enif_make_badarg(env);
  }
  int wake = 0, appended = 1;
  ERL_NIF_TERM answer = atom_ok;
  enif_mutex_lock(o->lock);
  if (o->closed) {
    answer = atom_closed;
  } else {
    appended = outbox_append(o, frame, size);
    wake = appended && !o->woken;
    if (wake) o->woken = 1;
  }
  ErlNifPid writer = o->writer;
  enif_mutex_unlock(o->lock);
  if (!appended) return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  if (wake) wake_writer(env, &writer);
  return answer;
}

/* outbox_call(Outbox, Frame) -> direct | ok | closed. With nothing queued:
 * `direct`, and the caller writes Frame itself (Port.command/2). Otherwise
 * Frame is written now, as the last frame of a batch of everything queued
 * (ok), or the port is closed (closed). */
static ERL_NIF_TERM outbox_call(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  outbox* o;
  size_t size = 0;
  ERL_NIF_TERM frame;
  (void)argc;
  if (!enif_get_resource(env, argv[0], OUTBOX, (void**)&o)) return enif_make_badarg(env);
  /* With nothing queued, Port.command/2 checks the frame. */
  if (__atomic_load_n(&o->len, __ATOMIC_ACQUIRE) == 0 && !__atomic_load_n(&o->closed, __ATOMIC_ACQUIRE)) {
    return atom_direct;
  }
  if (!frame_of(env, argv[1], &frame, &size)) return enif_make_badarg(env);
  ERL_NIF_TERM answer;
  enif_mutex_lock(o->lock);
  if (o->closed) {
    answer = atom_closed;
  } else if (o->len == 0) {
    answer = atom_direct;
  } else if (!outbox_append(o, frame, size)) {
    answer = 0;
  } else {
    answer = outbox_write(env, o) ? atom_ok : atom_closed;
  }
  enif_mutex_unlock(o->lock);
  if (answer == 0) return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  return answer;
}

/* outbox_flush(Outbox) -> ok | closed: writes everything queued (the
 * writer's job; also a sender's before it writes a large frame itself). */
static ERL_NIF_TERM outbox_flush(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  outbox* o;
  (void)argc;
  if (!enif_get_resource(env, argv[0], OUTBOX, (void**)&o)) return enif_make_badarg(env);
  enif_mutex_lock(o->lock);
  ERL_NIF_TERM answer = o->closed ? atom_closed : outbox_write(env, o) ? atom_ok : atom_closed;
  o->woken = 0;
  enif_mutex_unlock(o->lock);
  return answer;
}

/* outbox_queued(Outbox) -> the number of frames queued (for tests). */
static ERL_NIF_TERM outbox_queued(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  outbox* o;
  (void)argc;
  if (!enif_get_resource(env, argv[0], OUTBOX, (void**)&o)) return enif_make_badarg(env);
  enif_mutex_lock(o->lock);
  size_t n = o->len;
  enif_mutex_unlock(o->lock);
  return enif_make_uint64(env, n);
}

/* wait_readable(Fd, MaxUs) -> true | false: polls Fd without sleeping for
 * up to MaxUs microseconds (at most 200) until it is readable. */
static ERL_NIF_TERM wait_readable(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  int fd, max_us;
  (void)argc;
  if (!enif_get_int(env, argv[0], &fd) || fd < 0 || !enif_get_int(env, argv[1], &max_us) || max_us < 0 || max_us > 200)
    return enif_make_badarg(env);
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) return atom_true;
    /* The worker may be waiting for this CPU (a busy machine). */
    sched_yield();
    clock_gettime(CLOCK_MONOTONIC, &t);
    if ((t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 >= max_us) return atom_false;
  }
}

static ERL_NIF_TERM loaded(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  (void)env;
  (void)argc;
  (void)argv;
  return atom_true;
}

static int open_token_type(ErlNifEnv* env, ErlNifResourceFlags flags) {
  TOKEN = enif_open_resource_type(env, NULL, "moat_token", token_dtor, flags, NULL);
  if (TOKEN == NULL) return 1;
  MAPPING = enif_open_resource_type(env, NULL, "moat_mapping", mapping_dtor, flags, NULL);
  if (MAPPING == NULL) return 1;
  BUFFER = enif_open_resource_type(env, NULL, "moat_buffer", buffer_dtor, flags, NULL);
  if (BUFFER == NULL) return 1;
  ErlNifResourceTypeInit outbox_init = {outbox_dtor, NULL, outbox_down, 0, NULL};
  OUTBOX = enif_open_resource_type_x(env, "moat_outbox", &outbox_init, flags, NULL);
  if (OUTBOX == NULL) return 1;
  atom_moat_released = enif_make_atom(env, "moat_released");
  atom_moat_outbox = enif_make_atom(env, "moat_outbox");
  atom_ok = enif_make_atom(env, "ok");
  atom_direct = enif_make_atom(env, "direct");
  atom_closed = enif_make_atom(env, "closed");
  atom_true = enif_make_atom(env, "true");
  atom_false = enif_make_atom(env, "false");
  return 0;
}

static int load(ErlNifEnv* env, void** priv, ERL_NIF_TERM info) {
  (void)priv;
  (void)info;
  queues_lock = enif_mutex_create("moat_release_queues");
  pool_lock = enif_mutex_create("moat_readback_pool");
  kept_lock = enif_mutex_create("moat_kept");
  if (queues_lock == NULL || pool_lock == NULL || kept_lock == NULL) return 1;
  return open_token_type(env, ERL_NIF_RT_CREATE);
}

/* A reloaded module takes over the tokens that are alive. */
static int upgrade(ErlNifEnv* env, void** priv, void** old_priv, ERL_NIF_TERM info) {
  (void)priv;
  (void)old_priv;
  (void)info;
  if (queues_lock == NULL) queues_lock = enif_mutex_create("moat_release_queues");
  if (pool_lock == NULL) pool_lock = enif_mutex_create("moat_readback_pool");
  if (kept_lock == NULL) kept_lock = enif_mutex_create("moat_kept");
  if (queues_lock == NULL || pool_lock == NULL || kept_lock == NULL) return 1;
  return open_token_type(env, ERL_NIF_RT_CREATE | ERL_NIF_RT_TAKEOVER);
}

static ErlNifFunc funcs[] = {
    {"new", 2, token_new, 0},
    {"release", 1, token_release, 0},
    {"released?", 1, token_released, 0},
    {"keep", 2, token_keep, 0},
    {"kept", 1, token_kept, 0},
    {"loaded?", 0, loaded, 0},
    {"drain", 1, token_drain, 0},
    {"map_sealed", 3, map_sealed, 0},
    {"map_sealed", 5, map_sealed_range, 0},
    {"read_memory", 5, read_memory, ERL_NIF_DIRTY_JOB_CPU_BOUND},
    {"trim_pool", 0, trim_pool, 0},
    {"wait_readable", 2, wait_readable, 0},
    {"outbox_new", 2, outbox_new, 0},
    {"outbox_push", 2, outbox_push, 0},
    {"outbox_call", 2, outbox_call, 0},
    {"outbox_flush", 1, outbox_flush, 0},
    {"outbox_queued", 1, outbox_queued, 0},
};

ERL_NIF_INIT(Elixir.Moat.Finalizer, funcs, load, NULL, upgrade, NULL)

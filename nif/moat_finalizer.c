/*
 * Moat.Finalizer: resources whose only job is to tell a process when the VM
 * garbage-collects them. A tensor handle holds one; when the last copy of the
 * handle is gone, the destructor sends {moat_release, Id} to the worker's
 * releaser, which batches ids into one :release frame.
 *
 * No MLX here, and nothing that can fail in a way that harms the VM: the
 * destructor only sends a two-element tuple.
 */
#include <erl_nif.h>

typedef struct {
  ErlNifPid to;
  ErlNifUInt64 id;
  int released; /* set once, atomically: by release/1 or by the destructor */
} token;

static ErlNifResourceType* TOKEN;
static ERL_NIF_TERM atom_moat_release;
static ERL_NIF_TERM atom_true;
static ERL_NIF_TERM atom_false;

/* True for the one caller that moves the token from live to released. */
static int take(token* t) {
  int expected = 0;
  return __atomic_compare_exchange_n(&t->released, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

static void token_dtor(ErlNifEnv* caller_env, void* obj) {
  token* t = (token*)obj;
  if (!take(t)) return;
  ErlNifEnv* msg_env = enif_alloc_env();
  if (msg_env == NULL) return;
  ERL_NIF_TERM msg = enif_make_tuple2(msg_env, atom_moat_release, enif_make_uint64(msg_env, t->id));
  /* A dead receiver (its worker restarted) just drops the message. */
  enif_send(caller_env, &t->to, msg_env, msg);
  enif_free_env(msg_env);
}

/* new(Pid, Id) -> Token */
static ERL_NIF_TERM token_new(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  ErlNifPid to;
  ErlNifUInt64 id;
  (void)argc;
  if (!enif_get_local_pid(env, argv[0], &to) || !enif_get_uint64(env, argv[1], &id)) {
    return enif_make_badarg(env);
  }
  token* t = enif_alloc_resource(TOKEN, sizeof(token));
  if (t == NULL) return enif_raise_exception(env, enif_make_atom(env, "enomem"));
  t->to = to;
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
  return take(t) ? atom_true : atom_false;
}

/* released(Token) -> whether release/1 or the destructor has run. */
static ERL_NIF_TERM token_released(ErlNifEnv* env, int argc, const ERL_NIF_TERM argv[]) {
  token* t;
  (void)argc;
  if (!enif_get_resource(env, argv[0], TOKEN, (void**)&t)) return enif_make_badarg(env);
  return __atomic_load_n(&t->released, __ATOMIC_ACQUIRE) ? atom_true : atom_false;
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
  atom_moat_release = enif_make_atom(env, "moat_release");
  atom_true = enif_make_atom(env, "true");
  atom_false = enif_make_atom(env, "false");
  return 0;
}

static int load(ErlNifEnv* env, void** priv, ERL_NIF_TERM info) {
  (void)priv;
  (void)info;
  return open_token_type(env, ERL_NIF_RT_CREATE);
}

/* A reloaded module takes over the tokens that are alive. */
static int upgrade(ErlNifEnv* env, void** priv, void** old_priv, ERL_NIF_TERM info) {
  (void)priv;
  (void)old_priv;
  (void)info;
  return open_token_type(env, ERL_NIF_RT_CREATE | ERL_NIF_RT_TAKEOVER);
}

static ErlNifFunc funcs[] = {
    {"new", 2, token_new, 0},
    {"release", 1, token_release, 0},
    {"released?", 1, token_released, 0},
    {"loaded?", 0, loaded, 0},
};

ERL_NIF_INIT(Elixir.Moat.Finalizer, funcs, load, NULL, upgrade, NULL)

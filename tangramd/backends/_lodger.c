/* The process backend's lodger loop in C (see spawner.py: ``_Helper``, ``lodger=True``).

A lodger is a copy of the fork server that lives in one exec cgroup for good and spawns
each exec's command there. Its loop, in Python, was most of the lodgers' CPU per exec under
a flood (docs/results.md, ``bench/load.py``): most of it the interpreter (frames, dicts, the
selector, the SIGCHLD handler and its wake-up pipe), not the system calls.
``serve`` runs the same loop in C, in the same process, once the lodger has joined its
cgroup: the same protocol (frames of a 4-byte length and a JSON map, the descriptors with
SCM_RIGHTS), the same replies. A request is still decoded by Python's ``json.loads`` (one
C call); everything else is system calls.

Per request (a spawn): pin to the request's cores, set the exec OOM score if it differs
from the one joined at, lay the request's environment over the base one, spawn with
``posix_spawn`` (``setsid``, the three descriptors, SIGPIPE and SIGXFSZ at their defaults,
no signal blocked) or, to switch user, with ``fork`` and ``exec``; answer with the pid, or
(``quick``, and no other command running) with the pid and the exit status if the command
exits within QUICK_EXIT_MS. A child subreaper: orphans are reaped on SIGCHLD (a signalfd),
and an exit report says ``alone`` when no child at all is left.

An isolated environment's lodger (``boxed``: it has entered the environment for good,
``nsbox.enter_for_good``) runs the same loop: it also moves itself into each request's
cpuset cgroup (the ``cgroup_tasks`` descriptor the daemon passes), and since its
commands' orphans go to the environment's keeper, not to it, it never says ``alone``.

``serve`` returns when the daemon closes its end (or on an error the daemon would see as
this lodger's death, for which the fork server's path takes over).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MAX_FDS 4 /* a command's three, and (inside an environment) its cpuset's tasks */
#define MAX_CHILDREN 64
#define MAX_FRAME (64u << 20)

struct child {
    int pidfd;
    pid_t pid;
};

struct lodger {
    int sock;
    int sigfd;
    int joined_score;
    int quick_ms;
    int boxed; /* inside an isolated environment (see serve) */
    PyObject *loads;     /* json.loads */
    PyObject *base_env;  /* dict str -> str */
    struct child children[MAX_CHILDREN];
    int nchildren;
};

/* --- small buffers ----------------------------------------------------------------- */

struct buf {
    char *p;
    size_t n, cap;
};

static int buf_put(struct buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static int buf_str(struct buf *b, const char *s) { return buf_put(b, s, strlen(s)); }

static int buf_fmt(struct buf *b, const char *fmt, long long v) {
    char tmp[64];
    int n = snprintf(tmp, sizeof tmp, fmt, v);
    return buf_put(b, tmp, (size_t)n);
}

/* A JSON string (ASCII out: what is not printable ASCII is escaped as \u00XX). */
static int buf_json_str(struct buf *b, const char *s) {
    if (buf_put(b, "\"", 1)) return -1;
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        char tmp[8];
        if (*c == '"' || *c == '\\') {
            tmp[0] = '\\';
            tmp[1] = (char)*c;
            if (buf_put(b, tmp, 2)) return -1;
        } else if (*c < 0x20 || *c >= 0x7f) {
            snprintf(tmp, sizeof tmp, "\\u%04x", *c);
            if (buf_put(b, tmp, 6)) return -1;
        } else if (buf_put(b, (const char *)c, 1)) {
            return -1;
        }
    }
    return buf_put(b, "\"", 1);
}

/* --- the socket -------------------------------------------------------------------- */

/* Read exactly n bytes, collecting passed descriptors into fds (up to MAX_FDS; any more
   are closed). 1: done, 0: EOF, -1: error. */
static int recv_exact(int sock, char *dst, size_t n, int *fds, int *nfds) {
    size_t got = 0;
    while (got < n) {
        char cbuf[CMSG_SPACE(MAX_FDS * sizeof(int))];
        struct iovec iov = {dst + got, n - got};
        struct msghdr mh = {0};
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof cbuf;
        ssize_t r = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int *in = (int *)CMSG_DATA(c);
            for (size_t i = 0; i < k; i++) {
                if (*nfds < MAX_FDS)
                    fds[(*nfds)++] = in[i];
                else
                    close(in[i]);
            }
        }
        if (r == 0) return 0;
        got += (size_t)r;
    }
    return 1;
}

static int send_all(int sock, const char *p, size_t n) {
    while (n) {
        ssize_t r = send(sock, p, n, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Send one JSON map (body without its header). */
static int send_frame(struct lodger *L, struct buf *body) {
    uint32_t n = (uint32_t)body->n;
    unsigned char head[4] = {(unsigned char)(n >> 24), (unsigned char)(n >> 16),
                             (unsigned char)(n >> 8), (unsigned char)n};
    struct buf out = {0};
    if (buf_put(&out, (const char *)head, 4) || buf_put(&out, body->p, body->n)) {
        free(out.p);
        return -1;
    }
    int r = send_all(L->sock, out.p, out.n);
    free(out.p);
    return r;
}

/* --- children ---------------------------------------------------------------------- */

static int pidfd_open_(pid_t pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }

static int exitcode(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return -WTERMSIG(status);
    return -1;
}

static int tracked(struct lodger *L, pid_t pid) {
    for (int i = 0; i < L->nchildren; i++)
        if (L->children[i].pid == pid) return 1;
    return 0;
}

/* Reap the orphans that have exited (a command's own exit is its pidfd's: the first
   zombie found being one of those, the rest wait for it). 1 when no child at all is left. */
static int reap_orphans(struct lodger *L) {
    for (;;) {
        siginfo_t info;
        memset(&info, 0, sizeof info);
        if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) < 0)
            return errno == ECHILD;
        if (info.si_pid == 0 || tracked(L, info.si_pid)) return 0;
        while (waitpid(info.si_pid, NULL, 0) < 0 && errno == EINTR) {
        }
    }
}

/* An exit report's fields (no braces): the pid and its returncode as Popen gives it. */
static int exit_fields(struct buf *b, pid_t pid, int status) {
    return buf_str(b, "\"exit\": ") || buf_fmt(b, "%lld", pid) || buf_str(b, ", \"rc\": ") ||
           buf_fmt(b, "%lld", exitcode(status));
}

/* Reap child i (its pidfd is readable) and write its exit report's fields into b. */
static int reap_child(struct lodger *L, int i, struct buf *b) {
    struct child c = L->children[i];
    L->children[i] = L->children[--L->nchildren];
    close(c.pidfd);
    int status = 0;
    while (waitpid(c.pid, &status, 0) < 0) {
        if (errno != EINTR) {
            status = 0;
            break;
        }
    }
    if (exit_fields(b, c.pid, status)) return -1;
    if (L->nchildren == 0 && reap_orphans(L) && !L->boxed &&
        buf_str(b, ", \"alone\": true"))
        return -1;
    return 0;
}

static int report_exit(struct lodger *L, int i) {
    struct buf b = {0};
    int r = buf_str(&b, "{") || reap_child(L, i, &b) || buf_str(&b, "}") ? -1
                                                                           : send_frame(L, &b);
    free(b.p);
    return r;
}

/* --- a spawn request --------------------------------------------------------------- */

struct strv {
    char **v;
    PyObject **keep; /* the bytes objects the strings point into */
    Py_ssize_t n;
};

static void strv_free(struct strv *s) {
    if (s->keep)
        for (Py_ssize_t i = 0; i < s->n; i++) Py_XDECREF(s->keep[i]);
    free(s->keep);
    free(s->v);
    s->v = NULL;
    s->keep = NULL;
    s->n = 0;
}

/* A str as file-system bytes (surrogateescape, as os.fsencode); new reference. */
static PyObject *fsbytes(PyObject *s) {
    if (!PyUnicode_Check(s)) {
        PyErr_SetString(PyExc_TypeError, "expected str");
        return NULL;
    }
    PyObject *b = PyUnicode_EncodeFSDefault(s);
    if (b && strlen(PyBytes_AS_STRING(b)) != (size_t)PyBytes_GET_SIZE(b)) {
        Py_DECREF(b);
        PyErr_SetString(PyExc_ValueError, "embedded null byte");
        return NULL;
    }
    return b;
}

static int strv_from_list(struct strv *s, PyObject *list) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) == 0) {
        PyErr_SetString(PyExc_ValueError, "argv: expected a non-empty list");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    s->v = calloc((size_t)n + 1, sizeof(char *));
    s->keep = calloc((size_t)n, sizeof(PyObject *));
    if (!s->v || !s->keep) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = fsbytes(PyList_GET_ITEM(list, i));
        if (!b) return -1;
        s->keep[s->n++] = b;
        s->v[i] = PyBytes_AS_STRING(b);
    }
    return 0;
}

/* KEY=VALUE entries: the base environment's, each overridden by the request's. */
static int strv_env(struct strv *s, PyObject *base, PyObject *over) {
    PyObject *env = PyDict_Copy(base);
    if (!env) return -1;
    if (over && PyDict_Check(over) && PyDict_Update(env, over) < 0) {
        Py_DECREF(env);
        return -1;
    }
    Py_ssize_t n = PyDict_GET_SIZE(env);
    s->v = calloc((size_t)n + 1, sizeof(char *));
    s->keep = calloc((size_t)n + 1, sizeof(PyObject *));
    if (!s->v || !s->keep) {
        Py_DECREF(env);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(env, &pos, &k, &v)) {
        PyObject *kb = fsbytes(k), *vb = kb ? fsbytes(v) : NULL;
        if (!vb) {
            Py_XDECREF(kb);
            Py_DECREF(env);
            return -1;
        }
        PyObject *kv = PyBytes_FromFormat("%s=%s", PyBytes_AS_STRING(kb), PyBytes_AS_STRING(vb));
        Py_DECREF(kb);
        Py_DECREF(vb);
        if (!kv) {
            Py_DECREF(env);
            return -1;
        }
        s->keep[s->n++] = kv;
        s->v[i++] = PyBytes_AS_STRING(kv);
    }
    Py_DECREF(env);
    return 0;
}

static const char *env_get(char **envp, const char *key) {
    size_t k = strlen(key);
    for (; *envp; envp++)
        if (strncmp(*envp, key, k) == 0 && (*envp)[k] == '=') return *envp + k + 1;
    return NULL;
}

static long dict_int(PyObject *d, const char *key, long dflt) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v || !PyLong_Check(v)) return dflt;
    long r = PyLong_AsLong(v);
    if (r == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return dflt;
    }
    return r;
}

static int write_score(int score) {
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%d", score);
    int r = write(fd, tmp, (size_t)n) == n ? 0 : -1;
    close(fd);
    return r;
}

/* Spawn as another user: fork, then in the child setsid, the descriptors, cwd, umask,
   groups dropped, gid and uid, default signals, exec. An exec failure's errno comes back
   through a close-on-exec pipe. The child runs no Python: async-signal-safe calls only. */
static pid_t fork_exec(char **argv, char **envp, const char *path, int in_fd, int out_fd,
                       int err_fd, const char *cwd, mode_t mask, uid_t uid, gid_t gid,
                       int *err) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
        *err = errno;
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        *err = errno;
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGXFSZ, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        sigprocmask(SIG_SETMASK, &none, NULL);
        int e = 0;
        if (setsid() < 0) e = errno;
        if (!e && in_fd < 0) {
            int fd = open("/dev/null", O_RDONLY);
            if (fd < 0 || (fd != 0 && dup2(fd, 0) < 0)) e = errno;
        } else if (!e && dup2(in_fd, 0) < 0) {
            e = errno;
        }
        if (!e && (dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0)) e = errno;
        if (!e && chdir(cwd) < 0) e = errno;
        umask(mask);
        if (!e && (setgroups(0, NULL) < 0 || setregid(gid, gid) < 0 || setreuid(uid, uid) < 0))
            e = errno;
        if (!e) {
            if (strchr(argv[0], '/')) {
                execve(argv[0], argv, envp);
                e = errno;
            } else {
                /* the PATH lookup of execvpe, in the child's PATH */
                const char *dirs = path ? path : "/bin:/usr/bin";
                char full[4096];
                e = ENOENT;
                while (*dirs) {
                    const char *end = strchr(dirs, ':');
                    size_t len = end ? (size_t)(end - dirs) : strlen(dirs);
                    int n = snprintf(full, sizeof full, "%.*s/%s", (int)len, len ? dirs : ".",
                                     argv[0]);
                    if (n > 0 && (size_t)n < sizeof full) {
                        execve(full, argv, envp);
                        if (errno != ENOENT && errno != ENOTDIR) e = errno;
                    }
                    dirs = end ? end + 1 : dirs + len;
                }
            }
        }
        ssize_t w = write(p[1], &e, sizeof e);
        (void)w;
        _exit(127);
    }
    close(p[1]);
    int e = 0;
    ssize_t r;
    do {
        r = read(p[0], &e, sizeof e);
    } while (r < 0 && errno == EINTR);
    close(p[0]);
    if (r == (ssize_t)sizeof e) {
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
        }
        *err = e;
        return -1;
    }
    return pid;
}

/* An error reply; ``stage`` (or NULL): what failed, when not the command's fault. */
static int stage_reply(struct buf *b, long long rid, int err, const char *text,
                       const char *stage) {
    b->n = 0;
    if (buf_str(b, "{\"id\": ") || buf_fmt(b, "%lld", rid)) return -1;
    if (err && (buf_str(b, ", \"errno\": ") || buf_fmt(b, "%lld", err))) return -1;
    if (stage && (buf_str(b, ", \"stage\": ") || buf_json_str(b, stage))) return -1;
    return buf_str(b, ", \"error\": ") || buf_json_str(b, text) || buf_str(b, "}");
}

static int error_reply(struct buf *b, long long rid, int err, const char *text) {
    return stage_reply(b, rid, err, text, NULL);
}

/* One spawn request: the reply (a JSON map) into b. -1 only when b cannot be written. */
static int spawn(struct lodger *L, PyObject *msg, int *fds, int nfds, struct buf *b) {
    long long rid = dict_int(msg, "id", 0);
    char text[4600];
    PyObject *names = PyDict_GetItemString(msg, "fds");
    if (!names || !PyList_Check(names) || PyList_GET_SIZE(names) != nfds)
        return error_reply(b, rid, 0, "descriptors lost in transit");
    int in_fd = -1, out_fd = -1, err_fd = -1, tasks_fd = -1;
    for (int i = 0; i < nfds; i++) {
        const char *name = PyUnicode_Check(PyList_GET_ITEM(names, i))
                               ? PyUnicode_AsUTF8(PyList_GET_ITEM(names, i))
                               : NULL;
        if (!name) {
            PyErr_Clear();
            continue;
        }
        if (!strcmp(name, "stdin")) in_fd = fds[i];
        if (!strcmp(name, "stdout")) out_fd = fds[i];
        if (!strcmp(name, "stderr")) err_fd = fds[i];
        if (!strcmp(name, "cgroup_tasks")) tasks_fd = fds[i];
    }
    if (out_fd < 0 || err_fd < 0) return error_reply(b, rid, 0, "descriptors lost in transit");

    /* the cores (a lodger's cgroup is one set of cores; pinned again, as the fork server) */
    PyObject *cores = PyDict_GetItemString(msg, "cores");
    cpu_set_t set;
    CPU_ZERO(&set);
    struct buf shown = {0};
    buf_str(&shown, "[");
    if (cores && PyList_Check(cores)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cores); i++) {
            long c = PyLong_AsLong(PyList_GET_ITEM(cores, i));
            if (c < 0 || c >= CPU_SETSIZE) {
                PyErr_Clear();
                continue;
            }
            CPU_SET((int)c, &set);
            buf_fmt(&shown, i ? ", %lld" : "%lld", c);
        }
    }
    buf_str(&shown, "]");
    /* (an environment's lodger serves all its core sets) into this exec's cpuset cgroup:
       the daemon opened its tasks file, so root outside may move us; moving oneself, one
       thread, waits for no RCU grace period */
    if ((tasks_fd >= 0 && write(tasks_fd, "0", 1) != 1) ||
        sched_setaffinity(0, sizeof set, &set) < 0) {
        snprintf(text, sizeof text, "cannot pin the command to cores %s: [Errno %d] %s",
                 shown.p ? shown.p : "[]", errno, strerror(errno));
        free(shown.p);
        return error_reply(b, rid, 0, text);
    }
    free(shown.p);
    int score = (int)dict_int(msg, "oom_score_adj", L->joined_score);
    if (score != L->joined_score && write_score(score) < 0) {
        snprintf(text, sizeof text, "[Errno %d] %s: '/proc/self/oom_score_adj'", errno,
                 strerror(errno));
        return error_reply(b, rid, errno, text);
    }

    struct strv argv = {0}, envp = {0};
    PyObject *cwd_b = NULL;
    int ret;
    PyObject *cwd = PyDict_GetItemString(msg, "cwd");
    if (strv_from_list(&argv, PyDict_GetItemString(msg, "argv")) < 0 ||
        strv_env(&envp, L->base_env, PyDict_GetItemString(msg, "env")) < 0 || !cwd ||
        !(cwd_b = fsbytes(cwd))) {
        PyErr_Clear();
        ret = error_reply(b, rid, 0, "malformed spawn request");
        goto out;
    }
    const char *cwd_s = PyBytes_AS_STRING(cwd_b);
    mode_t mask = (mode_t)dict_int(msg, "umask", 077);
    const char *path = env_get(envp.v, "PATH");
    PyObject *user = PyDict_GetItemString(msg, "user");
    pid_t pid;
    if (user && user != Py_None) {
        long uid = -1, gid = -1;
        if (PyList_Check(user) && PyList_GET_SIZE(user) == 2) {
            uid = PyLong_AsLong(PyList_GET_ITEM(user, 0));
            gid = PyLong_AsLong(PyList_GET_ITEM(user, 1));
        }
        if (uid < 0 || gid < 0) {
            PyErr_Clear();
            ret = error_reply(b, rid, 0, "malformed spawn request: user");
            goto out;
        }
        int err = 0;
        pid = fork_exec(argv.v, envp.v, path, in_fd, out_fd, err_fd, cwd_s, mask, (uid_t)uid,
                        (gid_t)gid, &err);
        if (pid < 0) {
            snprintf(text, sizeof text, "[Errno %d] %s: '%s'", err, strerror(err), argv.v[0]);
            ret = error_reply(b, rid, err, text);
            goto out;
        }
    } else {
        if (chdir(cwd_s) < 0) {
            int err = errno;
            snprintf(text, sizeof text, "cwd %.4000s: %s", cwd_s, strerror(err));
            ret = stage_reply(b, rid, err, text, "cwd"); /* not the command's fault */
            goto out;
        }
        posix_spawn_file_actions_t fa;
        posix_spawnattr_t at;
        posix_spawn_file_actions_init(&fa);
        posix_spawnattr_init(&at);
        if (in_fd >= 0)
            posix_spawn_file_actions_adddup2(&fa, in_fd, 0);
        else
            posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
        posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
        posix_spawn_file_actions_adddup2(&fa, err_fd, 2);
        sigset_t none, dfl;
        sigemptyset(&none);
        sigemptyset(&dfl);
        sigaddset(&dfl, SIGPIPE);
        sigaddset(&dfl, SIGXFSZ);
        sigaddset(&dfl, SIGCHLD);
        posix_spawnattr_setsigmask(&at, &none);
        posix_spawnattr_setsigdefault(&at, &dfl);
        posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK |
                                          POSIX_SPAWN_SETSIGDEF);
        int use_path = strchr(argv.v[0], '/') == NULL;
        if (use_path) {
            /* posix_spawnp looks a bare name up in the caller's PATH: lend it the
               child's (this process is single-threaded) */
            const char *mine = getenv("PATH");
            if (path && (!mine || strcmp(mine, path)))
                setenv("PATH", path, 1);
            else if (!path && mine)
                unsetenv("PATH");
        }
        mode_t old = umask(mask);
        int err = use_path ? posix_spawnp(&pid, argv.v[0], &fa, &at, argv.v, envp.v)
                           : posix_spawn(&pid, argv.v[0], &fa, &at, argv.v, envp.v);
        umask(old);
        if (chdir("/") < 0) {
            /* "/" is always there */
        }
        posix_spawn_file_actions_destroy(&fa);
        posix_spawnattr_destroy(&at);
        if (err) {
            snprintf(text, sizeof text, "[Errno %d] %s: '%s'", err, strerror(err), argv.v[0]);
            ret = error_reply(b, rid, err, text);
            goto out;
        }
    }
    b->n = 0;
    ret = buf_str(b, "{\"id\": ") || buf_fmt(b, "%lld", rid) || buf_str(b, ", \"pid\": ") ||
          buf_fmt(b, "%lld", pid);
    if (ret) goto out;
    int pidfd = pidfd_open_(pid);
    if (pidfd < 0 || L->nchildren >= MAX_CHILDREN) {
        /* no pidfd (the lodger checked it has them before taking this loop) or too many:
           wait for it here, as the command's whole run */
        if (pidfd >= 0) close(pidfd);
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        ret = buf_str(b, ", ") || exit_fields(b, pid, status) || buf_str(b, "}");
        goto out;
    }
    L->children[L->nchildren++] = (struct child){pidfd, pid};
    PyObject *quick = PyDict_GetItemString(msg, "quick");
    if (quick && PyObject_IsTrue(quick) == 1 && L->nchildren == 1) {
        struct pollfd p = {pidfd, POLLIN, 0};
        int r;
        do {
            r = poll(&p, 1, L->quick_ms);
        } while (r < 0 && errno == EINTR);
        if (r > 0 && (ret = buf_str(b, ", ") || reap_child(L, L->nchildren - 1, b))) goto out;
    }
    ret = buf_str(b, "}");
out:
    PyErr_Clear();
    strv_free(&argv);
    strv_free(&envp);
    Py_XDECREF(cwd_b);
    return ret;
}

/* One frame from the daemon. 1: go on, 0: EOF, -1: error (the lodger then exits). */
static int request(struct lodger *L) {
    int fds[MAX_FDS], nfds = 0, ret = 1;
    unsigned char head[4];
    char *body = NULL;
    int r = recv_exact(L->sock, (char *)head, 4, fds, &nfds);
    if (r <= 0) {
        ret = r;
        goto out;
    }
    uint32_t n = ((uint32_t)head[0] << 24) | ((uint32_t)head[1] << 16) |
                 ((uint32_t)head[2] << 8) | head[3];
    if (n > MAX_FRAME || !(body = malloc(n ? n : 1))) {
        ret = -1;
        goto out;
    }
    r = recv_exact(L->sock, body, n, fds, &nfds);
    if (r <= 0) {
        ret = r;
        goto out;
    }
    PyObject *raw = PyBytes_FromStringAndSize(body, n);
    PyObject *msg = raw ? PyObject_CallOneArg(L->loads, raw) : NULL;
    Py_XDECREF(raw);
    if (!msg || !PyDict_Check(msg)) {
        Py_XDECREF(msg);
        PyErr_Clear();
        ret = -1;
        goto out;
    }
    PyObject *op = PyDict_GetItemString(msg, "op");
    const char *ops = op && PyUnicode_Check(op) ? PyUnicode_AsUTF8(op) : NULL;
    if (ops && !strcmp(ops, "base_env")) {
        PyObject *env = PyDict_GetItemString(msg, "env");
        if (env && PyDict_Check(env)) {
            Py_INCREF(env);
            Py_SETREF(L->base_env, env);
        }
    } else if (ops && (!strcmp(ops, "join") || !strcmp(ops, "lodger"))) {
        /* joined already; a lodger has no lodgers */
        struct buf b = {0};
        long long rid = dict_int(msg, "id", 0);
        if (!strcmp(ops, "join"))
            r = buf_str(&b, "{\"id\": ") || buf_fmt(&b, "%lld", rid) ||
                buf_str(&b, ", \"joined\": ") || buf_fmt(&b, "%lld", getpid()) || buf_str(&b, "}");
        else
            r = error_reply(&b, rid, 0, "a lodger forks no lodgers");
        if (r || send_frame(L, &b) < 0) ret = -1;
        free(b.p);
    } else {
        struct buf b = {0};
        if (spawn(L, msg, fds, nfds, &b) < 0 || send_frame(L, &b) < 0) ret = -1;
        free(b.p);
    }
    Py_DECREF(msg);
    PyErr_Clear();
out:
    for (int i = 0; i < nfds; i++) close(fds[i]);
    free(body);
    return ret;
}

static PyObject *serve(PyObject *self, PyObject *args) {
    (void)self;
    struct lodger L;
    memset(&L, 0, sizeof L);
    PyObject *base_env;
    double quick_s;
    if (!PyArg_ParseTuple(args, "iO!id|p", &L.sock, &PyDict_Type, &base_env, &L.joined_score,
                          &quick_s, &L.boxed))
        return NULL;
    L.quick_ms = (int)(quick_s * 1000 + 0.5);
    PyObject *json = PyImport_ImportModule("json");
    if (!json) return NULL;
    L.loads = PyObject_GetAttrString(json, "loads");
    Py_DECREF(json);
    if (!L.loads) return NULL;
    Py_INCREF(base_env);
    L.base_env = base_env;

    /* SIGCHLD through a signalfd (blocked; the command gets it unblocked and default) */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    L.sigfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);

    struct pollfd pfd[MAX_CHILDREN + 2];
    int result = 0;
    for (;;) {
        int n = 0;
        pfd[n++] = (struct pollfd){L.sock, POLLIN, 0};
        if (L.sigfd >= 0) pfd[n++] = (struct pollfd){L.sigfd, POLLIN, 0};
        int first_child = n;
        for (int i = 0; i < L.nchildren; i++)
            pfd[n++] = (struct pollfd){L.children[i].pidfd, POLLIN, 0};
        int r = poll(pfd, (nfds_t)n, -1);
        if (r < 0) {
            if (errno == EINTR) continue;
            result = -1;
            break;
        }
        /* exits first: a report leaves before the next request's reply */
        int done = 0;
        for (int i = n - 1; i >= first_child; i--) {
            if (!pfd[i].revents) continue;
            int fd = pfd[i].fd;
            for (int k = 0; k < L.nchildren; k++) {
                if (L.children[k].pidfd == fd) {
                    if (report_exit(&L, k) < 0) done = 1;
                    break;
                }
            }
        }
        if (done) break;
        if (L.sigfd >= 0 && pfd[1].revents) {
            struct signalfd_siginfo si;
            while (read(L.sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
            }
            reap_orphans(&L);
        }
        if (pfd[0].revents) {
            r = request(&L);
            if (r <= 0) {
                result = r;
                break;
            }
        }
    }
    for (int i = 0; i < L.nchildren; i++) close(L.children[i].pidfd);
    if (L.sigfd >= 0) close(L.sigfd);
    Py_DECREF(L.loads);
    Py_DECREF(L.base_env);
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS,
     "serve(sock_fd, base_env, joined_score, quick_exit_s, boxed=False) -> int: run a "
     "joined lodger's loop until the daemon closes its end (0) or an error (-1); boxed: "
     "it has entered an isolated environment for good."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lodger", "The process backend's lodger loop in C.", -1, methods,
    NULL,                  NULL,      NULL,                                      NULL};

PyMODINIT_FUNC PyInit__lodger(void) { return PyModule_Create(&module); }

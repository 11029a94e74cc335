/* LD_PRELOAD fence for the local test Slurm (scripts/slurm_up.sh): every IPv4 bind goes to 127.0.0.1 and
 * every IPv6 bind to ::1, whatever address the caller asked for (Slurm 22.05 binds INADDR_ANY and has no
 * bind-address option). A socket that listens before binding is bound to loopback first (the kernel would
 * otherwise pick the wildcard address). Build: gcc -shared -fPIC -O2 -o libpf_loopback_bind.so THIS -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*listen_fn)(int, int);

static int real_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn next;
    if (!next) next = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (!next) { errno = ENOSYS; return -1; }
    return next(fd, addr, len);
}

static int is_loopback4(const struct in_addr *a) { return (ntohl(a->s_addr) >> 24) == 127; }

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (!is_loopback4(&a.sin_addr)) a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
    if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_V4MAPPED(&a.sin6_addr)) {
            struct in_addr v4;
            memcpy(&v4, &a.sin6_addr.s6_addr[12], sizeof v4);
            if (!is_loopback4(&v4)) {
                v4.s_addr = htonl(INADDR_LOOPBACK);
                memcpy(&a.sin6_addr.s6_addr[12], &v4, sizeof v4);
            }
        } else if (!IN6_IS_ADDR_LOOPBACK(&a.sin6_addr)) {
            a.sin6_addr = in6addr_loopback;
            a.sin6_scope_id = 0;
        }
        return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
    return real_bind(fd, addr, len);
}

int listen(int fd, int backlog) {
    static listen_fn next;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (!next) next = (listen_fn)dlsym(RTLD_NEXT, "listen");
    if (!next) { errno = ENOSYS; return -1; }
    memset(&ss, 0, sizeof ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &len) == 0) {
        if (ss.ss_family == AF_INET && ((struct sockaddr_in *)&ss)->sin_port == 0) {
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            if (real_bind(fd, (const struct sockaddr *)&a, sizeof a) != 0) return -1;
        } else if (ss.ss_family == AF_INET6 && ((struct sockaddr_in6 *)&ss)->sin6_port == 0) {
            struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = 0};
            a.sin6_addr = in6addr_loopback;
            if (real_bind(fd, (const struct sockaddr *)&a, sizeof a) != 0) return -1;
        }
    }
    return next(fd, backlog);
}

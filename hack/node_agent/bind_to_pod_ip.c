/*
 * LD_PRELOAD shim of the node agent: gives a pod's processes the "own network namespace"
 * behaviour they rely on for wildcard listens. Pods run as local processes sharing one
 * network stack; each has its own loopback address (env SHARDLINE_POD_IP). A bind() to the
 * IPv4 wildcard 0.0.0.0 is rewritten to the pod IP, and one to the IPv6 wildcard :: to the
 * v4-mapped pod IP, so two pods can both listen on, e.g., port 29500 (torch's TCPStore binds
 * the wildcard address). Binds to specific addresses, and every other call, are untouched.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *ip = getenv("SHARDLINE_POD_IP");
    struct in_addr pod;
    if (!ip || !addr || inet_pton(AF_INET, ip, &pod) != 1) return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr = pod;
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (memcmp(&a.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0) {
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &pod, 4);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}

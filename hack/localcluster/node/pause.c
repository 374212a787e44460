/* The pod sandbox's init process ("pause"): holds the pod's namespaces, reaps orphans, and
 * exits on SIGINT/SIGTERM. Written for the local node, whose containerd cannot pull
 * registry.k8s.io/pause; behaviour as Kubernetes' build/pause/linux/pause.c. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { _exit(sig == SIGTERM ? 0 : 128 + sig); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction term = {.sa_handler = on_term};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (getpid() != 1) return 1;
  sigaction(SIGINT, &term, NULL);
  sigaction(SIGTERM, &term, NULL);
  sigaction(SIGCHLD, &child, NULL);
  for (;;) pause();
}

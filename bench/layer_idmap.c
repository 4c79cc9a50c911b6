// Micro-benchmark behind docs/templates.md ("Layers: stored once, stacked per sandbox"):
// the cost of N idmapped lower layers (open_tree clone + mount_setattr idmap + move_mount)
// plus one overlay mount over them. Build: gcc -O2 -o /tmp/layer_idmap bench/layer_idmap.c
// Run as root: unshare -m --propagation private /tmp/layer_idmap DIR N ITER (DIR holds l0..lN-1).
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/mount.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }

int main(int argc, char **argv) {
  if (argc < 4) { fprintf(stderr, "usage: %s LAYERDIR N ITER\n", argv[0]); return 2; }
  const char *dir = argv[1]; int n = atoi(argv[2]); int iter = atoi(argv[3]);
  int pipefd[2]; pipe(pipefd);
  pid_t child = fork();
  if (child == 0) { unshare(CLONE_NEWUSER); char c; read(pipefd[0], &c, 1); pause(); _exit(0); }
  usleep(50000);
  char p[256]; snprintf(p, sizeof p, "/proc/%d/uid_map", child);
  int f = open(p, O_WRONLY); write(f, "0 300000 65536\n", 15); close(f);
  snprintf(p, sizeof p, "/proc/%d/gid_map", child);
  f = open(p, O_WRONLY); write(f, "0 300000 65536\n", 15); close(f);
  snprintf(p, sizeof p, "/proc/%d/ns/user", child);
  int userns = open(p, O_RDONLY);
  double total_idmap = 0, total_ovl = 0, total_umount = 0;
  char *lowers = malloc(65536);
  mkdir("/tmp/lb", 0755);
  for (int it = 0; it < iter; it++) {
    double t0 = now();
    lowers[0] = 0;
    for (int i = 0; i < n; i++) {
      char src[512], dst[512];
      snprintf(src, sizeof src, "%s/l%d", dir, i);
      int fd = syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
      if (fd < 0) { perror("open_tree"); return 1; }
      struct mount_attr a = { .attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV, .userns_fd = userns };
      if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &a, sizeof a) < 0) { perror("mount_setattr"); return 1; }
      snprintf(dst, sizeof dst, "/tmp/lb/m%d", i); mkdir(dst, 0755);
      if (syscall(SYS_move_mount, fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) < 0) { perror("move_mount"); return 1; }
      close(fd);
      if (i) strcat(lowers, ":");
      strcat(lowers, dst);
    }
    double t1 = now();
    char data[70000];
    mkdir("/tmp/lb/up", 0755); mkdir("/tmp/lb/wk", 0755); mkdir("/tmp/lb/root", 0755);
    snprintf(data, sizeof data, "lowerdir=%s,upperdir=/tmp/lb/up,workdir=/tmp/lb/wk", lowers);
    if (n == 1) snprintf(data, sizeof data, "lowerdir=%s,upperdir=/tmp/lb/up,workdir=/tmp/lb/wk", lowers);
    if (mount("overlay", "/tmp/lb/root", "overlay", 0, data) < 0) { perror("overlay"); return 1; }
    double t2 = now();
    // touch something that lives in the lowest layer (lookup through all layers)
    struct stat st; char q[64]; snprintf(q, sizeof q, "/tmp/lb/root/f0"); stat(q, &st);
    umount2("/tmp/lb/root", MNT_DETACH);
    for (int i = 0; i < n; i++) { char dst[64]; snprintf(dst, sizeof dst, "/tmp/lb/m%d", i); umount2(dst, MNT_DETACH); }
    double t3 = now();
    if (it > 0) { total_idmap += t1 - t0; total_ovl += t2 - t1; total_umount += t3 - t2; }
  }
  int k = iter - 1;
  printf("layers=%d idmap+move %.3f ms, overlay mount %.3f ms, teardown %.3f ms (mean of %d)\n", n, total_idmap / k, total_ovl / k, total_umount / k, k);
  kill(child, SIGKILL); waitpid(child, 0, 0);
  return 0;
}

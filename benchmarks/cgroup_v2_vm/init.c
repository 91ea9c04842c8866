/* The VM's first init (benchmarks/cgroup_v2_vm.py): load the 9p and virtio modules listed in /modules.order, mount
 * the host's root (shared read-only over virtio-9p, tag "root") and hand over to the `init=` of the kernel command
 * line on it, with the environment the kernel gave (the runner's settings). Why C: the Debian initrd has no 9p, and
 * a static binary needs no busybox. Any failure powers the VM off, after saying what failed on the console. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static void die(const char *what) {
  perror(what);
  sync();
  reboot(RB_POWER_OFF);
  _exit(1);
}

static void load_modules(void) {
  char line[512];
  FILE *order = fopen("/modules.order", "r");
  if (!order) die("/modules.order");
  while (fgets(line, sizeof line, order)) {
    line[strcspn(line, "\n")] = 0;
    int fd = open(line, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || syscall(SYS_finit_module, fd, "", 0)) perror(line);
    if (fd >= 0) close(fd);
  }
  fclose(order);
}

static void next_init(char *init, size_t size) {
  char cmdline[4096] = " ";
  FILE *f = fopen("/proc/cmdline", "r");
  if (!f || !fgets(cmdline + 1, sizeof cmdline - 1, f)) die("/proc/cmdline");
  fclose(f);
  char *at = strstr(cmdline, " init=");
  if (!at) die("no init= on the kernel command line");
  snprintf(init, size, "%.*s", (int)strcspn(at + 6, " \n"), at + 6);
}

int main(void) {
  char init[512];
  mkdir("/proc", 0755);
  mkdir("/newroot", 0755);
  if (mount("proc", "/proc", "proc", 0, NULL)) die("mount /proc");
  load_modules();
  next_init(init, sizeof init);
  int failed = -1;
  for (int i = 0; i < 50 && failed; i++) { /* the virtio device may still be probing */
    failed = mount("root", "/newroot", "9p", MS_RDONLY, "trans=virtio,version=9p2000.L,msize=262144,cache=loose");
    if (failed) usleep(100000);
  }
  if (failed) die("mount the 9p root");
  umount("/proc");
  if (chdir("/newroot") || mount(".", "/", NULL, MS_MOVE, NULL) || chroot(".") || chdir("/")) die("switch root");
  execl(init, init, (char *)NULL);
  die(init);
}

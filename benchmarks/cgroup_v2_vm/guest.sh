#!/bin/bash
# The VM's second init (benchmarks/cgroup_v2_vm.py), on the host's root shared read-only: the kernel's own file
# systems, a writable /tmp, a cgroup v2 at /sys/fs/cgroup with memory and pids handed down from the root cgroup,
# then pytest twice, each alone in a child cgroup (as a trainer in a systemd scope or a container is: never the root
# cgroup): as root in /ci, and as uid 65534 in /delegated, a cgroup handed to that user as systemd's Delegate=yes
# does (the laptop case: its interface files chowned). Each exit status goes on the console as
# CGROUP2VM-PYTEST-RC=<n>, then the VM powers off. Settings come from the kernel command line as environment:
# CGVM_REPO (the checkout), CGVM_PYTHON (root's interpreter), CGVM_ARGS (pytest's arguments, comma-separated).
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t devtmpfs dev /dev
mount -t tmpfs -o mode=1777 tmp /tmp
mkdir -p /dev/shm /dev/pts && mount -t tmpfs shm /dev/shm && mount -t devpts devpts /dev/pts
echo "+memory +pids" > /sys/fs/cgroup/cgroup.subtree_control
export HOME=/tmp PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin LANG=C.UTF-8 \
  PYTHONDONTWRITEBYTECODE=1
echo "CGROUP2VM-KERNEL=$(uname -r) cgroup2 controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
cd "$CGVM_REPO" || exit 1
read -ra ARGS <<< "${CGVM_ARGS//,/ }"
PYTEST=(-m pytest -p no:cacheprovider --noconftest --color=no -rs "${ARGS[@]}")

in_cgroup() {  # in_cgroup <cgroup> <argv...>: exec argv alone in that cgroup
  mkdir -p "/sys/fs/cgroup/$1"
  bash -c 'echo $$ > "$0" && exec "$@"' "/sys/fs/cgroup/$1/cgroup.procs" "${@:2}"
}

echo "CGROUP2VM-RUN as root in /ci"
in_cgroup ci "$CGVM_PYTHON" "${PYTEST[@]}"
echo "CGROUP2VM-PYTEST-RC=$?"

# the laptop case: the venv's interpreter may sit under root's 0700 home, so the system python3 of the same
# version runs with the venv's site-packages on the path (as tests/sandbox_helpers.run_unprivileged does)
SITE=$("$CGVM_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir /sys/fs/cgroup/delegated
chown 65534:65534 /sys/fs/cgroup/delegated /sys/fs/cgroup/delegated/{cgroup.procs,cgroup.subtree_control,cgroup.threads}
echo "CGROUP2VM-RUN as uid 65534 in /delegated"
in_cgroup delegated setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all \
  env PYTHONPATH="$CGVM_REPO:$SITE" /usr/bin/python3 "${PYTEST[@]}"
echo "CGROUP2VM-PYTEST-RC=$?"
sync
echo o > /proc/sysrq-trigger
sleep 60

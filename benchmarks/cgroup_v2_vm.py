"""Run the per-sandbox cgroup v2 tests on a real cgroup v2 kernel, in a VM, from a host that has none.

    python benchmarks/cgroup_v2_vm.py                                    # tests/test_sandbox_cgroup_real.py -v
    python benchmarks/cgroup_v2_vm.py -- tests/test_sandbox_cgroup.py -k sweep     # any pytest arguments after --

Why: sandbox/cgroup.py only does something where the trainer's own cgroup is a cgroup v2 with the memory
controller. A host that binds memory and cpu to cgroup v1 (this repo's CI host) skips those tests, and its cgroup
mounts are not ours to change. So this boots an installed Debian kernel under QEMU with cgroup v1 off
(`cgroup_no_v1=all`), the host's own root shared read-only over virtio-9p (same checkout, same venv, same bwrap),
and runs pytest there twice, each alone in a child cgroup of the VM's root cgroup: as root, and as uid 65534 in a
cgroup delegated to it as systemd's Delegate=yes does (the laptop case). The VM's init is
benchmarks/cgroup_v2_vm/guest.sh; its first init, which mounts the 9p root, is a static binary built from init.c.
It prints the console (pytest's reports included) and exits with the worse of the two pytest statuses (2 where
the VM did not report both).

Needs (installs nothing itself): Debian/Ubuntu packages `qemu-system-x86` and `linux-image-amd64` (a kernel with
its modules under /lib/modules), and `gcc` + `libc6-dev` for the static init. KVM is used where /proc/cpuinfo shows
vmx or svm and /dev/kvm opens; elsewhere TCG (emulation: ~15 s to boot, the tests several times slower than
native). Root is needed to read /boot's kernel on Debian and to share / over 9p with every file readable.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent / "cgroup_v2_vm"
MODULES = ("virtio_pci", "9pnet_virtio", "9p")  # what mounting the root over virtio-9p needs, their deps first
RESULT = re.compile(r"CGROUP2VM-PYTEST-RC=(\d+)")
DEFAULT_TESTS = ("tests/test_sandbox_cgroup_real.py", "-v")


def newest_kernel() -> tuple[Path, str]:
    """The newest /boot/vmlinuz-<version> with its modules installed: (image, version)."""
    found = [(p, p.name[len("vmlinuz-"):]) for p in Path("/boot").glob("vmlinuz-*")]
    found = [(p, v) for p, v in found if Path("/lib/modules", v, "modules.dep").exists()]
    if not found:
        sys.exit("no /boot/vmlinuz-* with modules under /lib/modules: apt-get install linux-image-amd64")
    return max(found, key=lambda pv: [int(x) if x.isdigit() else 0 for x in re.split(r"[.-]", pv[1])])


def module_files(version: str) -> list[Path]:
    """The .ko files of MODULES and everything they depend on, each after its dependencies (modinfo's order)."""
    ordered: list[Path] = []

    def add(name: str) -> None:
        info = {k: subprocess.run(["modinfo", "-k", version, *flag, name], capture_output=True, text=True,
                                  check=True).stdout.strip() for k, flag in (("path", ["-n"]),
                                                                            ("deps", ["-F", "depends"]))}
        for dep in filter(None, info["deps"].split(",")):
            add(dep)
        path = Path(info["path"])
        if path.suffix == ".ko" and path not in ordered:  # builtin modules have no file
            ordered.append(path)

    for name in MODULES:
        add(name)
    return ordered


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive (the initramfs format) of (name, mode, data) entries, with the trailer."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        raw = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0]
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + raw
        out += b"\0" * (-len(out) % 4)  # the header and name, then the data, each padded to 4 bytes
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def build_initramfs(version: str, workdir: Path) -> Path:
    """init (static, from init.c) + the modules + /modules.order, as an uncompressed newc archive."""
    init = workdir / "init"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(init), str(HERE / "init.c")], check=True)
    modules = module_files(version)
    entries = [("init", 0o100755, init.read_bytes()), ("lib", 0o040755, b"")]
    entries += [(f"lib/{m.name}", 0o100644, m.read_bytes()) for m in modules]
    entries.append(("modules.order", 0o100644, "".join(f"/lib/{m.name}\n" for m in modules).encode()))
    out = workdir / "initramfs.cpio"
    out.write_bytes(cpio_newc(entries))
    return out


def accelerator() -> list[str]:
    """KVM where the CPU advertises vmx/svm and /dev/kvm opens (a KVM device without them hung at boot here, a
    nested guest without the flags), else TCG."""
    flags = Path("/proc/cpuinfo").read_text()
    if re.search(r"\b(vmx|svm)\b", flags) and os.access("/dev/kvm", os.R_OK | os.W_OK):
        return ["-accel", "kvm", "-cpu", "host"]
    return ["-accel", "tcg", "-cpu", "max"]


def qemu_argv(kernel: Path, initramfs: Path, python: str, pytest_args: list[str], cpus: int) -> list[str]:
    """The VM: 3 GiB, `cpus` CPUs, serial console on stdout, the host's / read-only over 9p, no reboot."""
    if any("," in a or " " in a for a in pytest_args):
        sys.exit("pytest arguments go to the VM as one comma-separated kernel parameter: no ',' or ' ' in them")
    cmdline = ["console=ttyS0", "loglevel=1", "panic=-1", "cgroup_no_v1=all", "systemd.unified_cgroup_hierarchy=1",
               f"init={HERE / 'guest.sh'}", f"CGVM_REPO={REPO}", f"CGVM_PYTHON={python}",
               f"CGVM_ARGS={','.join(pytest_args)}"]
    return ["qemu-system-x86_64", *accelerator(), "-m", "3G", "-smp", str(cpus), "-nographic", "-no-reboot",
            "-kernel", str(kernel), "-initrd", str(initramfs), "-append", " ".join(cmdline),
            "-virtfs", "local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pytest_args", nargs="*", default=list(DEFAULT_TESTS))
    parser.add_argument("--python", default=sys.executable, help="the interpreter inside (a venv's is shared too)")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the VM is stopped")
    args = parser.parse_args()
    if shutil.which("qemu-system-x86_64") is None:
        sys.exit("no qemu-system-x86_64: apt-get install qemu-system-x86")
    kernel, version = newest_kernel()
    with tempfile.TemporaryDirectory(prefix="cgroup-v2-vm-") as tmp:
        argv = qemu_argv(kernel, build_initramfs(version, Path(tmp)), args.python, args.pytest_args, args.cpus)
        print(f"booting {kernel} ({' '.join(accelerator())}) to run pytest {' '.join(args.pytest_args)}",
              flush=True)
        start = time.monotonic()
        console = run_vm(argv, args.timeout)
    found = [int(rc) for rc in RESULT.findall(console)]
    print(f"VM ran {time.monotonic() - start:.0f} s; pytest exit statuses (root, uid 65534): {found or 'none'}")
    return max(found) if len(found) == 2 else 2


def run_vm(argv: list[str], timeout: float) -> str:
    """Run QEMU, echoing its console, and return it; killed after `timeout` s (a hung guest prints nothing)."""
    vm = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout, vm.kill)
    timer.start()
    lines = []
    try:
        for raw in vm.stdout:
            line = raw.decode(errors="replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    finally:
        timer.cancel()
        if vm.poll() is None:
            vm.kill()
        vm.wait()
    if vm.returncode == -9:
        print(f"\nthe VM ran past {timeout:.0f} s: killed", flush=True)
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# softroce-vm.sh -- kvwire's Soft-RoCE test guest: a throw-away QEMU machine
# with two real rdma_rxe devices, used to run the verbs tests without an RDMA
# NIC.
#
#   scripts/softroce-vm.sh install          # apt-get the host tools, then prepare (root)
#   scripts/softroce-vm.sh prepare          # fetch the kernel, build the boot image (cached)
#   scripts/softroce-vm.sh check            # say why the guest cannot run here (exit 1), or nothing
#   scripts/softroce-vm.sh run [opts] DIR CMD [ARGS...]
#
# run: boots the guest, shares DIR at /host (9p, read-write; the working
# directory and first on PATH), runs CMD there and exits with its status
# (124: the guest timed out; 125: the guest itself failed). One CMD word is a
# /bin/sh line ('a && b'); several words are an argv. The shared libraries of
# every ELF executable in DIR are copied into the guest, so binaries built on
# this host run there unchanged. stdout+stderr of CMD stream to stdout.
#
# The guest (Debian's generic kernel, busybox, dash, kmod, iproute2, rdma,
# perftest, ibv_* tools; no network card: nothing leaves QEMU):
#   rxe0 on veth srv0 (192.0.2.1/24) <-> rxe1 on veth cli0 (192.0.2.2/24),
#   RoCE v2, veth MTU 9000 (rxe active MTU 4096), root, `ulimit -l` unlimited;
#   env SOFTROCE_DEVS="rxe0 rxe1" SOFTROCE_SRV_IP SOFTROCE_CLI_IP
#   SOFTROCE_GID_IDX (the GID table index of the IPv4-mapped address).
# Under software emulation (no usable KVM) it moves 20-60 MB/s and a round
# trip takes milliseconds: for correctness, and for performance only as a
# ratio against perftest run in the same boot (scripts/softroce-bench.sh).
#
# run options (or env): --timeout S (SOFTROCE_TIMEOUT, 900), --mem MB
# (SOFTROCE_MEM, 2048), --smp N (SOFTROCE_SMP, 2), --accel auto|kvm|tcg
# (SOFTROCE_ACCEL, auto: kvm where /dev/kvm opens and the CPU shows vmx/svm),
# --console (print the guest console afterwards).
# Cache: $SOFTROCE_CACHE (default /var/tmp/kvwire-softroce, ~460 MB); delete
# it to rebuild. SOFTROCE_KEEP_RUN=1 keeps the run directory (logs).
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
CACHE=${SOFTROCE_CACHE:-/var/tmp/kvwire-softroce}
ARCH_LIB=/usr/lib/x86_64-linux-gnu
HOST_PKGS="qemu-system-x86 busybox-static kmod cpio xz-utils iproute2 ibverbs-utils ibverbs-providers libibverbs1 librdmacm1 perftest"
NEEDED_TOOLS="qemu-system-x86_64 busybox depmod cpio ldd ibv_devices ib_write_bw rdma ip apt-get dpkg-deb xz flock"
INSTALL_HINT="sudo bash scripts/softroce-vm.sh install"

say() { [ -n "${SOFTROCE_QUIET:-}" ] || echo "softroce-vm: $*" >&2; }
die() { echo "softroce-vm: error: $*" >&2; exit 125; }

# Prints why the guest cannot run here (one line) and returns 1, or returns 0.
why_not() {
  local t
  [ "$(uname -m)" = x86_64 ] || { echo "not an x86_64 host"; return 1; }
  [ "$(id -u)" = 0 ] || { echo "not root (the guest image is built with root-owned files; run as root)"; return 1; }
  for t in $NEEDED_TOOLS; do
    command -v "$t" >/dev/null || { echo "no '$t' on this host (install: $INSTALL_HINT)"; return 1; }
  done
  { ldd /usr/bin/busybox 2>&1 || true; } | grep -q "not a dynamic" ||
    { echo "/usr/bin/busybox is not static (install: $INSTALL_HINT)"; return 1; }
  compgen -G "$CACHE/linux-image-*/.ready" >/dev/null ||
    { echo "guest not prepared in $CACHE (run: $INSTALL_HINT)"; return 1; }
  return 0
}

install_host() {
  [ "$(id -u)" = 0 ] || die "install needs root"
  local extra=""
  # bookworm's qemu-system-x86 conflicts with a backports qemu-utils
  if dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q bpo; then extra="qemu-utils/bookworm"; fi
  apt-get update -q >&2 || die "apt-get update failed"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --allow-downgrades \
    $HOST_PKGS $extra >&2 || die "apt-get install failed"
}

# ---------------------------------------------------------------------------
# prepare: the kernel (from Debian's package, never installed on the host)
# and the base initramfs. Both cached; rebuilt when this script, the kernel
# package or an installed host package changes.
# ---------------------------------------------------------------------------
elf_deps() { # the shared objects (and the ELF interpreter) of the given files
  ldd "$@" 2>/dev/null | awk '/=> \//{print $3; next} /^[[:space:]]*\/[^ ]*ld-linux/{print $1}' | sort -u
}
stage_file() { # stage_file ROOT FILE: copy FILE (dereferenced) to its canonical directory under ROOT
  local root=$1 f=$2 d
  # canonical: the guest has /lib -> usr/lib; a real lib/ in a later cpio would replace that link
  d=$(readlink -f "$(dirname "$f")")
  mkdir -p "$root$d"
  [ -e "$root$d/${f##*/}" ] || cp -L "$f" "$root$d/${f##*/}"
}

kernel_prepare() {
  KPKG=${SOFTROCE_KERNEL_PKG:-$(apt-cache depends linux-image-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/{print $2; exit}')}
  [ -n "$KPKG" ] || die "cannot resolve linux-image-amd64 (run apt-get update)"
  KVER=${KPKG#linux-image-}
  KDIR=$CACHE/$KPKG
  if [ ! -e "$KDIR/.ready" ]; then
    say "downloading $KPKG (the generic flavour: -cloud- kernels have no rdma_rxe)"
    rm -rf "$KDIR"; mkdir -p "$KDIR/deb"; chmod 1777 "$KDIR/deb"   # apt's _apt user downloads here
    (cd "$KDIR/deb" && apt-get download "$KPKG" >&2) || die "apt-get download $KPKG failed"
    dpkg-deb -x "$KDIR"/deb/*.deb "$KDIR/root"; rm -rf "$KDIR/deb"
    compgen -G "$KDIR/root/lib/modules/$KVER/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*" >/dev/null ||
      die "$KPKG has no rdma_rxe module"
    depmod -b "$KDIR/root" "$KVER"
    # An uncompressed ELF vmlinux boots through QEMU's PVH entry and skips
    # the in-kernel xz decompressor (seconds under emulation).
    local z=$KDIR/root/boot/vmlinuz-$KVER off
    off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$z" | head -1 | cut -d: -f1 || true)
    if [ -n "$off" ] && xz -dc --single-stream < <(tail -c +$((off + 1)) "$z") >"$KDIR/vmlinux" 2>/dev/null &&
       [ "$(head -c4 "$KDIR/vmlinux" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then :; else rm -f "$KDIR/vmlinux"; fi
    touch "$KDIR/.ready"
  fi
  KERNEL=$KDIR/root/boot/vmlinuz-$KVER
  [ -e "$KDIR/vmlinux" ] && KERNEL=$KDIR/vmlinux
}

GUEST_TOOLS="ibv_devices ibv_devinfo ibv_rc_pingpong ibv_ud_pingpong ib_write_bw ib_write_lat ib_read_bw \
ib_read_lat ib_send_bw ib_send_lat ib_atomic_bw ib_atomic_lat rdma kmod dash bash ip"
GUEST_MODS="rdma_rxe ib_uverbs rdma_ucm ib_umad crc32_generic veth virtio_pci 9pnet_virtio 9p"
RXE_PROVIDER=$ARCH_LIB/libibverbs/librxe-rdmav34.so

base_prepare() {
  local tools="" t id
  for t in $GUEST_TOOLS; do tools="$tools $(command -v "$t")"; done
  id=$({ echo kvwire-softroce-1 "$KPKG"; sha256sum <"$SELF"; stat -c %Y /var/lib/dpkg/status
         for t in $tools /usr/bin/busybox $RXE_PROVIDER; do stat -Lc '%n %s %Y' "$t"; done; } | sha256sum | cut -c1-16)
  BASE=$CACHE/base-$id.cpio
  [ -e "$BASE" ] && return 0
  say "building the guest's base initramfs"
  rm -f "$CACHE"/base-*.cpio
  local st; st=$(mktemp -d "$CACHE/stage.XXXXXX")
  mkdir -p "$st"/{usr/bin,usr/sbin,usr/lib,usr/lib64,proc,sys,dev,tmp,run,host,root,kvw,etc/libibverbs.d}
  for d in bin sbin lib lib64; do ln -s "usr/$d" "$st/$d"; done
  cp /usr/bin/busybox "$st/usr/bin/"
  for a in $(/usr/bin/busybox --list); do
    case $a in busybox|sh|ip|modprobe|insmod|rmmod|lsmod|depmod|modinfo) continue;; esac
    ln -s busybox "$st/usr/bin/$a" 2>/dev/null || true
  done
  for t in $tools $RXE_PROVIDER; do stage_file "$st" "$t"; done
  [ -e "$st/usr/bin/ip" ] || cp -L "$(command -v ip)" "$st/usr/bin/ip"    # busybox ip cannot make veth pairs
  # /bin/sh is dash: Debian's busybox ash prefers its own applets (ip, modprobe) to the binaries on PATH
  ln -s dash "$st/usr/bin/sh"
  for a in modprobe insmod rmmod lsmod depmod modinfo; do ln -s ../bin/kmod "$st/usr/sbin/$a"; done
  cp /etc/libibverbs.d/rxe.driver "$st/etc/libibverbs.d/"   # rxe only: other providers just warn
  for f in $(elf_deps $tools $RXE_PROVIDER); do stage_file "$st" "$f"; done
  for l in libgcc_s.so.1 libstdc++.so.6 libm.so.6 libibverbs.so.1 librdmacm.so.1; do
    [ -e "$ARCH_LIB/$l" ] && stage_file "$st" "$ARCH_LIB/$l"
  done
  for f in $(elf_deps "$st$ARCH_LIB"/*.so*); do stage_file "$st" "$f"; done
  # kernel modules with their dependencies (modules.dep)
  local mr=$KDIR/root/lib/modules/$KVER m line
  for m in $GUEST_MODS; do
    line=$(grep -E "/${m//-/[-_]}\.ko(\.[a-z]+)?:" "$mr/modules.dep") || die "kernel $KVER has no module $m"
    echo "$line" | tr -d : | tr ' ' '\n'
  done | grep . | sort -u | while read -r m; do
    mkdir -p "$st/lib/modules/$KVER/$(dirname "$m")"; cp "$mr/$m" "$st/lib/modules/$KVER/$m"
  done
  cp "$mr"/modules.builtin* "$mr/modules.order" "$st/lib/modules/$KVER/"
  depmod -b "$st" "$KVER"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$st/etc/passwd"; echo 'root:x:0:' >"$st/etc/group"
  printf '127.0.0.1 localhost\n192.0.2.1 srv\n192.0.2.2 cli\n' >"$st/etc/hosts"
  printf 'hosts: files\npasswd: files\ngroup: files\n' >"$st/etc/nsswitch.conf"
  guest_init >"$st/init"; chmod 755 "$st/init"
  (cd "$st" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet) >"$BASE.tmp"
  mv "$BASE.tmp" "$BASE"; rm -rf "$st"
}

# The guest's /init. Serial ports: ttyS0 kernel console, ttyS1 the command's
# output, ttyS2 its exit status.
guest_init() {
  cat <<'INIT'
#!/bin/sh
export PATH=/host:/usr/bin:/usr/sbin HOME=/root
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /run
log() { echo "[kvwire-softroce] $*"; }
fail() { log "FATAL: $*"; echo 125 >/dev/ttyS2; sync; poweroff -f; }
echo /usr/sbin/modprobe >/proc/sys/kernel/modprobe
modprobe -a virtio_pci 9pnet_virtio 9p veth crc32_generic ib_uverbs rdma_ucm ib_umad rdma_rxe || fail "modprobe"
ip link set lo up
ip link add srv0 type veth peer name cli0 || fail "veth pair"
# Both veth ends live in one network namespace: without accept_local (and
# with rp_filter) the kernel drops ARP/RoCE packets from its own addresses
# and the QP transition to RTR between rxe0 and rxe1 fails.
for d in all default srv0 cli0; do
  echo 1 >/proc/sys/net/ipv4/conf/$d/accept_local; echo 0 >/proc/sys/net/ipv4/conf/$d/rp_filter
done
ip addr add 192.0.2.1/24 dev srv0; ip addr add 192.0.2.2/24 dev cli0
# MTU 9000 gives rxe an active MTU of 4096; a long queue/backlog avoids drops (RC retransmits)
for l in srv0 cli0; do ip link set $l mtu 9000 txqueuelen 10000; done
echo 50000 >/proc/sys/net/core/netdev_max_backlog
ip link set srv0 up; ip link set cli0 up
rdma link add rxe0 type rxe netdev srv0 || fail "rdma link add rxe0"
rdma link add rxe1 type rxe netdev cli0 || fail "rdma link add rxe1"
gid=""
for i in 0 1 2 3 4 5 6 7; do   # the GID holding ::ffff:192.0.2.1 (RoCE v2 over IPv4)
  case "$(cat /sys/class/infiniband/rxe0/ports/1/gids/$i 2>/dev/null)" in
    0000:0000:0000:0000:0000:ffff:*) gid=$i; break;;
  esac
done
export SOFTROCE_DEVS="rxe0 rxe1" SOFTROCE_SRV_IP=192.0.2.1 SOFTROCE_CLI_IP=192.0.2.2 SOFTROCE_GID_IDX=$gid
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none host0 /host || fail "9p mount"
ulimit -l unlimited
log "ready at uptime $(cut -d' ' -f1 /proc/uptime)s (gid index $gid)"
stty -F /dev/ttyS1 raw -echo 2>/dev/null; stty -F /dev/ttyS2 raw -echo 2>/dev/null
cd /host
/bin/sh /kvw/cmd.sh >/dev/ttyS1 2>&1 </dev/null
rc=$?
log "command exited with $rc"
echo "$rc" >/dev/ttyS2
sync
poweroff -f
INIT
}

prepare() {
  local r
  for t in $NEEDED_TOOLS; do command -v "$t" >/dev/null || die "no '$t' on this host (run: $INSTALL_HINT)"; done
  { ldd /usr/bin/busybox 2>&1 || true; } | grep -q "not a dynamic" || die "/usr/bin/busybox is not static (run: $INSTALL_HINT)"
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"; flock 9            # one builder at a time; running guests need no lock
  kernel_prepare
  base_prepare
  flock -u 9
  r=$(du -sm "$CACHE" | cut -f1)
  say "prepared: kernel $KVER, $(basename "$BASE") ($r MB cache in $CACHE)"
}

# ---------------------------------------------------------------------------
run_guest() {
  local timeout=${SOFTROCE_TIMEOUT:-900} mem=${SOFTROCE_MEM:-2048} smp=${SOFTROCE_SMP:-2}
  local accel=${SOFTROCE_ACCEL:-auto} console=0
  while [ $# -gt 0 ]; do
    case $1 in
      --timeout) timeout=$2; shift 2;; --mem) mem=$2; shift 2;; --smp) smp=$2; shift 2;;
      --accel) accel=$2; shift 2;; --console) console=1; shift;;
      --) shift; break;; -*) die "unknown run option $1";; *) break;;
    esac
  done
  [ $# -ge 2 ] || die "usage: softroce-vm.sh run [options] DIR CMD [ARGS...]"
  local why; why=$(why_not) || die "$why"
  SOFTROCE_QUIET=1 prepare
  local dir; dir=$(cd "$1" && pwd) || die "no directory $1"; shift
  RUN=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-softroce-run.XXXXXX")
  QEMU_PID=""; TAIL_PID=""
  trap 'run_cleanup' EXIT; trap 'exit 130' INT TERM
  mkdir -p "$RUN/ov/kvw"
  if [ $# -eq 1 ]; then
    printf '#!/bin/sh\n%s\n' "$1" >"$RUN/ov/kvw/cmd.sh"
  else
    { printf '#!/bin/sh\nexec'; for a in "$@"; do printf " '%s'" "${a//\'/\'\\\'\'}"; done; echo; } >"$RUN/ov/kvw/cmd.sh"
  fi
  local elves=() f
  while IFS= read -r f; do
    [ "$(head -c4 "$f" | od -An -tx1 | tr -d ' ')" = 7f454c46 ] && elves+=("$f")
  done < <(find "$dir" -maxdepth 3 -type f -perm -u+x -size -2G 2>/dev/null)
  if [ ${#elves[@]} -gt 0 ]; then for f in $(elf_deps "${elves[@]}"); do stage_file "$RUN/ov" "$f"; done; fi
  # Linux unpacks concatenated cpio archives in order; later files win.
  (cd "$RUN/ov" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet) | cat "$BASE" - >"$RUN/initrd"
  if [ "$accel" = auto ]; then
    accel=tcg
    if [ -r /dev/kvm ] && [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then accel=kvm; fi
  fi
  local acc
  case $accel in
    kvm) acc=(-accel kvm -cpu host);;
    tcg) acc=(-accel tcg,thread=multi,tb-size=512 -cpu max);;
    *) die "--accel must be auto, kvm or tcg";;
  esac
  # lpj= skips delay-loop calibration; quiet console; no KASLR/mitigations (speed under TCG)
  local append="console=ttyS0 rdinit=/init panic=-1 oops=panic quiet loglevel=3 tsc=reliable no_timer_check lpj=4000000 mitigations=off nokaslr"
  : >"$RUN/out"; : >"$RUN/console"; : >"$RUN/status"
  say "booting the guest (accel $accel, kernel $KVER, timeout ${timeout}s)"
  local t0=$SECONDS
  qemu-system-x86_64 -M pc "${acc[@]}" -smp "$smp" -m "$mem" -nodefaults -no-user-config \
    -display none -monitor none -nic none -no-reboot \
    -kernel "$KERNEL" -initrd "$RUN/initrd" -append "$append" \
    -serial "file:$RUN/console" -serial "file:$RUN/out" -serial "file:$RUN/status" \
    -virtfs "local,path=$dir,mount_tag=host0,security_model=none,id=host0" </dev/null >"$RUN/qemu.log" 2>&1 &
  QEMU_PID=$!
  tail -n +1 -s 0.2 -f --pid="$QEMU_PID" "$RUN/out" & TAIL_PID=$!
  local timed_out=0
  while kill -0 "$QEMU_PID" 2>/dev/null; do
    if [ $((SECONDS - t0)) -ge "$timeout" ]; then timed_out=1; kill "$QEMU_PID" 2>/dev/null || true; break; fi
    sleep 0.2
  done
  wait "$QEMU_PID" 2>/dev/null || true; QEMU_PID=""
  wait "$TAIL_PID" 2>/dev/null || true; TAIL_PID=""
  local rc; rc=$(tr -dc 0-9 <"$RUN/status")
  say "guest done after $((SECONDS - t0)) s, status ${rc:-none}"
  if [ "$console" = 1 ] || [ -z "$rc" ] || [ "$rc" = 125 ]; then
    { echo "----- guest console -----"; tr -d '\r' <"$RUN/console"; echo "----- qemu -----"; cat "$RUN/qemu.log"; } >&2
  fi
  [ "$timed_out" = 0 ] || { echo "softroce-vm: error: the guest ran past ${timeout}s" >&2; exit 124; }
  [ -n "$rc" ] || die "the guest gave no exit status (kernel panic? see the console above)"
  exit "$rc"
}
run_cleanup() {
  if [ -n "$QEMU_PID" ]; then kill "$QEMU_PID" 2>/dev/null || true; fi
  if [ -n "$TAIL_PID" ]; then kill "$TAIL_PID" 2>/dev/null || true; fi
  [ -n "${SOFTROCE_KEEP_RUN:-}" ] && echo "softroce-vm: run directory kept: $RUN" >&2 || rm -rf "$RUN"
}

case ${1:-} in
  install) install_host; prepare;;
  prepare) prepare;;
  check) why_not;;
  run) shift; run_guest "$@";;
  -h|--help|"") sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//';;
  *) die "unknown command '$1' (install, prepare, check, run; --help)";;
esac

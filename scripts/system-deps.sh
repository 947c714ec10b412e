#!/usr/bin/env bash
# Installs the Debian packages the project uses when they are missing: libaio (runtime library and
# headers) for ds_ops.aio. Idempotent. Never fails its caller: without apt or root it only says so, and
# ds_ops.aio then runs on its thread-pool fallback (os.preadv/os.pwritev) with a warning.
set -u

log() { echo "system-deps: $*"; }

have_libaio_runtime() {
  ldconfig -p 2>/dev/null | grep -q 'libaio\.so\.1 ' || ls /usr/lib/*/libaio.so.1 /lib/*/libaio.so.1 >/dev/null 2>&1
}

have_libaio_headers() { [ -f /usr/include/libaio.h ]; }

# Debian 13 (trixie) renamed the runtime package for the 64-bit time_t transition.
runtime_package() {
  if apt-cache show libaio1t64 >/dev/null 2>&1; then echo libaio1t64; else echo libaio1; fi
}

main() {
  local wanted=()
  if have_libaio_runtime; then log "libaio runtime present"; else wanted+=(runtime); fi
  if have_libaio_headers; then log "libaio headers present"; else wanted+=(libaio-dev); fi
  if [ "${#wanted[@]}" -eq 0 ]; then
    log "nothing to install"
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "apt-get unavailable; not installing libaio (ds_ops.aio falls back to a thread pool)"
    return 0
  fi
  if [ "$(id -u)" -ne 0 ]; then
    log "not root; not installing libaio (run this script as root, or ds_ops.aio falls back to a thread pool)"
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Package lists may be absent on a fresh image: refresh them only when the candidate is unknown.
  if ! apt-cache show libaio-dev >/dev/null 2>&1; then
    log "apt-get update"
    apt-get update -qq >/dev/null 2>&1 || log "apt-get update failed"
  fi
  local pkgs=()
  local item
  for item in "${wanted[@]}"; do
    if [ "$item" = runtime ]; then pkgs+=("$(runtime_package)"); else pkgs+=("$item"); fi
  done
  log "apt-get install -y ${pkgs[*]}"
  if apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
    log "installed ${pkgs[*]}"
  else
    log "apt-get install ${pkgs[*]} failed (ds_ops.aio falls back to a thread pool)"
  fi
  return 0
}

main "$@"
exit 0

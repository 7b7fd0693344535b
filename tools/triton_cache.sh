#!/usr/bin/env bash
# Triton's kernel cache between device calls (each device machine starts bare, and a megakernel
# compile takes ~40 s).  The cache travels packed: unpacked it outgrows the 64 MiB a device call
# carries (155 MB after session 8's helper part), packed it is ~6-11 MB.
#   bash tools/triton_cache.sh pack FILE     (on the device) .triton_cache -> FILE (xz), if FILE fits 16 MiB
#   bash tools/triton_cache.sh keep FILE     (here) FILE -> .triton_cache.txz, to carry in the next call
#   bash tools/triton_cache.sh restore       (on the device) .triton_cache.txz, if carried -> .triton_cache
# gpu_session.sh restores at its start and packs at its end.  Entries are keyed by kernel source,
# constants and Triton version, so a stale entry is never used.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${TRITON_CACHE_DIR:-$PWD/.triton_cache}"
carried=.triton_cache.txz
case "${1:-}" in
    pack)
        [ -d "$cache" ] || { echo "triton_cache: no cache at $cache" >&2; exit 0; }
        # xz on every core: one thread at the default preset took over 50 s for session 12's ~150 MB
        # cache and came back cut off; preset 2 came to 19 MiB, over what a call returns
        XZ_OPT="${XZ_OPT:--T0 -6}" tar -C "$cache" -cJf "$2" .
        size=$(stat -c %s "$2")
        if [ "$size" -gt $((16 * 1024 * 1024)) ]; then
            echo "triton_cache: $2 is $((size >> 20)) MiB, over the 16 MiB a device call returns: dropped" >&2
            rm -f "$2"
        fi ;;
    keep)
        # a call cut by its time limit can return a truncated archive: keep the last good one then
        xz -t "$2" || { echo "triton_cache: $2 is damaged; $carried unchanged" >&2; exit 1; }
        install -m 644 "$2" "$carried"  # the fetched file is read-only
        echo "triton_cache: $(du -h "$carried" | cut -f1) in $carried: carry [\"$carried\"] in the next device call" ;;
    restore)
        [ -f "$carried" ] || exit 0
        mkdir -p "$cache" && tar -C "$cache" -xJf "$carried"
        echo "triton_cache: $(find "$cache" -type f | wc -l) files restored in $cache" ;;
    *)
        echo "usage: bash tools/triton_cache.sh pack FILE | keep FILE | restore" >&2; exit 2 ;;
esac

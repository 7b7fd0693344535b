#!/usr/bin/env bash
# Triton's kernel cache between device calls (each device machine starts bare, and a megakernel
# compile takes ~40 s):
#   bash tools/triton_cache.sh pack FILE     (on the device) .triton_cache -> FILE (xz), if FILE fits 16 MiB
#   bash tools/triton_cache.sh unpack FILE   (here) FILE -> .triton_cache, then carry .triton_cache
# Entries are keyed by kernel source, constants and Triton version, so a stale entry is never used.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${TRITON_CACHE_DIR:-$PWD/.triton_cache}"
case "${1:-}" in
    pack)
        [ -d "$cache" ] || { echo "triton_cache: no cache at $cache" >&2; exit 0; }
        tar -C "$cache" -cJf "$2" .
        size=$(stat -c %s "$2")
        if [ "$size" -gt $((16 * 1024 * 1024)) ]; then
            echo "triton_cache: $2 is $((size >> 20)) MiB, over the 16 MiB a device call returns: dropped" >&2
            rm -f "$2"
        fi ;;
    unpack)
        rm -rf "$cache" && mkdir -p "$cache" && tar -C "$cache" -xJf "$2"
        echo "triton_cache: $(find "$cache" -type f | wc -l) files, $(du -sh "$cache" | cut -f1) in $cache" ;;
    *)
        echo "usage: bash tools/triton_cache.sh pack|unpack FILE" >&2; exit 2 ;;
esac

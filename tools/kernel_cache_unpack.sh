#!/usr/bin/env bash
# Unpack the kernel cache a device call sent back (tools/device_check.sh: $OUT/kernel-cache.tgz.part*) into
# .kernel-cache here, replacing what was there, for the next session's first device call to carry:
# carry [".whl", ".kernel-cache"] on a cold machine only (a warm one keeps its own, newer cache; carrying replaces it).
#   bash tools/kernel_cache_unpack.sh /work/.device/N
set -euo pipefail
cd "$(dirname "$0")/.."
from="${1:?the folder where the files of a device call landed}"
parts=("$from"/kernel-cache.tgz.part*)
[ -e "${parts[0]}" ] || { echo "no kernel-cache.tgz.part* in $from" >&2; exit 1; }
rm -rf .kernel-cache
cat "${parts[@]}" | tar -xzf -
echo "$(find .kernel-cache -name '*.kernel' | wc -l) entries, $(du -sh .kernel-cache | cut -f1) in .kernel-cache"

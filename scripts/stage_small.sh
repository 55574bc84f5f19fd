#!/usr/bin/env bash
# Model chunks small enough to travel beside the working tree (a device call carries at most 64 MiB in all: the
# tree, ~4-5 MiB, plus the carried paths, so ../shared/device/stage's 60 MiB chunks no longer fit; session 17 lost
# its lease to that). Same layout and commands as `stage`, with 48 MiB chunks under .device-carry/NAME-48/NN.
# usage (from the project root): scripts/stage_small.sh MODEL [MODEL ...]   (registry names, as for stage)
set -euo pipefail
chunk=50331648
for m in "$@"; do
  file=$(../shared/device/fetch-model "$m")
  sum=$(sha256sum "$file" | cut -d' ' -f1)
  dir=.device-carry/$m-48
  rm -rf "$dir"; mkdir -p "$dir"
  split -b $chunk -d -a 2 "$file" "$dir/"
  echo "# $m: $(ls "$dir" | wc -l) chunks of 48 MiB; sha256 $sum"
  for c in $(ls "$dir"); do
    echo "$dir/$c: mkdir -p /tmp/models && dd if=$dir/$c of=/tmp/models/$m.gguf bs=$chunk seek=$((10#$c)) conv=notrunc status=none"
  done
done

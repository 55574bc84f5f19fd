#!/usr/bin/env bash
# One staging call of a lease, safe to send back to back in one message: on a fresh machine it first installs the
# carried wheels, copies the tree and starts the lease's driver; then it writes chunk NN of MODEL
# (scripts/stage_small.sh's layout) and, given the file's sha256 on the last chunk, checks it and marks it staged.
# (Session 19 lost a lease to the gap between a first call sent alone and the batch that followed it.)
# usage (on the device machine, carrying .whl and .device-carry/MODEL-48/NN):
#   scripts/lease_chunk.sh DRIVER MODEL NN [SHA256]
set -uo pipefail
driver=$1 m=$2 c=$3 sum=${4:-}
if [ ! -d /tmp/tree ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/tree /tmp/burst /tmp/models
  tar cf - --exclude=./.device-carry --exclude=./.whl --exclude=./.git . | tar xf - -C /tmp/tree
  (cd /tmp/tree && setsid nohup "$driver" > /tmp/burst/driver.log 2>&1 < /dev/null &)
  nvidia-smi -L
fi
dd if=".device-carry/$m-48/$c" of="/tmp/models/$m.gguf" bs=50331648 seek=$((10#$c)) conv=notrunc status=none
if [ -n "$sum" ]; then echo "$sum  /tmp/models/$m.gguf" | sha256sum -c && touch "/tmp/models/$m.gguf.ok"; fi
(cd /tmp/burst && tar czf "$OUT/res.tgz" . 2>/dev/null); tail -2 /tmp/burst/progress

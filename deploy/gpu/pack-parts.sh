#!/usr/bin/env bash
# The tail of pack-vllm.sh and pack-sglang.sh: one site directory into parts small enough for a device call.
#     bash deploy/gpu/pack-parts.sh SITE NAME [PARTS_DIR=.gpu]
# tar | zstd -19 --long=27 (a 128 MiB window: the big CUDA libraries repeat themselves far apart), split into
# 56 MiB parts PARTS_DIR/NAME.part0.. (a device call carries 64 MiB with the repository), PARTS_DIR/NAME.sha256
# (of the whole stream), and the zstandard wheel: the GPU image has no zstd binary, its Python decompresses with it.
# deploy/gpu/server.sh NAME stash | install puts them together on the GPU machine.
set -eu
SITE=${1:?SITE} NAME=${2:?NAME} PARTS=${3:-.gpu}
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$PARTS"
echo "$NAME site: $(du -sh "$SITE" | cut -f1)"
rm -f "$PARTS/$NAME".part* "$PARTS/$NAME.sha256"
tar -C "$SITE" -cf - . | zstd -T0 -19 --long=27 -q -o "$TMP/$NAME-site.tar.zst"
size=$(stat -c %s "$TMP/$NAME-site.tar.zst") part=$((56 * 1024 * 1024))
# one digit while that is enough (vllm.part0..2), two past ten parts: the names still sort in order
split -b $part -d -a $(( (size + part - 1) / part > 10 ? 2 : 1 )) "$TMP/$NAME-site.tar.zst" "$PARTS/$NAME.part"
sha256sum "$TMP/$NAME-site.tar.zst" | cut -d' ' -f1 > "$PARTS/$NAME.sha256"
python3 "$HERE/wheel_closure.py" --dest "$PARTS" zstandard > /dev/null
ls -l "$PARTS/$NAME".* "$PARTS"/zstandard-*.whl

#!/bin/sh
# MLX's Linux CPU wheel links a reference BLAS (~30x slower fp32 matmul); mlx-spec loads
# OpenBLAS at import when it is installed. Install it where we can, say how where we cannot.
[ "$(uname -s)" = Linux ] || exit 0
ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread > /dev/null && exit 0
fi
echo "note: OpenBLAS not found; mlx-spec runs, but matmuls on the CPU are ~30x slower." >&2
echo "      Install it with: sudo apt-get install libopenblas0-pthread" >&2
exit 0

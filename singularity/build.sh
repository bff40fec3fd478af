#!/usr/bin/env bash
# Build the image the Slurm jobs run in, from singularity/pretrain.def:
#     bash singularity/build.sh [IMAGE]        # IMAGE defaults to pretrain.sif in the repository root
# Uses apptainer, or singularity where only that is installed; --fakeroot when not run as root.
# Then copy the image to a filesystem the compute nodes see and set cluster.container.image to it.
set -euo pipefail

# A relative IMAGE is taken from where you call the script; the build itself runs in the repository
# root, where the definition's %files paths point.
image=$(realpath -m -- "${1:-$(dirname "$0")/../pretrain.sif}")
cd "$(dirname "$0")/.."

runtime=""
for candidate in apptainer singularity; do
    if command -v "$candidate" > /dev/null; then
        runtime=$candidate
        break
    fi
done
if [ -z "$runtime" ]; then
    cat >&2 << 'EOF'
build.sh: neither apptainer nor singularity is on PATH, so the image cannot be built here.
Build it on a machine that has Apptainer (a Linux workstation, or the cluster's build or login node):
  - on a cluster, load it first: module load apptainer   (or: module load singularity)
  - to install it: https://apptainer.org/docs/admin/main/installation.html
EOF
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    set -- build
else
    set -- build --fakeroot
fi
echo "build.sh: $runtime $* $image singularity/pretrain.def" >&2
exec "$runtime" "$@" "$image" singularity/pretrain.def

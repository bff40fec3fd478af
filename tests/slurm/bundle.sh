#!/usr/bin/env bash
# bundle.sh - carry this machine's Slurm and munge to a machine that has no package manager
# reachable (the GPU machine of the device tool), so that localcluster.sh runs there.
#
#   bundle.sh pack FILE.tar.gz     here, with the packages installed (localcluster.sh install):
#                                  Slurm's daemons and clients, its plugins, munge, and every
#                                  library they load except glibc's own
#   bundle.sh unpack FILE.tar.gz   there, as root: the programs and plugins where Debian keeps
#                                  them (never over a file that exists), the libraries that
#                                  machine lacks in /opt/pretrain-slurm/lib (ldconfig knows it),
#                                  and munge's folders
#
# Accounting (slurmdbd, MariaDB) is left out: start the cluster there with
# LOCALCLUSTER_ACCOUNTING=none. The bundle's Slurm is Debian bookworm's (22.05), built against
# glibc 2.36: it runs where glibc is that or newer.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

PROGRAMS=(slurmctld slurmd slurmstepd sbatch srun scontrol squeue scancel sinfo sacct salloc munged munge unmunge)
PLUGIN_DIR=/usr/lib/x86_64-linux-gnu/slurm-wlm
LIB_DIR=/opt/pretrain-slurm/lib
# glibc's libraries: the machine's own must be used, never a copy.
GLIBC='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64|linux-vdso)\.so'

die() { printf 'bundle: error: %s\n' "$*" >&2; exit 1; }
stage=
trap '[[ -z $stage ]] || rm -rf "$stage"' EXIT

pack() {
    local out=$1 program path lib
    stage=$(mktemp -d)
    mkdir -p "$stage/root" "$stage/libs"
    for program in "${PROGRAMS[@]}"; do
        path=$(command -v "$program") || die "$program is not installed (bash tests/slurm/localcluster.sh install)"
        mkdir -p "$stage/root$(dirname "$path")"
        cp -p "$path" "$stage/root$path"
    done
    mkdir -p "$stage/root$PLUGIN_DIR"
    cp -a "$PLUGIN_DIR/." "$stage/root$PLUGIN_DIR/"
    # Every library the programs and plugins load (resolved here), glibc's excepted.
    { for program in "${PROGRAMS[@]}"; do ldd "$(command -v "$program")"; done
      for path in "$PLUGIN_DIR"/*.so*; do ldd "$path" 2>/dev/null || true; done; } |
        awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
        while read -r lib path; do
            [[ $lib =~ $GLIBC ]] && continue
            [[ $path == "$PLUGIN_DIR"/* ]] && continue
            cp -L "$path" "$stage/libs/$lib"
        done
    tar -C "$stage" -czf "$out" root libs
    printf 'bundle: %s: %s programs, %s plugins, %s libraries, %s\n' "$out" "${#PROGRAMS[@]}" \
        "$(find "$stage/root$PLUGIN_DIR" -name '*.so' | wc -l)" "$(find "$stage/libs" -type f | wc -l)" \
        "$(du -h "$out" | cut -f1)" >&2
}

unpack() {
    local bundle=$1 file target lib added=0 kept=0
    [[ $EUID -eq 0 ]] || die "unpack needs root (it writes under /usr and /opt)"
    stage=$(mktemp -d)
    tar -C "$stage" -xzf "$bundle"
    while IFS= read -r -d '' file; do
        target=${file#"$stage/root"}
        if [[ -e $target ]]; then
            cmp -s "$file" "$target" || printf 'bundle: %s exists here and differs: kept as it is\n' "$target" >&2
            kept=$((kept + 1))
            continue
        fi
        mkdir -p "$(dirname "$target")"
        cp -a "$file" "$target"
    done < <(find "$stage/root" \( -type f -o -type l \) -print0)
    mkdir -p "$LIB_DIR"
    for file in "$stage"/libs/*; do
        lib=$(basename "$file")
        if ldconfig -p | grep -q "^[[:space:]]*$lib "; then
            continue
        fi
        cp "$file" "$LIB_DIR/$lib"
        added=$((added + 1))
    done
    echo "$LIB_DIR" >/etc/ld.so.conf.d/pretrain-slurm.conf
    ldconfig
    mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
    for program in "${PROGRAMS[@]}"; do
        command -v "$program" >/dev/null || die "$program is not on PATH after unpacking"
    done
    for program in slurmctld slurmd slurmstepd munged; do
        if ldd "$(command -v "$program")" | grep -q 'not found'; then
            ldd "$(command -v "$program")" | grep 'not found' >&2
            die "$program still lacks libraries"
        fi
    done
    printf 'bundle: unpacked; %s libraries added to %s, %s files kept as they were\n' "$added" "$LIB_DIR" "$kept" >&2
}

case ${1:-} in
    pack) [[ $# -eq 2 ]] || die "usage: bundle.sh pack FILE.tar.gz"; pack "$(realpath -m "$2")" ;;
    unpack) [[ $# -eq 2 ]] || die "usage: bundle.sh unpack FILE.tar.gz"; unpack "$(realpath "$2")" ;;
    *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

# Shared by the CI tier scripts (sourced, not run). The tpu and xpu tiers pin old torch releases
# whose only PyPI builds are the CUDA ones: 7-8 GB installed and about 3.5 GB of wheels to
# download. CI machines of this kind have been seen with anything from 287 MB to 80 GB of free
# disk, so the tiers keep their disk peak low and say plainly when a machine cannot hold them.

free_gib() {  # free_gib [PATH]: whole GiB free on the file system holding PATH
    df -Pk "${1:-.}" | awk 'NR == 2 { print int($4 / 1048576) }'
}

# skip_without_disk TIER NEED_GIB: exit 0 with a loud SKIPPED line when fewer than NEED_GIB are
# free. A skipped tier loses only the real torch_xla / IPEX layer: the Pallas kernels and the
# XPU dispatch chain also run in the main tier (JAX interpret mode; IPEX absent).
skip_without_disk() {
    local tier=$1 need=$2 have
    have=$(free_gib .)
    if (( have < need )); then
        echo "$tier tier: SKIPPED: building its venv needs about $need GiB of free disk; this machine has $have GiB"
        exit 0
    fi
}

# install_one_by_one VENV REQUIREMENT...: resolve the whole set once from metadata only (pip's
# --dry-run --report), then install the resolved wheels one at a time with no cache. The disk peak
# is the installed set plus one wheel, instead of the installed set plus every wheel held in pip's
# cache and temp dir at once (about 3.5 GB more). pip's chatter goes to a log shown on failure.
install_one_by_one() {
    local venv=$1 report log url
    shift
    report=$(mktemp) log=$(mktemp)
    if ! "$venv/bin/pip" install -q --no-cache-dir --dry-run --ignore-installed \
            --report "$report" "$@" >"$log" 2>&1; then
        grep -v '^WARNING: Location' "$log" | tail -40
        rm -f "$report" "$log"
        return 1
    fi
    while read -r url; do
        if ! "$venv/bin/pip" install -q --no-cache-dir --no-deps "$url" >"$log" 2>&1; then
            echo "install of $url failed:"
            grep -v '^WARNING: Location' "$log" | tail -40
            rm -f "$report" "$log"
            return 1
        fi
    done < <("$venv/bin/python" -c '
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["download_info"]["url"])' "$report")
    rm -f "$report" "$log"
}

#!/usr/bin/env bash
# knitkit's two entry points on a fresh machine:
#   ./dev.sh demo [ARGS]   install knitkit if needed, then run the end-to-end demo (knitkit demo)
#   ./dev.sh test [ARGS]   install knitkit with its dev extras, lint, type-check and run the test suite
#                          (as root it also apt-get installs libibverbs1 libnuma1 for Mooncake if missing)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

install() {
    # NOTE: torch first, pinned to the CPU build on this machine's disk; with it installed,
    # knitkit's loose `torch>=2.4` requirement pulls no multi-GB CUDA build.
    "$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[$1]"
    case ",$1," in *,mooncake,*) install_mooncake_libs ;; esac
}

install_mooncake_libs() {
    # NOTE: Mooncake's wheel links libibverbs.so.1 and libnuma.so.1 even for TCP transfers;
    # Debian ships them in libibverbs1 and libnuma1. Installing them needs root: as root, apt-get
    # runs (said first) only when one is missing; otherwise, or when apt-get fails, the line
    # below says what to run, and the Mooncake tests skip with the loader's reason.
    local libs missing=()
    libs=$(ldconfig -p 2>/dev/null || true)
    grep -q 'libibverbs\.so\.1 ' <<<"$libs" || missing+=(libibverbs1)
    grep -q 'libnuma\.so\.1 ' <<<"$libs" || missing+=(libnuma1)
    [ ${#missing[@]} -eq 0 ] && return 0
    local skip="the Mooncake tests will be skipped until then"
    if [ "$(id -u)" != 0 ]; then
        echo "dev.sh: Mooncake needs ${missing[*]}, which needs root: sudo apt-get install ${missing[*]}; $skip" >&2
        return 0
    fi
    echo "dev.sh: installing ${missing[*]} for Mooncake (as root: apt-get update && apt-get install)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        >/dev/null 2>&1 || echo "dev.sh: apt-get install ${missing[*]} failed; $skip" >&2
}

wheel_check() {
    # Build the wheel and run both CLIs from a fresh virtual environment, outside the checkout,
    # so a package missing from the wheel fails here rather than for a user.
    local tmp
    tmp=$(mktemp -d)
    rm -rf build  # setuptools' scratch copy keeps modules that were moved or deleted since
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$tmp/dist" .
    "$PYTHON" -m venv "$tmp/venv"
    "$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    "$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$tmp"/dist/knitkit-*.whl
    (cd "$tmp" && venv/bin/knitkit demo --help >/dev/null && venv/bin/knitkit replay --help >/dev/null)
    rm -rf "$tmp"
    echo "wheel check: knitkit demo --help and knitkit replay --help run from the installed wheel"
}

case "${1:-}" in
    demo)
        shift
        install "plot,tensorboard"
        exec "$PYTHON" -m knitkit demo "$@"
        ;;
    test)
        shift
        install "dev,ray,megatron,tq,mooncake,plot"
        "$PYTHON" -m ruff check knitkit integration tests benchmarks examples
        "$PYTHON" -m ruff format --check knitkit integration tests benchmarks examples
        "$PYTHON" -m mypy knitkit integration
        wheel_check
        # NOTE: pytest exits 5 when it collects nothing; that must fail, so its code passes through.
        exec "$PYTHON" -m pytest "$@"
        ;;
    *)
        sed -n '2,5p' "$0"
        exit 2
        ;;
esac

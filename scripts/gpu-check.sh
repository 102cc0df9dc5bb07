#!/usr/bin/env bash
# GPU acceptance run, from the repo root on a machine with an NVIDIA GPU (two for the
# cross-GPU paths):  bash scripts/gpu-check.sh
# Builds with CUDA in a fresh build dir, runs the whole test suite, then each GPU test on its
# own (none may skip): the CUDA copy backend, device memory (test_mem), the simulation's
# exactness suite on GPUs (test_sim_gpu), the cross-process CUDA IPC test (test_cuda_ipc) and
# the multi-process deployments (test_rank_processes: GPU pools in every rank process, CUDA
# IPC through the net link), the model's CUDA backend against the CPU (test_forward_cuda), the
# serving engine disaggregated on the GPU in one process (test_llm_cuda: the KV in decode's pool
# byte for byte prefill's, the colocated GPU tokens, prefill TP2, CPU<->GPU pairs), the
# Python package's GPU tests (py-gpu: needs a venv with torch); the real model on the GPU
# (generate-cuda: colocated and disaggregated give the same tokens), the HTTP servers on the GPU
# (serve-cuda: `kvstage serve --device cuda` colocated, and prefill TP1 and TP3 -> decode TP1
# behind `kvstage router`, greedy chat and completion answers, streamed and not, all equal) and
# CPU <-> GPU server pairs (pair-cpu-gpu: a CPU prefill with bf16 K/V feeding a GPU decode and
# the reverse, through the router, equal to a colocated CPU server's answers), `kvstage bench
# engine --device cuda`;
# `kvstage sim --device cuda` and `kvstage demo --device cuda`
# (prefill on GPU 0, decode on GPU 1 when there are two); `kvstage bench transfer` (table, and
# JSON in $LOGS/bench-transfer.json for bench/plot_transfer.py), `kvstage bench kernels` and
# `kvstage bench transfer --transport ucx` (host memory, this machine's CPUs); then
# compute-sanitizer memcheck (with leak check) on the GPU tests, racecheck and initcheck on the
# copy test and racecheck on the GPU simulation; prints a summary. Logs go to $LOGS (default
# $BUILD/gpu-check/).
# Environment: BUILD (default build-gpu), JOBS (default nproc), SAN_ITERS (random cases per
# sanitizer run, default 100), BENCH_ARGS (extra flags for bench kernels), TRANSFER_ARGS (extra
# flags for bench transfer), DEPS_DIR (default build-deps), CMAKE_ARGS (extra configure flags,
# e.g. -DKVS_WERROR=OFF), SKIP (space-separated step names to leave out, e.g. "racecheck
# initcheck bench"), STEP_TIMEOUT (seconds per sanitizer or benchmark step, default 900), LOGS,
# REUSE_BUILD=1 (keep an existing $BUILD and only rebuild what changed: for a second run on the
# same machine).
# `bash scripts/gpu-check.sh --serve-steps` runs only serve-cuda and pair-cpu-gpu against the
# kvstage already in $BUILD; with SERVE_DEVICE=cpu every server runs on the CPU (a dry run of
# those steps on a machine without a GPU).
#
# GPU machines without internet often lack the project's dev packages (cmocka, ZeroMQ, UCX
# headers, pkg-config). On a Debian/Ubuntu machine with apt, `bash scripts/gpu-check.sh
# --fetch-deps` downloads them as .deb files into DEPS_DIR (ignored by git); bring that folder
# along and this script unpacks it into the build dir (nothing is installed system-wide) when
# pkg-config cannot find them.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
SAN_ITERS=${SAN_ITERS:-100}
BENCH_ARGS=${BENCH_ARGS:-}
TRANSFER_ARGS=${TRANSFER_ARGS:-}
CMAKE_ARGS=${CMAKE_ARGS:-}
SKIP=${SKIP:-}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
DEPS_DIR=${DEPS_DIR:-build-deps}
LOGS=${LOGS:-$BUILD/gpu-check}
DEP_PKGS=(libcmocka0 libcmocka-dev libzmq5 libzmq3-dev libsodium23 libpgm-5.3-0 libnorm1 libucx0
    libucx-dev libnuma1 libibverbs1 librdmacm1 pkgconf-bin libpkgconf3
    libmicrohttpd12 libmicrohttpd-dev libjansson4 libjansson-dev libcurl4 libcurl4-openssl-dev
    libgnutls30 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libbrotli1 libidn2-0 libldap-2.5-0
    libsasl2-2 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libunistring2)

if [ "${1:-}" = "--fetch-deps" ]; then
    mkdir -p "$DEPS_DIR" && cd "$DEPS_DIR" && apt-get download "${DEP_PKGS[@]}" || exit 1
    echo "gpu-check: dependencies in $DEPS_DIR; carry that folder to the GPU machine"
    exit 0
fi

have_deps() {
    command -v pkg-config >/dev/null 2>&1 &&
        pkg-config --exists libzmq ucx cmocka libmicrohttpd jansson libcurl
}

# Unpacks DEPS_DIR/*.deb under $BUILD/deps and points pkg-config, the linker and the loader
# there. The .pc files are rewritten to the new prefix, and libzmq's private requirements
# (only for static links) are dropped so their dev packages are not needed.
use_carried_deps() {
    local d=$BUILD/deps
    case $d in /*) ;; *) d=$(pwd)/$d ;; esac
    mkdir -p "$d"
    for f in "$DEPS_DIR"/*.deb; do dpkg -x "$f" "$d" || return 1; done
    local lib=$d/usr/lib/x86_64-linux-gnu
    for pc in "$lib"/pkgconfig/*.pc; do
        sed -i -e "s#/usr#$d/usr#g" -e '/^Requires.private:/d' "$pc"
    done
    [ -e "$d/usr/bin/pkg-config" ] || ln -s pkgconf "$d/usr/bin/pkg-config"
    command -v pkg-config >/dev/null 2>&1 || export PATH=$d/usr/bin:$PATH
    export PKG_CONFIG_PATH=$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export UCX_MODULE_DIR=$lib/ucx
    echo "using carried dependencies from $DEPS_DIR (unpacked in $d)"
}

names=()
verdicts=()
failed=0

skipped() {
    case " $SKIP " in *" $1 "*) return 0 ;; esac
    return 1
}

# step NAME CMD...: runs CMD with its output in $LOGS/NAME.log (and on the terminal); steps
# named in SKIP are left out (and listed as skipped).
step() {
    local name=$1
    shift
    if skipped "$name"; then
        names+=("$name")
        verdicts+=("skipped (SKIP)")
        return 0
    fi
    echo
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    local verdict="PASS"
    [ "$rc" -ne 0 ] && verdict="FAIL (exit $rc)"
    names+=("$name")
    verdicts+=("$verdict  [$((SECONDS - t0)) s]")
    [ "$rc" -ne 0 ] && failed=1
    return "$rc"
}

# mark NAME VERDICT: a result decided by inspecting a log rather than an exit code.
mark() {
    names+=("$1")
    verdicts+=("$2")
    case $2 in PASS*) ;; *) failed=1 ;; esac
}

summary() {
    echo
    echo "================ gpu-check summary ================"
    for i in "${!names[@]}"; do printf '  %-22s %s\n' "${names[$i]}" "${verdicts[$i]}"; done
    if [ -f "$LOGS/bench.log" ]; then
        echo
        grep -E '^(GPU|summary|check):' "$LOGS/bench.log" | sed 's/^/  bench /'
    fi
    if [ -f "$LOGS/bench-transfer.log" ]; then
        echo
        grep -E '^(hardware|summary|check):' "$LOGS/bench-transfer.log" | sed 's/^/  transfer /'
    fi
    if [ -f "$LOGS/bench-ucx.log" ]; then
        echo
        grep -E '^(hardware|summary|check):' "$LOGS/bench-ucx.log" | sed 's/^/  ucx /'
    fi
    echo
    if [ "$failed" -eq 0 ]; then echo "gpu-check: ALL PASSED"; else echo "gpu-check: FAILED"; fi
    echo "logs: $LOGS/"
}

# ---- serving steps (serve-cuda, pair-cpu-gpu): servers, routers and clients on this host ----
# The model file (also for --serve-steps).
MODEL_FILE=${KVS_MODEL:-${KVS_CACHE_DIR:-$HOME/.cache/kvstage}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
SRV_PIDS=()   # servers and routers the current step started, in start order
SRV_URL=""    # start_srv: the started one's http://HOST:PORT
SRV_BOOT=""   # start_srv: a prefill server's bootstrap registry endpoint

# The pids whose parent is $1 (from /proc: no procps needed).
children_of() {
    local f l pid
    for f in /proc/[0-9]*/stat; do
        l=$(cat "$f" 2>/dev/null) || continue
        pid=${f#/proc/}
        pid=${pid%/stat}
        l=${l##*) }
        # shellcheck disable=SC2086 # the stat fields after the name, split
        set -- "$1" $l
        [ "$3" = "$1" ] && echo "$pid"
    done
}

# start_srv TAG ARGS...: `kvstage ARGS` in the background, its output in $LOGS/$STEP_NAME-TAG.log,
# until it prints "serving on" / "routing on" (300 s at most; exiting first is a failure). Every
# port is a free one the process picked itself (--port 0, the registry's default) and printed.
start_srv() {
    local tag=$1 log="$LOGS/$STEP_NAME-$1.log" pid t
    shift
    "$BUILD/kvstage" "$@" >"$log" 2>&1 </dev/null &
    pid=$!
    SRV_PIDS+=("$pid")
    echo "  $tag (pid $pid): kvstage $*"
    for ((t = 0; t < 3000; t++)); do
        if grep -qE '^(serving|routing) on http' "$log" 2>/dev/null; then
            SRV_URL=$(grep -oE '^(serving|routing) on http://[0-9.]+:[0-9]+' "$log" | head -n 1)
            SRV_URL=${SRV_URL#* on }
            SRV_BOOT=$(grep -oE 'bootstrap tcp://[0-9.]+:[0-9]+' "$log" | head -n 1)
            SRV_BOOT=${SRV_BOOT#bootstrap }
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid"
            echo "  $tag exited (status $?) before it was ready; its log ($log):"
            tail -n 20 "$log" | sed 's/^/    /'
            return 1
        fi
        sleep 0.1
    done
    echo "  $tag not ready within 300 s; its log ($log):"
    tail -n 20 "$log" | sed 's/^/    /'
    return 1
}

# Stops what the step started, newest first: SIGTERM, 30 s, then SIGKILL, each by pid and
# reaped; then every process a server had launched (its ranks) must be gone too: one left
# behind is reported, killed by its pid, and fails the step.
stop_all() {
    local rc=0 i pid kids k t
    for ((i = ${#SRV_PIDS[@]} - 1; i >= 0; i--)); do
        pid=${SRV_PIDS[$i]}
        kids=$(children_of "$pid")
        kill -TERM "$pid" 2>/dev/null
        for ((t = 0; t < 300 && $(kill -0 "$pid" 2>/dev/null && echo 1 || echo 0); t++)); do
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "  pid $pid did not exit within 30 s of SIGTERM: killed"
            kill -KILL "$pid" 2>/dev/null
            rc=1
        fi
        wait "$pid" 2>/dev/null
        for k in $kids; do
            for ((t = 0; t < 100 && $(kill -0 "$k" 2>/dev/null && echo 1 || echo 0); t++)); do
                sleep 0.1
            done
            if kill -0 "$k" 2>/dev/null; then
                echo "  orphan: pid $k ($(tr '\0' ' ' </proc/"$k"/cmdline 2>/dev/null)) outlived its server $pid: killed"
                kill -KILL "$k" 2>/dev/null
                rc=1
            fi
        done
    done
    SRV_PIDS=()
    return "$rc"
}

# http_post URL BODY OUT: the answer's body in OUT; fails unless the status is 200. curl, or
# Python's urllib where curl is missing.
http_post() {
    local code
    if command -v curl >/dev/null 2>&1; then
        # the system's curl with the system's libraries, not the carried dependencies'
        code=$(env -u LD_LIBRARY_PATH curl -sS -N --max-time 300 -o "$3" -w '%{http_code}' \
            -H 'Content-Type: application/json' -d "$2" "$1") || code="no answer (curl failed)"
    elif command -v python3 >/dev/null 2>&1; then
        code=$(python3 - "$1" "$2" "$3" <<'PY'
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(),
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        body, code = r.read(), r.status
except urllib.error.HTTPError as e:
    body, code = e.read(), e.code
except Exception as e:
    body, code = str(e).encode(), "no answer (%s)" % e
open(sys.argv[3], "wb").write(body)
print(code)
PY
        )
    else
        echo "  neither curl nor python3 is here: no HTTP client"
        return 1
    fi
    [ "$code" = "200" ] && return 0
    echo "  POST $1 -> $code: $(head -c 400 "$3" 2>/dev/null)"
    return 1
}

# The generated text of an answer: its "text" or "content" strings in order (a streamed
# answer's deltas joined), JSON escapes left as they are.
answer_text() {
    grep -oE '"(text|content)":"([^"\\]|\\.)*"' "$1" | sed -E 's/^"(text|content)":"//; s/"$//' |
        tr -d '\n'
}

# ask TAG URL: the step's requests (completion and chat, streamed and not, greedy), each
# answer's text in $LOGS/$STEP_NAME-TAG-K.txt; fails on a failed or empty answer.
SERVE_PROMPT="The capital of France is"
SERVE_CHAT="What is the capital of France? Answer in one sentence."
ask() {
    local tag=$1 url=$2 k=0 path body out
    for req in "completions|{\"prompt\":\"$SERVE_PROMPT\",\"max_tokens\":24,\"temperature\":0}" \
        "completions|{\"prompt\":\"$SERVE_PROMPT\",\"max_tokens\":24,\"temperature\":0,\"stream\":true}" \
        "chat/completions|{\"messages\":[{\"role\":\"user\",\"content\":\"$SERVE_CHAT\"}],\"max_tokens\":24,\"temperature\":0}" \
        "chat/completions|{\"messages\":[{\"role\":\"user\",\"content\":\"$SERVE_CHAT\"}],\"max_tokens\":24,\"temperature\":0,\"stream\":true}"; do
        k=$((k + 1))
        path=${req%%|*}
        body=${req#*|}
        out="$LOGS/$STEP_NAME-$tag-$k"
        http_post "$url/v1/$path" "$body" "$out.json" || return 1
        answer_text "$out.json" >"$out.txt"
        if [ ! -s "$out.txt" ]; then
            echo "  $tag request $k ($path): no text in the answer ($out.json)"
            return 1
        fi
        echo "  $tag $k /v1/$path$(case $body in *stream*) echo ' (stream)' ;; esac): $(cat "$out.txt")"
    done
}

# same_answers TAG REF: every answer of TAG equals REF's, and a streamed answer its unstreamed
# twin.
same_answers() {
    local k bad=0
    for k in 1 2 3 4; do
        if ! cmp -s "$LOGS/$STEP_NAME-$1-$k.txt" "$LOGS/$STEP_NAME-$2-$k.txt"; then
            echo "  $1 request $k differs from $2's: '$(cat "$LOGS/$STEP_NAME-$1-$k.txt")' vs '$(cat "$LOGS/$STEP_NAME-$2-$k.txt")'"
            bad=1
        fi
    done
    for k in 1 3; do
        if ! cmp -s "$LOGS/$STEP_NAME-$1-$k.txt" "$LOGS/$STEP_NAME-$1-$((k + 1)).txt"; then
            echo "  $1: the streamed answer $((k + 1)) differs from the unstreamed $k"
            bad=1
        fi
    done
    return "$bad"
}

# pd_pair TAG PREFILL_ARGS -- DECODE_ARGS: a prefill server, a decode server bound to it and a
# router over them; asks the requests through the router; stops all three.
pd_pair() {
    local tag=$1 pre=() dec=() purl
    shift
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do pre+=("$1"); shift; done
    shift
    dec=("$@")
    start_srv "$tag-prefill" serve --role prefill --model "$MODEL_FILE" --port 0 "${pre[@]}" ||
        { stop_all; return 1; }
    purl=$SRV_URL
    [ -n "$SRV_BOOT" ] || { echo "  the prefill server printed no bootstrap"; stop_all; return 1; }
    start_srv "$tag-decode" serve --role decode --model "$MODEL_FILE" --port 0 \
        --bootstrap "$SRV_BOOT" "${dec[@]}" || { stop_all; return 1; }
    local durl=$SRV_URL
    start_srv "$tag-router" router --prefill "$purl" --decode "$durl" --port 0 ||
        { stop_all; return 1; }
    local rc=0
    ask "$tag" "$SRV_URL" || rc=1
    stop_all || rc=1
    return "$rc"
}

# serve-cuda: `kvstage serve --device $dev` (cuda; SERVE_DEVICE=cpu dry-runs it on a machine
# without a GPU) colocated, then prefill TP1 -> decode TP1 and prefill TP3 -> decode TP1 behind
# `kvstage router`, every server on GPU 0: the greedy answers of the disaggregated pairs equal
# the colocated server's, streamed and not; every process is stopped and reaped.
serve_cuda() {
    STEP_NAME=serve-cuda
    local dev=${SERVE_DEVICE:-cuda} on=()
    [ "$dev" = cuda ] && on=(--gpus 0)
    start_srv colocated serve --role colocated --model "$MODEL_FILE" --port 0 --device "$dev" \
        "${on[@]}" || { stop_all; return 1; }
    local rc=0
    ask colocated "$SRV_URL" || rc=1
    stop_all || rc=1
    [ "$rc" -eq 0 ] || return 1
    pd_pair tp1 --device "$dev" "${on[@]}" --tp 1 -- --device "$dev" "${on[@]}" || return 1
    same_answers tp1 colocated || rc=1
    pd_pair tp3 --device "$dev" "${on[@]}" --tp 3 -- --device "$dev" "${on[@]}" || return 1
    same_answers tp3 colocated || rc=1
    return "$rc"
}

# pair-cpu-gpu: a CPU prefill server with bf16 K/V feeding a GPU decode server, and a GPU
# prefill server feeding a CPU decode server (bf16), each through the router; their greedy
# answers equal a colocated CPU server's (bf16 K/V). SERVE_DEVICE=cpu dry-runs it with CPU
# servers on both sides. The KV between a host pool and a device pool goes through the net
# link's data plane; where that refuses the pair, the step fails naming the refusal.
pair_cpu_gpu() {
    STEP_NAME=pair-cpu-gpu
    local gdev=${SERVE_DEVICE:-cuda} gpu=() cpu=(--device cpu --kv-dtype bf16)
    gpu=(--device "$gdev")
    [ "$gdev" = cuda ] && gpu+=(--gpus 0)
    [ "$gdev" = cpu ] && gpu+=(--kv-dtype bf16)
    start_srv colocated serve --role colocated --model "$MODEL_FILE" --port 0 "${cpu[@]}" ||
        { stop_all; return 1; }
    local rc=0 tag
    ask colocated "$SRV_URL" || rc=1
    stop_all || rc=1
    [ "$rc" -eq 0 ] || return 1
    for tag in cpu-gpu gpu-cpu; do
        local pre=("${cpu[@]}") dec=("${gpu[@]}")
        [ "$tag" = gpu-cpu ] && pre=("${gpu[@]}") dec=("${cpu[@]}")
        if pd_pair "$tag" "${pre[@]}" -- "${dec[@]}"; then
            same_answers "$tag" colocated || rc=1
        else
            rc=1
            grep -hE 'need the same kind|cannot reach decode rank|INCOMPATIBLE|incompatible' \
                "$LOGS/$STEP_NAME-$tag"-*.log 2>/dev/null | sort -u | head -n 5 |
                sed "s/^/  $tag refused: /"
        fi
    done
    return "$rc"
}

# `bash scripts/gpu-check.sh --serve-steps`: only the two serving steps, against the kvstage
# already built in $BUILD (SERVE_DEVICE=cpu: with CPU servers, for a machine without a GPU).
if [ "${1:-}" = "--serve-steps" ]; then
    mkdir -p "$LOGS"
    [ -x "$BUILD/kvstage" ] || { echo "gpu-check: no $BUILD/kvstage (build it first)"; exit 1; }
    if [ -s "$MODEL_FILE" ]; then
        step serve-cuda serve_cuda
        step pair-cpu-gpu pair_cpu_gpu
    else
        mark serve-cuda "FAIL (no model at $MODEL_FILE)"
        mark pair-cpu-gpu "FAIL (no model at $MODEL_FILE)"
    fi
    summary
    exit "$failed"
fi

[ "${REUSE_BUILD:-0}" = 1 ] || rm -rf "$BUILD"
mkdir -p "$LOGS"

if ! have_deps; then
    if compgen -G "$DEPS_DIR/*.deb" >/dev/null; then
        use_carried_deps || {
            echo "gpu-check: could not unpack $DEPS_DIR"
            exit 1
        }
    fi
    if ! have_deps; then
        echo "gpu-check: missing build dependencies (pkg-config modules libzmq, ucx, cmocka, libmicrohttpd, jansson, libcurl)."
        echo "  On a Debian/Ubuntu machine with apt run: bash scripts/gpu-check.sh --fetch-deps"
        echo "  then bring $DEPS_DIR/ to this machine's checkout and run this script again."
        exit 1
    fi
fi

echo "=== machine"
nvidia-smi -L 2>&1 || echo "(nvidia-smi not available)"
command -v nvcc >/dev/null 2>&1 || export PATH=/usr/local/cuda/bin:$PATH
nvcc --version 2>&1 | tail -n 2

# shellcheck disable=SC2086 # CMAKE_ARGS is a flag list
if ! step configure cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVS_CUDA=ON \
    $CMAKE_ARGS; then
    summary
    exit 1
fi
if ! grep -q "CUDA backend enabled" "$LOGS/configure.log"; then
    mark cuda-enabled "FAIL (configure did not find nvcc; see $LOGS/configure.log)"
    summary
    exit 1
fi
if ! step build cmake --build "$BUILD" -j "$JOBS"; then
    summary
    exit 1
fi

# The tests that read the embedded model need its GGUF (scripts/setup.sh fetches it; the GPU
# machine has no registry access): without it they are left out here, and said so.
CTEST_EXCLUDE=()
if [ ! -s "$MODEL_FILE" ]; then
    echo "gpu-check: no model at $MODEL_FILE: the model tests are left out of ctest"
    CTEST_EXCLUDE=(-E "test_forward|test_tokenizer|test_gguf|test_generate|test_serve")
fi
step ctest bash -c "cd '$BUILD' && ctest --output-on-failure -j '$JOBS' ${CTEST_EXCLUDE[*]@Q}"

# Each GPU test alone, verbose: on a GPU machine nothing may be skipped.
export KVS_TOOL=$(pwd)/$BUILD/kvstage
GPU_TESTS=(test_copy_cuda test_mem test_sim_gpu test_cuda_ipc test_rank_processes test_forward_cuda
    test_llm_cuda)
for t in "${GPU_TESTS[@]}"; do
    if step "$t" "$BUILD/$t" && ! skipped "$t"; then
        if grep -q "SKIPPED" "$LOGS/$t.log"; then
            mark "$t-ran" "FAIL (tests were skipped: no GPU visible to the CUDA runtime?)"
        else
            mark "$t-ran" "PASS (no test skipped)"
        fi
    fi
done

# The Python package's device pools (python/tests/test_gpu.py: torch tensors on the GPUs, a room
# over the in-process link, examples/handoff.py --device cuda over CUDA IPC). Needs the venv of
# scripts/setup.sh with torch added (KVS_VENV names another); none of it may skip.
if step py-gpu python/tests/run.sh "$BUILD" test_gpu.py -rs && ! skipped py-gpu; then
    if grep -qi "skipped" "$LOGS/py-gpu.log"; then
        mark py-gpu-ran "FAIL (the Python GPU tests were skipped: no venv, torch or GPU?)"
    else
        mark py-gpu-ran "PASS (no test skipped)"
    fi
fi

GPUS=0,0
[ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -gt 1 ] && GPUS=0,1
step sim-cuda "$BUILD/kvstage" sim --device cuda --gpus "$GPUS"
step demo-cuda "$BUILD/kvstage" demo --device cuda --gpus "$GPUS"

# The real model on GPUs (model/cuda): SmolLM2 greedy, colocated on the GPU, disaggregated GPU
# -> GPU (TP1 -> TP1 and TP3 -> TP1, the KV through CUDA IPC) and on the CPU; every run must
# succeed and the three GPU runs must give the same tokens.
generate_cuda() {
    local p=504,3575,282,4649,314,28,1041,314,253,1345,30,198,198,504,3575,282,4649,314 ids=()
    for mode in "--colocated" "--prefill-tp 1" "--prefill-tp 3"; do
        # shellcheck disable=SC2086 # mode is a flag list
        "$BUILD/kvstage" generate --device cuda --gpus "$GPUS" $mode --max-tokens 24 \
            --prompt-ids "$p" --json >"$LOGS/generate-cuda.json" || return 1
        ids+=("$(grep -o '"ids":\[[0-9,]*\]' "$LOGS/generate-cuda.json")")
        echo "generate --device cuda $mode: ${ids[-1]}"
    done
    [ "${ids[0]}" = "${ids[1]}" ] && [ "${ids[0]}" = "${ids[2]}" ] || {
        echo "generate-cuda: the GPU runs differ"
        return 1
    }
    # Sampled on the device (temperature, top-k, top-p, a seed): colocated and disaggregated
    # compute the same logits, so they draw the same tokens.
    local sampled=()
    for mode in "--colocated" "--prefill-tp 1"; do
        # shellcheck disable=SC2086 # mode is a flag list
        "$BUILD/kvstage" generate --device cuda --gpus "$GPUS" $mode --max-tokens 24 \
            --temperature 0.8 --top-p 0.9 --top-k 40 --seed 11 --prompt-ids "$p" --json \
            >"$LOGS/generate-cuda.json" || return 1
        sampled+=("$(grep -o '"ids":\[[0-9,]*\]' "$LOGS/generate-cuda.json")")
        echo "generate --device cuda $mode, sampled: ${sampled[-1]}"
    done
    [ "${sampled[0]}" = "${sampled[1]}" ] || {
        echo "generate-cuda: sampled colocated and disaggregated runs differ"
        return 1
    }
}
if [ -s "$MODEL_FILE" ]; then
    step generate-cuda generate_cuda
    step serve-cuda serve_cuda
    step pair-cpu-gpu pair_cpu_gpu
else
    mark generate-cuda "FAIL (no model at $MODEL_FILE)"
    mark serve-cuda "FAIL (no model at $MODEL_FILE)"
    mark pair-cpu-gpu "FAIL (no model at $MODEL_FILE)"
fi
step bench-engine timeout "$STEP_TIMEOUT" "$BUILD/kvstage" bench engine --device cuda

# shellcheck disable=SC2086 # TRANSFER_ARGS is a flag list
step bench-transfer timeout "$STEP_TIMEOUT" "$BUILD/kvstage" bench transfer --device cuda \
    $TRANSFER_ARGS
# shellcheck disable=SC2086 # TRANSFER_ARGS is a flag list
skipped bench-transfer || timeout "$STEP_TIMEOUT" "$BUILD/kvstage" bench transfer --device cuda \
    $TRANSFER_ARGS --json >"$LOGS/bench-transfer.json" 2>/dev/null
# shellcheck disable=SC2086 # BENCH_ARGS is a flag list
step bench timeout "$STEP_TIMEOUT" "$BUILD/kvstage" bench kernels $BENCH_ARGS
step bench-ucx timeout "$STEP_TIMEOUT" "$BUILD/kvstage" bench transfer --transport ucx

# Sanitizers last: they are the slowest steps.
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$SAN" ]; then
    # The cross-process test forks: the sanitizer follows the child too.
    for t in test_cuda_ipc test_mem test_sim_gpu; do
        step "memcheck-$t" timeout "$STEP_TIMEOUT" "$SAN" --tool memcheck --leak-check full \
            --target-processes all --error-exitcode 99 "$BUILD/$t"
    done
    export KVS_ITERS=$SAN_ITERS
    step memcheck timeout "$STEP_TIMEOUT" "$SAN" --tool memcheck --leak-check full \
        --error-exitcode 99 "$BUILD/test_copy_cuda"
    step racecheck timeout "$STEP_TIMEOUT" "$SAN" --tool racecheck --error-exitcode 99 \
        "$BUILD/test_copy_cuda"
    step initcheck timeout "$STEP_TIMEOUT" "$SAN" --tool initcheck --error-exitcode 99 \
        "$BUILD/test_copy_cuda"
    step racecheck-sim timeout "$STEP_TIMEOUT" "$SAN" --tool racecheck --error-exitcode 99 \
        "$BUILD/test_sim_gpu"
    # The model's kernels: every test under memcheck, the shapes (both head dims, split and
    # direct attention) under racecheck.
    step memcheck-forward timeout "$STEP_TIMEOUT" "$SAN" --tool memcheck --leak-check full \
        --error-exitcode 99 "$BUILD/test_forward_cuda"
    # racecheck reports hazards inside cuBLAS's Hopper GEMMs (nvjet_*), which are not ours;
    # any other hazard fails the step (filtering them out with --kernel-name made the sanitizer
    # itself fail on the captured graphs).
    racecheck_forward() {
        timeout "$STEP_TIMEOUT" "$SAN" --tool racecheck "$BUILD/test_forward_cuda" test_shapes
    }
    if step racecheck-forward racecheck_forward && ! skipped racecheck-forward; then
        if grep "Race reported" "$LOGS/racecheck-forward.log" | grep -qv nvjet_; then
            mark racecheck-forward-ours "FAIL (a hazard in kvstage's kernels)"
        else
            mark racecheck-forward-ours "PASS (hazards only in cuBLAS's kernels, if any)"
        fi
    fi
    unset KVS_ITERS
else
    mark compute-sanitizer "FAIL (compute-sanitizer not found)"
fi

summary
exit "$failed"

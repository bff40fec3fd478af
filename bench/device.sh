#!/usr/bin/env bash
# The benchmark runs of one device-tool call, by phase (see bench/NOTES.md for what each measured):
#   bash bench/device.sh gpu-tests[-1|-2|-3]|gemm|checkpoint|checkpoint-async|1b-1gpu|1b-2gpu|8b-2gpu|8b-mb2|8b-mb2-noac|1b-mbN
#                        |fp8-1gpu|fp8-rowwise-1gpu|fp8-2gpu|fp8-8b|fp8-ag-2gpu|fp8-ag-8b|correctness-fp8
#                        |side-1gpu|side-2gpu|restart|slurm-gpu|hf-roundtrip|hf-roundtrip-2gpu
#                        |attention|side-bf16|side-fp8|ab-bf16|ab-restart[-N]|head-bf16[-N]|restart[-N]|correctness|correctness-mb32
#                        |startup-profile|compile-site|wrapped-bf16[-N]|cdt-bf16|optimizer-step|master-tests|requeue-ab[-N]
#                        |cuda-start|context-tests|requeue-env[-N]|autotune-bf16[-N]|ce-head[-N]|ce-head-ab[-N]|lce-tests|profile|profile-fp8|kernel-sources
#                        |rope|rope-tests|guards-tests|ab-fp8|head-fp8[-N]|map-fp8[-N]|kernel-sources-fp8|kernel-bench-fp8
#                        |register-probe|register-tests|checksum
# Needs the wheels of ../shared/tools/device-wheels.sh in .whl/ (carried with the call) and $OUT;
# google-crc32c's wheel too (a dependency since attempt 65: `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux2014_x86_64 -d .whl google-crc32c`);
# the fp8 phases need torchao's wheel there too (0.18.0 worked with the device image's torch 2.11);
# side-* need the torchtitan reference folder copied to .titan/ (and its wheels in .whl/), slurm-gpu
# the bundle of tests/slurm/bundle.sh in .slurm-bundle/slurm.tar.gz; ab-bf16 the files of the other
# side of an A/B under .ab/ (git-ignored, carried; paths as in the repository, e.g.
# .ab/pretrain/models/llama.py from the commit before a model change), laid over a copy of the package; startup-profile py-spy's wheel in .whl/.
# Results and logs go to /tmp/results, packed at the end into $OUT/results.tgz (the device tool brings
# back only a few files); unpack it into bench/results/ afterwards.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD
# Once per machine: several calls of this script may run side by side on different GPUs.
if [ ! -e /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.installed
fi
# The device tool's NVLink multicast must stay off (its KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 WANDB_MODE=disabled
# Name the commit in the call (BENCH_COMMIT=$(git rev-parse --short HEAD), run here, typed into the command):
# the device tool copies the working tree, but the git history there was seen to be the session's first
# checkout (2026-12-04: results of 0e88641 named 8e52c8c), so the fallback can name an older commit.
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
results=/tmp/results
mkdir -p "$results"
# Packed after every phase as well: a phase the call's time limit (or a `timeout` around this script) kills
# takes the EXIT trap with it, and the phases before it would otherwise come back with nothing (2026-12-06).
pack() { tar -czf "$OUT/results.tgz" -C /tmp results; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$results/machine.txt"

# The other side of an A/B: the package as it is, with the files under .ab/ (paths as in the repository) over it.
# AB names another folder of such files (default .ab), for a third side in one call.
ab_tree() { rm -rf /tmp/ab && mkdir /tmp/ab && cp -r pretrain conf pyproject.toml /tmp/ab/ && cp -r "${AB:-.ab}"/. /tmp/ab/; }
# Extra arguments of every restart phase, e.g. RESTART_ARGS="--repeats 2 --every 5 --skip-empty-cache".
RESTART_ARGS=${RESTART_ARGS:-}
# A test phase: pytest's log written into $OUT as it runs, since a call's limit that stops the tests can stop the
# packing too (2026-12-06: 94 tests passed and their log did not come back), then copied among the results.
run_tests() {
  local log="$OUT/test_$1-$BENCH_COMMIT.log"; shift
  python3 -m pytest -q -p no:cacheprovider -rs "$@" > "$log" 2>&1
  cp "$log" "$results/"; tail -3 "$log"
}

for phase in "$@"; do
  echo "== $phase $(date +%T)"
  case $phase in
    gpu-tests|gpu-tests-1|gpu-tests-2|gpu-tests-3)  # all GPU tests; -1, -2 and -3 split them in three, since all
                # took longer than one call's 10 minutes on an H100 on 2026-12-06, and the last two together
                # more than 8 minutes later that day (tests/test_gpu.py in -1, the kernels' tests in -3); at 2c4de4f,
                # another H100, they took about 4, 1.5 and 4 minutes: -1 and -2 in one call, -3 in another
                first="tests/test_gpu.py"
                second="tests/test_components.py tests/test_checkpoint_files.py tests/test_master_adamw.py
                  tests/test_cuda_context.py tests/test_allocator.py"
                third="tests/test_linear_cross_entropy.py tests/test_rope.py tests/test_guards.py"
                case $phase in
                  gpu-tests-1) tests=$first ;; gpu-tests-2) tests=$second ;; gpu-tests-3) tests=$third ;;
                  *) tests="$first $second $third" ;;
                esac
                run_tests "$phase" $tests ;;
    master-tests)  # one process's master weights and their optimizer, against FSDP2 at one rank, and resumed
                run_tests master tests/test_master_adamw.py \
                  "tests/test_gpu.py::test_one_gpu_trains_compiled_and_unwrapped_as_fsdp_does" \
                  "tests/test_gpu.py::test_one_gpu_resumes_its_optimizer_state" ;;
    context-tests)  # the CUDA context made in a thread during the job's imports, on the GPU torch then drives
                run_tests cuda_context tests/test_cuda_context.py ;;
    cuda-start) python3 bench/cuda_start.py --repeats ${CUDA_START_REPEATS:-5} --name "cuda-start-$BENCH_COMMIT" \
                  --out "$results" 2>&1 | tail -8 ;;
    ce-head)    # the model's head (final norm, output layer, loss) with and without the fused kernel (attempt 49)
                python3 bench/cross_entropy_head.py --sweep --name "cross-entropy-head-$BENCH_COMMIT" --out "$results" \
                  2>&1 | tail -16 ;;
    ce-head-ab*)  # the same without the sweep, for the package with the files of .ab laid over it
                ab_tree && PYTHONPATH=/tmp/site:/tmp/ab python3 bench/cross_entropy_head.py \
                  --name "cross-entropy-head-ab-$BENCH_COMMIT${phase#ce-head-ab}" --out "$results" 2>&1 | tail -4 ;;
    ce-head-*)  python3 bench/cross_entropy_head.py --name "cross-entropy-head-$BENCH_COMMIT${phase#ce-head}" \
                  --out "$results" 2>&1 | tail -4 ;;
    rope)       # RoPE's kernel against the compiled tensor operations, one block's queries and keys (attempt 51)
                python3 bench/rope.py --sweep --name "rope-$BENCH_COMMIT" --out "$results" 2>&1 | tail -22 ;;
    guards-tests)  # the skipped-step flag readable before the update it decides (attempt 53)
                run_tests guards tests/test_guards.py ;;
    rope-tests) run_tests rope tests/test_rope.py ;;
    register-tests)  # loads from files registered with CUDA, alone and in a resumed job (attempt 57)
                run_tests register tests/test_gpu.py -k "registered or loads_into_the_gpu_exactly or resumes_its_optimizer" ;;
    register-probe)  # what registering a file's page-cache pages with CUDA costs and gives (attempt 57, unmeasured)
                python3 bench/host_register_probe.py --size-gib ${PROBE_GIB:-4} --name "host-register-probe-$BENCH_COMMIT" \
                  --out "$results" 2>&1 | grep -v Warning | tail -8 ;;
    lce-tests)  run_tests lce tests/test_linear_cross_entropy.py \
                  "tests/test_gpu.py::test_compiled_loss_matches_eager_on_fp16_logits" ;;
    profile|profile-fp8)  # one step's GPU time by kernel and the GPU's idle gaps, through the Trainer (1B,
                # micro-batch 8, bf16; -fp8: FP8 tensorwise, torchao's wheel in .whl/). PROFILE_ARGS adds options
                # (e.g. "--inductor triton.prefer_nd_tiling=True"), PROFILE_TAG a suffix to the result's name.
                name="profile-1b-mb8${phase#profile}${PROFILE_TAG:-}-$BENCH_COMMIT"
                python3 bench/profile_step.py --name "$name" --out "$results" --runs /tmp/bench-runs ${PROFILE_ARGS:-} \
                  $([ "$phase" = profile-fp8 ] && echo precision=fp8) 2>&1 | tail -3; sed -n 6,40p "$results/$name.md" ;;
    kernel-sources)  # Inductor's generated code of the bf16 runs of this call (which kernel fuses what)
                mkdir -p "$results/kernels-$BENCH_COMMIT"
                grep -rl --include='*.py' -e 'triton_per_fused' -e 'triton_red_fused' /tmp/bench-runs/*bf16*/cache/compile \
                  2>/dev/null | head -40 | xargs -r cp -t "$results/kernels-$BENCH_COMMIT"
                ls "$results/kernels-$BENCH_COMMIT" | wc -l ;;
    kernel-sources-fp8)  # the same for the FP8 runs of this call (profile-fp8, head-fp8): the compiled graphs'
                # modules (each holds its kernels' sources) that cast to FP8 (their maximum's pass, the cast with
                # the transposed copy the weight gradient reads)
                kernels="$results/kernels-fp8${PROFILE_TAG:-}-$BENCH_COMMIT"; mkdir -p "$kernels"
                grep -rl --include='*.py' -e 'def call(' /tmp/bench-runs/*fp8*${PROFILE_TAG:-}-$BENCH_COMMIT/cache/compile \
                  2>/dev/null | xargs -r grep -l -e 'fp8e4nv' -e 'fp8e5' | head -20 | xargs -r cp -t "$kernels"
                ls "$kernels" | wc -l ;;
    kernel-bench-fp8)  # after profile-fp8 run with TORCHINDUCTOR_BENCHMARK_KERNEL=1: each of its kernels whose name
                # matches KERNEL_PATTERN (default: FP8 casts) run alone from its own file (the one with Inductor's
                # harness, get_args; not a graph's module): its time and GB/s, then the time of each configuration
                # its autotuner would choose from. (8ac5cff's call picked the copies without the harness; the
                # selection was fixed afterwards and checked on that call's files, not yet run on a GPU)
                kernels="$results/kernels-fp8${PROFILE_TAG:-}-$BENCH_COMMIT"; mkdir -p "$kernels"
                for file in $(grep -rlE --include='*.py' "^def (${KERNEL_PATTERN:-triton_.*_scaled_mm_.*})\(" \
                    /tmp/bench-runs/*fp8*${PROFILE_TAG:-}-$BENCH_COMMIT/cache/compile 2>/dev/null \
                    | xargs -r grep -l '^def get_args' | xargs -r grep -L 'def benchmark_compiled_module' | head -16); do
                  cp "$file" "$kernels/"
                  echo "$(grep -oE '^def triton_[a-z0-9_]+' "$file" | head -1) $(basename "$file"): $(timeout 60 python3 "$file" 2>&1 | tail -1)"
                  timeout 120 python3 -c "import importlib.util as u, sys; s = u.spec_from_file_location('k', sys.argv[1]); \
m = u.module_from_spec(s); s.loader.exec_module(m); print('  configs:', m.benchmark_all_configs(m.get_args()))" "$file" 2>&1 | tail -1
                done | tee "$results/kernel-bench-fp8${PROFILE_TAG:-}-$BENCH_COMMIT.txt" ;;
    optimizer-step) python3 bench/optimizer_step.py --name "optimizer-step-$BENCH_COMMIT" --out "$results" 2>&1 | tail -6 ;;
    gemm)       python3 bench/gemm_shapes.py --out "$results" 2>&1 | sed -n 1,16p ;;
    checkpoint) python3 bench/checkpoint_cost.py --async-every 110 --async-steps 240 \
                  --out "$results" --runs /tmp/bench-runs 2>&1 | tail -12 ;;
    checkpoint-async) python3 bench/checkpoint_cost.py --async-only --name checkpoint_async --async-every 110 --async-steps 240 \
                  --out "$results" --runs /tmp/bench-runs 2>&1 | tail -12 ;;
    8b-mb2)     python3 bench/throughput.py 8b-2gpu --name 8b-2gpu-mb2 --out "$results" train.micro_batch=2 2>&1 | tail -6 ;;
    8b-mb2-noac) python3 bench/throughput.py 8b-2gpu --name 8b-2gpu-mb2-noac --out "$results" train.micro_batch=2 \
                  fsdp.activation_checkpointing=none 2>&1 | tail -6 ;;
    1b-1gpu|1b-2gpu|8b-2gpu) python3 bench/throughput.py $phase --out "$results" 2>&1 | tail -4 ;;
    fp8-1gpu)   python3 bench/throughput.py 1b-1gpu --name 1b-1gpu-fp8 --out "$results" precision=fp8 2>&1 | tail -4 ;;
    fp8-rowwise-1gpu) python3 bench/throughput.py 1b-1gpu --name 1b-1gpu-fp8-rowwise --out "$results" precision=fp8 \
                  precision.float8=rowwise 2>&1 | tail -4 ;;
    fp8-2gpu)   python3 bench/throughput.py 1b-2gpu --name 1b-2gpu-fp8 --out "$results" precision=fp8 2>&1 | tail -4 ;;
    fp8-8b)     python3 bench/throughput.py 8b-2gpu --name 8b-2gpu-mb2-fp8 --out "$results" train.micro_batch=2 \
                  precision=fp8 2>&1 | tail -4 ;;
    fp8-ag-2gpu) # FSDP2's all-gathers in FP8 against fp8-2gpu's bf16 ones (run both in one call)
                python3 bench/throughput.py 1b-2gpu --name "1b-2gpu-fp8-ag-$BENCH_COMMIT" --out "$results" precision=fp8 \
                  precision.float8_all_gather=true 2>&1 | tail -4 ;;
    fp8-ag-8b)  python3 bench/throughput.py 8b-2gpu --name "8b-2gpu-mb2-fp8-ag-$BENCH_COMMIT" --out "$results" \
                  train.micro_batch=2 precision=fp8 precision.float8_all_gather=true 2>&1 | tail -4 ;;
    correctness-fp8) python3 bench/correctness.py --runs-of bf16 fp8 fp8-rowwise --name correctness-fp8 \
                  --out "$results" 2>&1 | tail -8 ;;
    hf-roundtrip|hf-roundtrip-2gpu)  # transformers and safetensors: the device image's
                gpus=1; [ "$phase" = hf-roundtrip-2gpu ] && gpus=2
                python3 bench/hf_roundtrip.py --gpus $gpus --out "$results" 2>&1 | tail -24 ;;
    1b-mb*)     mb=${phase#1b-mb}
                python3 bench/throughput.py 1b-1gpu --name 1b-1gpu-mb$mb --out "$results" train.micro_batch=$mb 2>&1 | tail -4 ;;
    side-1gpu)  python3 bench/side_by_side.py --titan .titan 1b-1gpu-bf16 1b-1gpu-fp8 --suffix="-$BENCH_COMMIT" --out "$results" \
                  2>&1 | tail -6 ;;
    side-2gpu)  python3 bench/side_by_side.py --titan .titan 1b-2gpu-bf16 8b-2gpu-mb2-bf16 --out "$results" 2>&1 | tail -4 ;;
    restart*)   python3 bench/restart.py --name "restart-1b-1gpu-$BENCH_COMMIT${phase#restart}" --out "$results" $RESTART_ARGS \
                  2>&1 | tail -8 ;;
    wrapped-bf16*)  # the same tree with FSDP2 at one rank (the A side of attempt 26)
                python3 bench/throughput.py 1b-1gpu --name "ours-1b-1gpu-bf16-wrapped-$BENCH_COMMIT${phase#wrapped-bf16}" \
                  --out "$results" fsdp.wrap_single_rank=true 2>&1 | tail -4 ;;
    cdt-bf16)   # Inductor's coordinate-descent tuning of its Triton kernels' launch settings (attempt 27)
                TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 python3 bench/throughput.py 1b-1gpu \
                  --name "ours-1b-1gpu-bf16-cdt-$BENCH_COMMIT" --out "$results" 2>&1 | tail -4 ;;
    map-fp8*)   # Inductor's pointwise autotuning (more block-size configurations for pointwise kernels only), for
                # FP8's casts, the transposing one at about 2 TB/s (attempt 56); run between head-fp8-1 and head-fp8-2
                TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1 python3 bench/throughput.py 1b-1gpu \
                  --name "ours-1b-1gpu-fp8-map-$BENCH_COMMIT${phase#map-fp8}" --out "$results" precision=fp8 2>&1 | tail -4 ;;
    autotune-bf16*)  # Inductor's GEMM autotuning: per shape, Triton's templates against cuBLAS, and the pointwise
                # work around a matmul (SwiGLU's product, a norm's scale, a residual add) fused into the template
                # where that measures faster. Attempt 48: +0.3%, within two runs' spread, for 151 s of compiling;
                # not adopted. Run between head-bf16-1 and head-bf16-2
                TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 python3 bench/throughput.py 1b-1gpu \
                  --name "ours-1b-1gpu-bf16-autotune-$BENCH_COMMIT${phase#autotune-bf16}" --out "$results" 2>&1 | tail -4 ;;
    head-bf16*) python3 bench/throughput.py 1b-1gpu --name "ours-1b-1gpu-bf16-$BENCH_COMMIT${phase#head-bf16}" \
                  --out "$results" 2>&1 | tail -4 ;;
    attention)  python3 bench/attention_check.py --name "attention-gqa-$BENCH_COMMIT" --out "$results" 2>&1 | tail -30 ;;
    side-fp8)   python3 bench/side_by_side.py --titan .titan 1b-1gpu-fp8 --suffix="-$BENCH_COMMIT" --out "$results" \
                  2>&1 | tail -4 ;;
    side-bf16)  python3 bench/side_by_side.py --titan .titan 1b-1gpu-bf16 --suffix="-$BENCH_COMMIT" --out "$results" \
                  2>&1 | tail -4 ;;
    ab-bf16)    ab_tree && python3 bench/throughput.py 1b-1gpu --repo /tmp/ab --name "ours-1b-1gpu-bf16-ab-$BENCH_COMMIT" \
                  --out "$results" 2>&1 | tail -4 ;;
    ab-fp8)     ab_tree && python3 bench/throughput.py 1b-1gpu --repo /tmp/ab --name "ours-1b-1gpu-fp8-ab-$BENCH_COMMIT" \
                  --out "$results" precision=fp8 2>&1 | tail -4 ;;
    head-fp8*)  python3 bench/throughput.py 1b-1gpu --name "ours-1b-1gpu-fp8-$BENCH_COMMIT${phase#head-fp8}" \
                  --out "$results" precision=fp8 2>&1 | tail -4 ;;
    ab-restart*) ab_tree && python3 bench/restart.py --repo /tmp/ab --name "restart-1b-1gpu-ab-$BENCH_COMMIT${phase#ab-restart}" \
                  --out "$results" $RESTART_ARGS 2>&1 | tail -8 ;;
    requeue-ab*)  # requeued starts of the .ab side and this tree, interleaved, from one cold job; REQUEUE_ARGS, e.g. --pairs 8
                ab_tree && python3 bench/requeue_ab.py --base /tmp/ab --name "requeue-ab-1b-1gpu-$BENCH_COMMIT${phase#requeue-ab}" \
                  --out "$results" ${REQUEUE_ARGS:-} 2>&1 | tail -8 ;;
    requeue-env*)  # requeued starts of this tree, B with REQUEUE_ENV_B (KEY=VALUE ...), one traced job per side
                python3 bench/requeue_ab.py --base . --env-b ${REQUEUE_ENV_B:-} --trace /tmp/trace \
                  --name "requeue-env-1b-1gpu-$BENCH_COMMIT${phase#requeue-env}" --out "$results" ${REQUEUE_ARGS:-} 2>&1 | tail -60 ;;
    checksum)   # the check's rate (CRC32C, and zlib's CRC32 as before) over 17 GiB of shard-like files in the page
                # cache, as the 1B shape's checkpoint on one GPU (restart phases remove their run directories)
                python3 bench/checksum.py /tmp/checksum-files --make-gib 17 \
                  --name "checksum-1b-1gpu-$BENCH_COMMIT" --out "$results" 2>&1 | tail -16; rm -rf /tmp/checksum-files ;;
    compile-site)  # give the image's packages the bytecode it lacks, as an image built with it has
                python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
                  > /dev/null 2>&1; echo "compileall exit $?" ;;
    correctness-mb32) python3 bench/correctness.py --runs-of bf16 --micro-batch 32 --name "correctness-mb32-$BENCH_COMMIT" \
                  --out "$results" 2>&1 | tail -8 ;;
    correctness) python3 bench/correctness.py --runs-of bf16 fp32-seed2 --name "correctness-$BENCH_COMMIT" --out "$results" \
                  2>&1 | tail -8 ;;
    startup-profile)  # where a cold and a requeued start-up go (sampled, so slower than restart's figures)
                name="startup-profiled-$BENCH_COMMIT"
                # its own folder: pip --target leaves out a wheel's scripts where /tmp/site/bin already exists
                [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --no-cache-dir \
                  --target /tmp/pyspy .whl/py_spy*.whl || exit 1
                python3 bench/restart.py --py-spy /tmp/pyspy/bin/py-spy --name "$name" --skip-empty-cache --out "$results" \
                  2>&1 | tail -6
                python3 bench/startup_profile.py "$results/$name"-1-*.speedscope.json --top 60 \
                  --name "startup-profile-$BENCH_COMMIT" --out "$results" 2>&1 | head -3
                rm -f "$results/$name"-1-*.speedscope.json  # tens of MB each; the summary keeps what they say
                python3 -X importtime -c "import pretrain.trainer.loop, torch; torch.cuda.init()" \
                  2> "$results/importtime-$BENCH_COMMIT.txt" ;;
    slurm-gpu)  bash tests/slurm/bundle.sh unpack .slurm-bundle/slurm.tar.gz 2>&1 | tail -3
                python3 bench/slurm_gpu.py --out "$results" 2>&1 | tail -30 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  pack
done

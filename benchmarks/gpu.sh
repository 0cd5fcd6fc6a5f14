#!/usr/bin/env bash
# The GPU check in one command (needs one CUDA GPU; issue 17):
#   1. every strategy's parity with PyTorch on CUDA (pytest -m cuda): NCCL at world size 1, and
#      2 ranks sharing the GPU through gloo; and no host synchronisation inside a training step;
#   2. single-GPU throughput of GPT-2 124M in bf16, every strategy vs plain PyTorch and FSDP2,
#      MFU printed;
#   3. timelines of FSDP training steps on the GPU (out/gpu/trace/*.png and .trace.json): a
#      compute lane and one lane per CUDA stream a collective was issued on; one rank (fsdp.*:
#      collectives are the identity there) and 2 ranks sharing the GPU through gloo
#      (fsdp_2ranks.*: the all-gathers and reductions on their side streams).
# Every part runs even when an earlier one fails (a GPU's time is often short: one failing test
# must not cost the throughput figures); the exit status is non-zero if any part failed, and the
# last lines name them.
# Extra arguments go to benchmarks/gpu_throughput.py (e.g. --batch_size 4 --peak_tflops 312).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU found')" ||
    exit 1
failed=()
part() {  # part NAME COMMAND...: run it, remember NAME if it fails
    local name=$1
    shift
    echo "== $name: $*"
    "$@" || failed+=("$name")
}
part "cuda tests" python -m pytest -q -m cuda  # tests/test_cuda.py, CUDA cases of test_autocast.py
part "throughput" torchrun --standalone --nproc_per_node=1 benchmarks/gpu_throughput.py "$@"
part "one-rank trace" torchrun --standalone --nproc_per_node=1 example/fsdp/train.py \
    --model gpt2_mini --precision bf16 --steps 6 --batch_size 8 --seq_len 256 --log_every 2 \
    --trace out/gpu/trace
part "two-rank trace" torchrun --standalone --nproc_per_node=2 benchmarks/gpu_trace.py \
    --out out/gpu/trace
if ((${#failed[@]})); then
    printf 'gpu.sh: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu.sh: every part passed"

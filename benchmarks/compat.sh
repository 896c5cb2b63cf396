#!/usr/bin/env bash
# The suite's representative subset on the oldest torch and Triton autopar supports: torch 2.11.0 and Triton 3.6.0,
# the GPU machines' image (with transformers 5.17.0), in a virtual environment of its own. CI stays on torch 2.13.
#
#     bash benchmarks/compat.sh                 # venv in ${TMPDIR:-/tmp}/autopar-venv-compat, made on first use
#     bash benchmarks/compat.sh /work/venv-compat
#
# The registry's torch 2.11.0 wheel is the CUDA build (several GB with its CUDA libraries); it runs on CPU. A
# machine that caps torch through pip's configuration (a `constraint` file) is told to drop the cap here:
# PIP_CONSTRAINT is set empty, which overrides the configuration file's. Takes ~15 minutes on two loaded cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${TMPDIR:-/tmp}/autopar-venv-compat}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    PIP_CONSTRAINT="" "$PY" -m pip install --quiet "torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" \
        networkx pulp highspy sympy numpy rich pytest pytest-timeout pytest-xdist hypothesis
fi
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# tracing the zoo; the strategies DTensor's rules give and their numeric checks; random-plan equivalence on 2 ranks; the CLI; the kernels under
# Triton's interpreter; what differs between the releases (autopar.compat's users); torch.distributed.pipelining's
# stages and schedules; mixed precision, host offload and atomic checkpoints (DCP). pytest-timeout is left out:
# its per-test limits are sized for CI on torch 2.13, and every multi-rank test carries its own timeout.
PYTHONPATH="$PWD" TRITON_INTERPRET=1 "$PY" -m pytest -p no:cacheprovider -p no:timeout -q -n 2 \
    tests/tracer tests/test_zoo_eager.py \
    tests/solver/test_strategies.py tests/solver/test_strategies_numeric.py \
    "tests/test_equivalence.py::test_random_plans_match_single_device[2]" \
    tests/cli \
    tests/kernels --deselect tests/kernels/test_compile_kernels.py \
    tests/test_compat.py tests/test_import.py tests/runtime/test_launch.py tests/runtime/test_rng.py \
    tests/profiler/test_causal_attention.py tests/solver/test_optimizer_step_memory.py \
    tests/pipeline/test_train.py tests/runtime/test_mixed_precision.py tests/runtime/test_offload.py \
    tests/runtime/test_checkpoint_faults.py
# Compiling the kernels for sm_80 and sm_90 in a process of its own: Triton 3.6 cannot import its compiler's
# gluon layer once triton.language was decorated under TRITON_INTERPRET in the same process (3.9 can)
PYTHONPATH="$PWD" "$PY" -m pytest -p no:cacheprovider -q -n 0 tests/kernels/test_compile_kernels.py

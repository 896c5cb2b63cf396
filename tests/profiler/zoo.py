"""Zoo models loaded by path (examples/ is not a package)."""
from __future__ import annotations

from tests.zoo import load_zoo as load_example  # noqa: F401  (the profiler tests import it from here)

# model -> dynamic dims its forward allows (mlp has no sequence dim; llama's rotary tables fix the
# sequence length at trace time, and hf_llama is traced with a static one too: half the trace time)
DYNAMIC = {
    "gpt2": {"batch": 0, "seq": 1},
    "bert": {"batch": 0, "seq": 1},
    "vit": {"batch": 0},
    "resnet": {"batch": 0},
    "mlp": {"batch": 0},
    "llama": {"batch": 0},
    "hf_gpt2": {"batch": 0, "seq": 1},
    "hf_llama": {"batch": 0},
}
SEQ = 64  # sequence length of the accuracy tests (and of the trace when it is static)


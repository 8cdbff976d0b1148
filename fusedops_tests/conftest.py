import os

import torch

# The interpreter-plan tests run Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 before
# triton is first imported. On a machine with CUDA the tests run the real kernels instead, unless the
# caller sets TRITON_INTERPRET=1 explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,
    # CI has time for more examples per property than a developer's edit-test loop wants.
    max_examples=int(os.environ.get("FUSEDOPS_HYPOTHESIS_EXAMPLES", "50" if os.environ.get("CI") == "true" else "20")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    # CI (CI=true) replays one fixed sequence of examples so a landing never hinges on a lucky draw;
    # local runs keep drawing new ones, which is where new failures are found.
    derandomize=os.environ.get("CI") == "true",
)
settings.load_profile("ci")

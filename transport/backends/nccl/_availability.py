"""Whether the nccl backend can run here, and the line ``python -m transport doctor`` prints."""

from __future__ import annotations

from ..._native import nccl as native


def gpu_reason(detail: bool = True) -> str | None:
    """None when this process can drive a GPU for NCCL (CUDA driver, CUDA torch, a device);
    ``detail``: with the loader's message for a missing driver."""
    import torch

    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is built without CUDA (install a CUDA build of torch)")
    driver = native.cuda_driver_error()
    if driver is not None:
        reasons.append(f"no CUDA driver ({driver})" if detail else "no CUDA driver")
    if not reasons and torch.cuda.device_count() == 0:
        reasons.append("no CUDA device is visible (torch.cuda.device_count() == 0)")
    return "; ".join(reasons) or None


def unavailable_reason() -> str | None:
    """None when NCCL can run here, else exactly why not."""
    lib, why = native.library()
    if lib is None:
        return why
    gpu = gpu_reason()
    if gpu is not None:
        return f"NCCL {lib.version_string} loads ({lib.path}), but {gpu}: nccl moves GPU memory"
    return None


def doctor_reason() -> str | None:
    """As :func:`unavailable_reason`, without what doctor's own CUDA and NCCL lines say."""
    lib, why = native.library()
    if lib is None:
        return why
    gpu = gpu_reason(detail=False)
    return None if gpu is None else f"needs a GPU: {gpu}"


def describe() -> str:
    """One line for ``python -m transport doctor``: the library in use, or why there is none."""
    lib, why = native.library()
    if lib is None:
        return f"not loaded: {why}"
    windows = "yes" if lib.has_windows else f"no (needs NCCL >= {'.'.join(map(str, native.WINDOW_VERSION))})"
    return f"{lib.version_string} from {lib.path} ({lib.how}); one-sided windows (ncclPutSignal): {windows}"

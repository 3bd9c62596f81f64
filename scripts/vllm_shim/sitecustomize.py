"""The vLLM check's test-environment shim (scripts/vllm_check.sh puts this folder on PYTHONPATH), never
the product's: PyPI's torchvision is a CUDA build whose C++ ops do not load beside torch+cpu
(`operator torchvision::nms does not exist`). With the schemas of its two unguarded ops defined before
it is imported, its pure-torch transforms work, and transformers 5.19's Gemma4Processor, which vLLM
builds (also in the subprocess that inspects the model), imports. A sitecustomize, so that every
Python process of the check gets it."""

try:
    import torch

    for _op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # noqa: BLE001 - no torch, or defined already: nothing to do
    pass

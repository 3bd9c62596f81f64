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

import os as _os

if _os.environ.get("GEMMA4ENC_CHECK_ENCODER_LOG"):
    # the serve check counts vLLM's vision encoder runs in the server's engine process: a line in this
    # file per Gemma4ForConditionalGeneration.embed_multimodal call, wrapped as its module loads
    import importlib.abc as _abc
    import importlib.util as _util
    import sys as _sys

    class _CountEncoder(_abc.MetaPathFinder):
        NAME = "vllm.model_executor.models.gemma4_mm"

        def find_spec(self, name, path, target=None):
            if name != self.NAME:
                return None
            _sys.meta_path.remove(self)
            spec = _util.find_spec(name)
            exec_module = spec.loader.exec_module

            def counted_exec(module):
                exec_module(module)
                cls = module.Gemma4ForConditionalGeneration
                embed = cls.embed_multimodal

                def embed_multimodal(self, **kwargs):
                    with open(_os.environ["GEMMA4ENC_CHECK_ENCODER_LOG"], "a") as f:
                        f.write(f"{_os.getpid()}\n")
                    return embed(self, **kwargs)

                cls.embed_multimodal = embed_multimodal

            spec.loader.exec_module = counted_exec
            return spec

    _sys.meta_path.insert(0, _CountEncoder())

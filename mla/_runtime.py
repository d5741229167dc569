"""Where the kernels run: a CUDA GPU, or Triton's CPU interpreter.

`import mla` imports this module first. With no CUDA GPU, and unless the user set
TRITON_INTERPRET themselves, it turns Triton's interpreter on *before* any kernel is
defined (``@triton.jit`` decides at decoration time whether it builds an interpreted
function) and says so once.

Two consequences of the interpreter, both from SPEC "The kernels":
- it multiplies bf16 *bit patterns* in ``tl.dot`` (triton-lang/triton#11584), so the
  kernels use float32 dot operands there (:data:`mla.kernels.tl_dot.OPERAND_DTYPE`);
- it cannot benchmark several autotune configs ("0 active drivers"), so the kernels
  use a single config there (:func:`single_config`).
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

#: True when a CUDA device is visible to torch.
HAS_CUDA: bool = torch.cuda.is_available()

_user_set = "TRITON_INTERPRET" in os.environ
if not HAS_CUDA and not _user_set:
    if "triton.language" in sys.modules:
        # Triton's library helpers written with @jit (tl.zeros, tl.cdiv, ...) were built when
        # triton.language was imported, in compiled mode: an interpreted kernel cannot call them.
        warnings.warn("mla: triton was imported before mla on a machine with no CUDA GPU; the "
                      "interpreter is turned on now, but Triton's @jit library functions were already "
                      "built for compiled mode and the kernels will fail. Import mla first, or set "
                      "TRITON_INTERPRET=1 before importing triton.", RuntimeWarning, stacklevel=3)
    os.environ["TRITON_INTERPRET"] = "1"
    print("mla: no CUDA GPU found; running the Triton kernels on the CPU interpreter "
          "(TRITON_INTERPRET=1). Expect it to be slow; use small shapes.")

#: True when Triton kernels run in the interpreter (CPU).
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")

def single_config() -> bool:
    """Whether kernels must use one config (the interpreter cannot autotune)."""
    return INTERPRET


"""What the device can run: the facts the attention path is chosen by, read at one place, and the verdict.

`read_device_facts` is the one function that asks torch about the device (its kind, CUDA compute capability,
whether this torch build has the flash kernel, whether the GPU has bf16). Everything that decides by those facts
(the precision `auto` resolves to, `model.attention=auto`, the refusal of an explicit `unpadded`) takes a
`DeviceFacts` value, so a test fakes a V100, an H100 or a torch without flash by building one.

`unpadded_problem` is the pure verdict: why the variable-length kernel of pretrain/model/varlen_attention.py
cannot run (None: it can). On CUDA that kernel is FlashAttention-2's varlen call inside torch: bf16 or fp16,
a head size that is a multiple of 8 up to 256, an sm80+ GPU. Elsewhere the reference kernel runs, which
computes what the padded path computes row for row, so it always can.

No torch at import: the launcher's preflight (pretrain/launch/preflight.py) imports the config checks that
use these types in a process that never loads torch; `read_device_facts` imports it when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLASH_PRECISIONS = ("bf16", "fp16")
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DeviceFacts:
    """The device as the attention path and the precision see it."""

    device_type: str  # cuda | cpu | ...
    capability: tuple[int, int] | None = None  # CUDA compute capability (None: not CUDA)
    flash_built: bool = False  # this torch build has the flash attention kernel
    bf16: bool = False  # the GPU computes in bf16 (precision auto picks it)

    @property
    def where(self) -> str:
        if self.capability is None:
            return self.device_type
        return f"{self.device_type} sm{self.capability[0]}{self.capability[1]}"


def read_device_facts(device: Any) -> DeviceFacts:
    """The facts of `device` (a torch.device): the one place they are read (tests build a DeviceFacts instead)."""
    import torch  # here only: this module's verdicts are imported by the torch-free launch preflight

    if device.type != "cuda":
        return DeviceFacts(device.type)
    # bf16 in hardware only: torch's default also says yes where it can merely emulate it (a V100, a T4)
    return DeviceFacts("cuda", tuple(torch.cuda.get_device_capability(device)),  # type: ignore[arg-type]
                       bool(torch.backends.cuda.is_flash_attention_available()),
                       bool(torch.cuda.is_bf16_supported(including_emulation=False)))


def unpadded_problem(facts: DeviceFacts, precision: str, head_dim: int) -> str | None:
    """Why the unpadded path's kernel cannot run on this device in `precision` (None: it can)."""
    if facts.device_type != "cuda":
        return None
    if not facts.flash_built:
        return "this torch build has no flash attention kernel"
    if facts.capability is not None and facts.capability < FLASH_MIN_CAPABILITY:
        major, minor = facts.capability
        return f"flash attention needs compute capability >= 8.0, this GPU has {major}.{minor}"
    if precision not in FLASH_PRECISIONS:
        return f"flash attention runs in bf16 or fp16, this run computes in {precision} (run.precision)"
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash attention needs a head size that is a multiple of 8 up to 256, this model has {head_dim}"
    return None


def unpadded_kernel(facts: DeviceFacts) -> str:
    """The kernel the unpadded path runs on this device, in words."""
    if facts.device_type == "cuda":
        return f"flash varlen on {facts.where}"
    return f"the reference varlen kernel on {facts.device_type} (padded SDPA row for row)"

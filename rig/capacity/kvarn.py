"""KV=kvarn in the planner: its packed page and its unquantized tail, from kernels/kvarn's layout alone.

vLLM 0.28 has no kvarn backend, so nothing of vLLM can size it; the format's own module
(``kernels/kvarn/reference.py``: the layout the Triton kernels and their tests are held to) is the
one place its bytes are written, and this module only reads it. What the planner assumes of the
backend that does not exist yet (docs/kvarn.md, "vLLM integration"): it publishes its page to vLLM
as a packed attention spec (``state_content_bytes`` per KV head and token, as TurboQuant does), its
kernel block is one 128-token group, and it keeps one tail per running sequence and attention layer.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

from rig import paths
from rig.kernels import load_file, module_name

REFERENCE = paths.ROOT / "kernels" / "kvarn" / "reference.py"
# The module name kernels/kvarn/kvarn_triton.py and the kvarn tests load reference.py under: one module object.
MODULE = module_name("kvarn", "reference")
BACKEND = "vllm_rig_kvarn"
"""The module name the kvarn-cache patch loads kernels/kvarn/vllm_backend.py under: one module object."""


@cache
def reference() -> ModuleType:
    """kernels/kvarn/reference.py (imports torch only), the one module object the kernels and tests load too."""
    return load_file(REFERENCE, MODULE)


def group_tokens() -> int:
    """Tokens that share channel scales: a page, the kernel's block and the unit a prefix hit can land on."""
    return reference().GROUP_TOKENS


def head_token_bytes(head_dim: int) -> int:
    """Packed bytes of one token of one KV head in one layer, K (4-bit) and V (2-bit) with their scales
    (reference.head_token_bytes: the layout's own figure, which the backend publishes to vLLM too)."""
    return reference().head_token_bytes(head_dim)


def tails_per_companion(attention_layers: int, tail: int, state_page: int) -> int:
    """Attention layers whose tails share one companion state layer: the backend's own rule
    (kernels/kvarn/vllm_backend.py, which imports vLLM; the planner has it imported already)."""
    return load_file(paths.ROOT / "kernels" / "kvarn" / "vllm_backend.py", BACKEND).tails_per_companion(
        attention_layers, tail, state_page)


def tail_bytes(kv_heads: int, head_dim: int, value_bytes: int) -> int:
    """One running sequence's unquantized tail in one attention layer (reference.tail_bytes)."""
    return reference().tail_bytes(kv_heads, head_dim, value_bytes)

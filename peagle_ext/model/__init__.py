"""The P-EAGLE draft model (docs/design.md sections 7 and 5).

- `config`: PEagleConfig (the speculators-format config.json) and PEagleOptions (training options).
- `layers`: RMSNorm, RoPE and the decoder layers.
- `draft_model`: PEagleDraftModel, its construction from a verifier and its checkpoint.
- `forward`, `partition`: the training forward over a COD layout, and its sequence partition.
- `vocab`: the draft vocabulary (d2t / t2d) and the MASK token id.
"""

from .config import ATTENTION_MODES, LAYER_TYPES, PEagleConfig, PEagleOptions, make_speculators_config
from .draft_model import CONFIG_NAME, WEIGHTS_NAME, PEagleDraftModel
from .vocab import build_vocab_mapping, resolve_mask_token_id

__all__ = [
    "ATTENTION_MODES",
    "LAYER_TYPES",
    "PEagleConfig",
    "PEagleOptions",
    "make_speculators_config",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "PEagleDraftModel",
    "build_vocab_mapping",
    "resolve_mask_token_id",
]

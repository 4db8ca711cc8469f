"""`peagle train`: training a P-EAGLE drafter for a verifier (docs/design.md section 7).

- `settings`: TrainSettings (defaults < --config file < flags) and TrainError.
- `build`: the verifier, the data and the drafter a run starts from.
- `dataset`, `hidden`: the packed rows and their verifier hidden states.
- `loop`: train() itself and the validation pass.
- `checkpoint`: crash-safe checkpoints and resume; `export`: the bf16 copy for vLLM.
- `distributed`: DDP / FSDP2 under torchrun.
- `metrics`, `optim`, `run_log`, `plots`: what a run measures and reports.
"""

from .checkpoint import CHECKPOINT_PREFIX, COMPLETE_MARKER, TRAINER_STATE, list_checkpoints, save_checkpoint
from .dataset import prepare_data
from .export import export
from .loop import TrainResult, evaluate, train
from .metrics import Meter, acceptance_length
from .optim import lr_lambda, make_adamw
from .run_log import RunLog
from .settings import TrainError, TrainSettings, load_config_file, settings_from

__all__ = [
    "CHECKPOINT_PREFIX",
    "COMPLETE_MARKER",
    "TRAINER_STATE",
    "list_checkpoints",
    "save_checkpoint",
    "prepare_data",
    "export",
    "TrainResult",
    "evaluate",
    "train",
    "Meter",
    "acceptance_length",
    "lr_lambda",
    "make_adamw",
    "RunLog",
    "TrainError",
    "TrainSettings",
    "load_config_file",
    "settings_from",
]

"""speculators' own training CLI with peagle_ext's backend switched on for every P-EAGLE model it
builds: run `python -m peagle_ext.integrations.speculators_train CONFIG.yaml [overrides]` (or under
`torchrun ... -m`) where you would run `-m speculators.train CONFIG.yaml [overrides]`. Needs
speculators installed with its own dependencies (its CLI and data pipeline)."""

from __future__ import annotations


def main():
    from .speculators_backend import enable_backend

    enable_backend()  # class-wide: the CLI builds the model itself
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve())


if __name__ == "__main__":
    main()

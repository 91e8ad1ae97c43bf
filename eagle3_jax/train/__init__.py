"""Drafter training: ShareGPT data (`data`), the EAGLE-3 training-time-test objective
(`objective`) and the optax/orbax training loop (`loop`, CLI entry `loop.main`)."""

__all__ = ["HParams", "TrainConfig", "build_parser", "main", "train_drafter"]


def __getattr__(name):  # lazy: `python -m eagle3_jax.train.loop` must not find loop pre-imported
    if name in __all__:
        from eagle3_jax.train import loop

        return getattr(loop, name)
    raise AttributeError(name)

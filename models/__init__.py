"""Model zoo for amppass: seeded, randomly initialised models and their example inputs."""

from models.zoo import SIZES, ZOO, ModelCase, build

__all__ = ["SIZES", "ZOO", "ModelCase", "build"]

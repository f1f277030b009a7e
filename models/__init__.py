"""Model zoo for amppass: seeded, randomly initialised models and their example inputs.

:mod:`models.zoo` holds a few families at two sizes (:func:`build`); :mod:`models.arch` holds real
architectures, one configuration each, with the shapes they serve and whether torch.export captures them
(:func:`build_arch`); :mod:`models.digits` holds a small digits CNN, its data and its training loop.
"""

from models.arch import ARCHS, ArchCase, build_arch
from models.zoo import SIZES, ZOO, ModelCase, build

__all__ = ["ARCHS", "SIZES", "ZOO", "ArchCase", "ModelCase", "build", "build_arch"]

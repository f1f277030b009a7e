"""Which Lightning a plugin is for: the standalone packages (``pytorch_lightning``, with ``lightning_fabric``) or
the unified ``lightning`` package (``lightning.pytorch``, ``lightning.fabric``).

The two ship the same code under different names, so their ``Precision`` classes are different classes, and each
``Trainer`` and ``Fabric`` accepts only its own package's (``L.Trainer`` given a plugin built on
``pytorch_lightning``'s raises "Found invalid type for plugin"). amppass therefore builds one plugin class per
package from one implementation (:func:`build`), and imports a package only when its plugin is asked for: with only
one of them installed, the other is never needed.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# package -> (what pip installs it as, the amppass module whose AmpPassPrecision is built on it)
PACKAGES = {
    "pytorch_lightning": ("pytorch-lightning", "amppass.integrations.lightning"),
    "lightning_fabric": ("pytorch-lightning", "amppass.integrations.fabric"),  # installed with pytorch-lightning
    "lightning.pytorch": ("lightning", "amppass.integrations.lightning.pytorch"),
    "lightning.fabric": ("lightning", "amppass.integrations.lightning.fabric"),
}


def _absent(error: ModuleNotFoundError, package: str) -> bool:
    """Whether ``error`` says ``package`` itself is not installed (not a module it imports in turn)."""
    return error.name in (package, package.split(".")[0])


def load(package: str, *modules: str) -> list[ModuleType]:
    """``package``'s submodules ``modules``, imported; if the package is not installed, an ImportError naming what to
    install."""
    try:
        return [importlib.import_module(f"{package}.{module}") for module in modules]
    except ModuleNotFoundError as error:
        if not _absent(error, package):
            raise
        requirement, home = PACKAGES[package]
        raise ImportError(f"{home}.AmpPassPrecision is the plugin for {package}, which is not installed: "
                          f"pip install {requirement}") from error


def installed(standalone: str, unified: str) -> str:
    """The package the plugin at the standalone package's path serves: ``standalone`` where it is installed (as
    before the unified package existed), else ``unified`` where only that one is installed."""
    for package in (standalone, unified):
        try:
            importlib.import_module(package)
            return package
        except ModuleNotFoundError as error:
            if not _absent(error, package):
                raise
    raise ImportError(f"{PACKAGES[standalone][1]}.AmpPassPrecision needs Lightning: pip install lightning "
                      "(for `import lightning`) or pip install pytorch-lightning (for `import pytorch_lightning`)")


def build(implementation: type, base: type, package: str, **attributes: Any) -> type:
    """The class ``AmpPassPrecision`` for ``package``: ``implementation`` (the methods, the same for every package)
    on ``package``'s ``Precision`` ``base``, with the package's own helper classes as ``attributes``."""
    namespace = {"__module__": PACKAGES[package][1], "__doc__": implementation.__doc__, "package": package,
                 **attributes}
    return type("AmpPassPrecision", (implementation, base), namespace)

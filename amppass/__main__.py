"""``python -m amppass``: the same command line as ``amppass``."""

from .cli import main

raise SystemExit(main())

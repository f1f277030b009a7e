"""Deprecated, removed in amppass 0.2.0: the report's modules are in :mod:`amppass.reporting`, and
``amppass.report`` is the function :func:`amppass.report`. This folder keeps only the old module paths the
docs of amppass 0.1 showed (``amppass.report.report``, ``amppass.report.terminal``); reading a name from one
warns."""

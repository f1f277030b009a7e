"""Deprecated, removed in amppass 0.2.0: this module is :mod:`amppass.reporting.terminal` now; reading a name here
warns and gives amppass.reporting.terminal's."""

from ..deprecation import moved

__getattr__ = moved(__name__, "0.2.0", DecisionsTable="amppass.reporting.terminal",
                    ELLIPSIS="amppass.reporting.terminal", GAP="amppass.reporting.terminal",
                    OpsTable="amppass.reporting.terminal", PRECISIONS="amppass.reporting.terminal",
                    Report="amppass.reporting.terminal", Row="amppass.reporting.terminal",
                    STYLES="amppass.reporting.terminal", cut="amppass.reporting.terminal",
                    decision_order="amppass.reporting.terminal", elide="amppass.reporting.terminal",
                    printable="amppass.reporting.terminal", render="amppass.reporting.terminal",
                    render_text="amppass.reporting.terminal", shorten_names="amppass.reporting.terminal",
                    summary_lines="amppass.reporting.terminal", summary_panel="amppass.reporting.terminal")

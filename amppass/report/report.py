"""Deprecated, removed in amppass 0.2.0: this module is :mod:`amppass.reporting.report` now; reading a name here
warns and gives amppass.reporting.report's."""

from ..deprecation import moved

__getattr__ = moved(__name__, "0.2.0", InputError="amppass.reporting.report", LOCAL_ERROR="amppass.reporting.report",
                    LOW_PRECISIONS="amppass.reporting.report", OUTPUT_ERROR="amppass.reporting.report",
                    OpGroup="amppass.reporting.report", PRECISIONS="amppass.reporting.report",
                    PRECISION_FILTERS="amppass.reporting.report", Report="amppass.reporting.report",
                    Row="amppass.reporting.report", SCHEMA_VERSION="amppass.reporting.report",
                    check_regular="amppass.reporting.report", finite="amppass.reporting.report",
                    load_schema="amppass.reporting.report", merged="amppass.reporting.report",
                    render_html="amppass.reporting.report", same_op="amppass.reporting.report",
                    summary_lines="amppass.reporting.report", write_atomic="amppass.reporting.report")

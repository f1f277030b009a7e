"""The neutral view of an FX graph for the analysis: canonical op names, the ATen policy table, kernel facts,
multiply-add counts."""

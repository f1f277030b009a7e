"""What the neutral searches call back to run an FX graph: calibration, the finite check, profitability timings,
the tolerance search's trial runs from kept fp32 values."""

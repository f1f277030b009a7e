"""What the neutral searches call back to run an FX graph: calibration, the finite check, profitability timings, tolerance-search prefixes."""

"""Front-end-neutral precision analysis: op categories, the plan, painting and calibration."""

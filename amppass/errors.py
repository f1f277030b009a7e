"""Errors amppass raises for problems a user can cause and fix."""


class AmpPassError(Exception):
    """A problem with the caller's model, data or arguments; the message says what to do."""


class CaptureError(AmpPassError):
    """The model could not be captured as a graph (torch.fx / torch.export)."""


class InputError(AmpPassError):
    """An argument, file or dtype that amppass cannot use."""


class CalibrationError(AmpPassError):
    """Calibration data that is empty, non-finite or does not match the model's inputs."""

"""Errors amppass raises for problems a user can cause and fix, and how another error is quoted in one line."""


class AmpPassError(Exception):
    """A problem with the caller's model, data or arguments; the message says what to do."""


class CaptureError(AmpPassError):
    """The model could not be captured as a graph (torch.fx / torch.export)."""


class InputError(AmpPassError):
    """An argument, file or dtype that amppass cannot use."""


class CalibrationError(AmpPassError):
    """Calibration data that is empty, non-finite or does not match the model's inputs."""


class ScalerUsageError(AmpPassError, RuntimeError):
    """LossScaler's methods called out of order (also a RuntimeError, which torch.amp.GradScaler raises there)."""


class ScalerValueError(InputError, ValueError):
    """A LossScaler setting, gradient or state dict it cannot use (also a ValueError, as GradScaler raises)."""


class ScaleCollapseError(AmpPassError, RuntimeError):
    """Gradients still overflow with the loss scale at its minimum: training cannot go on in fp16."""


def first_line(err: BaseException | None, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when the message is empty), cut at ``limit``
    characters with " ..." after the cut (torch's messages can hold the repr of every input tensor): how
    amppass quotes an error it caught inside a one-line message or log."""
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    return line if limit is None or len(line) <= limit else line[:limit] + " ..."

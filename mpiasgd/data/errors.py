"""The error type of bad input data, raised by every module of `mpiasgd.data` (and caught by start-up,
which prints it as one line)."""


class DataError(ValueError):
    """Bad input data: a missing or malformed file or folder, or an impossible request.

    The message names the file or folder and says what was expected and what was found.
    """

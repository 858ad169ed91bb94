"""The error of a network definition that cannot be built (`definition.py`, `spec.py`, the layers'
`layer_spec`)."""


class ModelSpecError(ValueError):
    """A network definition that cannot be built, or a --model reference that does not name one."""

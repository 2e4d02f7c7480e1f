"""nnterp: the same names and values on every decoder family, as live nnsight tensors."""

from .catalog import CATALOG, Value
from .errors import BadAssignment, NNterpError, UnknownArchitecture, UnsupportedConfig, ValueUnavailable
from .standardized import Availability, StandardizedTransformer

__all__ = [
    "CATALOG",
    "Availability",
    "BadAssignment",
    "NNterpError",
    "StandardizedTransformer",
    "UnknownArchitecture",
    "UnsupportedConfig",
    "Value",
    "ValueUnavailable",
]
__version__ = "0.1.0"

"""DocVQA (validation) scored by ANLS; see README.md in this folder."""

from .anls import anls

__all__ = ["anls"]

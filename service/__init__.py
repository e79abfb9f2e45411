"""lmhead: a serving system for language-model heads, tied and untied.

Only the version and the reference math live at package level; importing does no other work.
"""

from service.heads.reference import output_projection_tied, output_projection_untied

__version__ = "0.1.0"
__all__ = ["__version__", "output_projection_tied", "output_projection_untied"]

"""User-facing tools that drive meshtrain from the outside (``python -m tools.<name>``)."""

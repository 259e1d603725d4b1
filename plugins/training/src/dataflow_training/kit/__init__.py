"""The shared family kit: what every model family would otherwise retype."""

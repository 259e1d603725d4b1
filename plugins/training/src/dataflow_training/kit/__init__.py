"""The family kit: what every model family would otherwise write itself."""
